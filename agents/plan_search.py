"""Plan-level evolutionary search: mutate and cross the best plans found so far, never enumerate.

Why: ops interact (a fused norm changes what the projection after it reads; a bigger graph set
changes capture memory), so per-op tuning alone misses combinations. A small population evolves
by tournament selection, crossover and mutation over the candidate space, seeded with the
baseline, any seed plans given (earlier compiles, hand-set plans: a warm start, as a recompile on
drift should not rediscover what the last one found), the kernel tuner's findings and a few
random plans; the cost model prunes children
predicted to lose before they cost engine time. Scheduler knobs are left to the scheduler tuner:
they do not change a decode step, so timing them here would only select noise.

Before evolving, each fusion is tried alone on the base (``fusion_trials``): a fusion saves a few
kernels a layer, which random plans bury under their other moves (session 19's compile measured
``folded_norm``, -2.1% on the 8B decode step, only inside random plans without decode graphs, at
7.4 ms against the base's 0.6 ms), so the composite would never carry it.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

from anneal.engine.plan import (
    BF12_GEMV_DEFAULTS, BF12_GEMV_OP_DEFAULTS, BF12_WEIGHT_IMPL, GEMV_FUSION_PROJECTIONS, STEP_FUSIONS, OpChoice, Plan,
    inert_fusions, retiled_fusions,
)
from anneal.agents.board import Board, SearchSetting
from anneal.agents.cost_model import CostModel
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.space import CandidateSpace, normalized
from anneal.agents.types import BenchSpec, Candidate


# What can change a decode step's time; scheduler knobs only show in a workload (scheduler tuner).
STEP_MOVES = ("op", "fusion", "graphs")
FUSION_TRIAL_SEED = 7100  # decode-step seeds of the fusion trials (7100, 7101, ...), none a search's own
FUSION_RETRIAL_SEED = 7600  # the same beside the tuned ops (``fusion_retrials``)
FUSION_COMMON_TILES_SEED = 7800  # ... and on the common tiles beside them
FUSION_ADDITION_SEED = 8100  # the fusions the composite lacks, each on it (``fusion_additions``)
FUSION_STACK_SEED = 7900  # the composite's fusions timed together (``fusion_stack_check``)
# A fusion whose trial on the base lost by more than this is not tried again on the composite
# (session 50's call-3 compile: linear_norm x1.159, norm_linear x1.145 there; rope_attention x0.996).
FUSION_ADDITION_BAND = 0.03
# A retiled fusion that loses beside the tuned ops by less than this is tried again on the common
# tiles (session 47: norm_stats x1.010 on gate_up's own, x0.980 on the common ones in session 46).
FUSION_COMMON_TILES_BAND = 0.03
FUSION_MIN_GAIN = 0.005  # a fusion's trial keeps it when the whole model's step is this much faster
# ... or when each of its fast-tier steps is this much under both base steps beside it and the whole
# model gains at all: a once-a-step fusion's clear gain shrinks in the projection to every layer
# (session 51: lm_head_argmax x0.974 on the composite's 2-layer step, x0.997 projected, not kept; the
# hand-set plan that carries it read +0.3% over the compile's beside it).
FUSION_CLEAR_GAIN = 0.01


def full_model_ratio(cm: CostModel | None, fusion: str, base: Plan, spec: BenchSpec, base_ms: float,
                     fused_ms: float) -> float:
    """A fusion's fast-tier step ratio as the whole model would see it (``CostModel.whole_model_ratio``:
    a per-layer fusion's saving counted in every layer, ``lm_head_argmax``'s once; on an engine with
    every layer, the measured ratio). Without a cost model, the measured ratio."""
    if cm is None:
        return fused_ms / base_ms
    return cm.whole_model_ratio(base, spec, base_ms, fused_ms, per_layer=fusion not in STEP_FUSIONS)


# A fusion whose whole-model ratio lands this close to the keep bar gets a second reading (a fresh
# B F B), and the mean of the two decides: one reading on the 2-layer fast tier moves by ~0.5-1%,
# and the fusions near the bar are the per-layer ones whose saving the projection scales up
# (session 21-22: rope_attention read x0.995, x1.000, x0.987 on the 8B's chat and agentic trials,
# -1.0..-1.7% a step on the full model).
FUSION_REREAD_BAND = 0.01
# How long past its deadline the base step that closes a fusion's B F B reading may still start. The
# base's kernels are compiled, so it is a reading of a few seconds; without it a deadline that falls
# while the fused step runs throws that step away (session 48: the H200's 150-s chat compile timed
# rope_attention, the last fusion of its trials, and never decided it).
CLOSING_BASE_GRACE_S = 60.0


def _decode_step_ms(lab: Lab, agent: str, spec: BenchSpec, plan: Plan, seed: int, note: str, *,
                    deadline: float | None, grace_s: float = 0.0) -> tuple[float | None, str]:
    """``plan``'s decode step (``spec`` at ``seed``) on the fast tier, never pruned: its median ms (None
    when it could not be timed) and the verdict's reason. The fusion trials' and the stack check's
    readings."""
    exp = lab.measure(Candidate(plan=plan, agent=agent, note=note), spec.model_copy(update={"seed": seed}),
                      prune=False, deadline=deadline, grace_s=grace_s)
    return (exp.measurement.median_ms if exp.measurement is not None else None), exp.verdict.reason


def fusion_trials(lab: Lab, setting: SearchSetting, board: Board, agent: str, min_gain: float, *,
                  base: Plan | None = None, names: list[str] | None = None, seed: int = FUSION_TRIAL_SEED,
                  deadline: float | None = None, keep: Callable[[str, float], None] | None = None,
                  where: str = "", ops_for: Callable[[str], Plan] | None = None) -> dict[str, float]:
    """Each fusion the base does not have, alone on the base, its decode step timed between two
    of the base's (B F1 B F2 B ..., a fresh seed each): the fast tier's host drifts over a search
    (compile-ahead's builds share it), so a fusion is only compared with the base steps beside it.
    Kept on the board (the composite carries it) when its step, projected to the whole model
    (``full_model_ratio``), is ``min_gain`` faster than their mean; one within
    ``FUSION_REREAD_BAND`` of that bar is read again after the others, and the mean of its two
    readings decides. Its plan is offered as a candidate either way. A fusion that would run
    nothing on this model under the base's params (``plan.inert_fusions``) is not tried.
    A fusion whose every fused step is ``FUSION_CLEAR_GAIN`` under both base steps beside it is kept on
    any whole-model gain: the fast tier read it clear of noise, the projection only scales it.
    ``base`` (the setting's by default), ``names`` (every fusion of the space), ``seed`` (the
    first step's), ``keep`` (``board.keep_fusion``) and ``where`` (said in the notes) are what
    ``fusion_retrials`` changes, and ``ops_for(f)``: the ops ``f`` is tried on (the base's by
    default); no step starts after ``deadline`` (``time.monotonic``) but the base step that closes a
    timed fused step's reading (up to ``CLOSING_BASE_GRACE_S`` after it). Returns each decided
    fusion's whole-model ratio; those read on the setting's base also go to ``board.fusion_ratios``."""
    on_setting_base = base is None
    base = base or setting.base
    keep = keep or board.keep_fusion
    trials = []
    for f in (setting.space.fusions if names is None else names):
        on = ops_for(f) if ops_for is not None else base
        plan = normalized(on.model_copy(update={"fusions": {**base.fusions, f: True}, "name": None}))
        if not base.fusions.get(f) and plan.fusions.get(f) and plan.hash != base.hash:
            inert = inert_fusions(plan, setting.model_config).get(f) if setting.model_config else None
            if inert:  # the engine would run the unfused ops: its trial would time noise
                board.note(f"fusion {f}{where}: not tried, it runs nothing on this model under the base's params ({inert})")
                continue
            trials.append((f, plan))  # normalized drops a fusion the base's ops exclude
    if not trials:
        return {}
    spec = setting.decode_spec.model_copy(update={"per_op": False})
    bar = 1 - min_gain
    seeds = iter(range(seed + 1, seed + 1 + 2 * len(trials)))
    base_note = f"fusion trials{where}: the base"

    step_ms = functools.partial(_decode_step_ms, lab, agent, spec, deadline=deadline)
    prev = step_ms(base, seed, base_note)
    readings: dict[str, list[tuple[float, float, float, float]]] = {}  # (fused, before, after, full)

    def read(f: str, plan: Plan) -> bool:
        """One B F B reading of ``f`` (the B before it shared with the last reading); False if a
        step could not be timed."""
        nonlocal prev
        seed = next(seeds)
        fused = step_ms(plan, seed, f"fusion trial{where}: {f}")
        # a timed fused step is bracketed even where the deadline fell while it ran
        after = step_ms(base, seed, base_note, grace_s=CLOSING_BASE_GRACE_S if fused[0] is not None else 0.0)
        steps = prev, fused, after
        prev = after
        failed = next((why for ms, why in steps if ms is None), None)
        if failed is not None:
            board.note(f"fusion {f}{where}: no step time ({failed}); not kept")
            return False
        (before, _), (fused, _), (after, _) = steps
        full = full_model_ratio(lab.cost_model, f, base, spec, (before + after) / 2, fused)
        readings.setdefault(f, []).append((fused, before, after, full))
        return True

    out_of_budget: BudgetExhausted | None = None
    try:  # the budget can end anywhere in here: what was read by then is still decided on
        for f, plan in trials:
            read(f, plan)
        for f, plan in trials:
            if f in readings and abs(readings[f][0][3] - bar) < FUSION_REREAD_BAND and not read(f, plan):
                readings.pop(f)
    except BudgetExhausted as e:
        out_of_budget = e
    decided: dict[str, float] = {}
    for f, plan in trials:
        if f not in readings:
            continue
        rs = readings[f]
        full = decided[f] = sum(r[3] for r in rs) / len(rs)
        if on_setting_base:
            board.record_fusion_ratio(f, full)
        fused, before, after, _ = rs[0]
        again = "" if len(rs) == 1 else f" (readings {', '.join(f'x{r[3]:.3f}' for r in rs)}: the mean)"
        clear = all(r[0] <= (1 - FUSION_CLEAR_GAIN) * min(r[1], r[2]) for r in rs)
        won = full < bar or (full < 1 and clear)
        board.note(f"fusion {f}{where}: decode step {fused:.3f} ms, x{fused / ((before + after) / 2):.3f} the base's "
                   f"beside it ({before:.3f}, {after:.3f} ms), x{full:.3f} on the whole model{again}"
                   + (("; kept" if full < bar else f"; kept: every fused step {FUSION_CLEAR_GAIN:.0%} or more under "
                       "the base's beside it") if won else "; not kept"))
        board.offer_plan(sum(r[0] for r in rs) / len(rs), plan, agent)
        if won:
            keep(f, full)
    if out_of_budget is not None:
        raise out_of_budget
    return decided


def common_tiles(space: CandidateSpace, op: str, choice: OpChoice) -> OpChoice:
    """``choice`` with the bf12 GEMV's per-projection defaults (``BF12_GEMV_OP_DEFAULTS``) back at
    the tiles every projection shares (bf12's common ones, else the bf16 GEMV's defaults); other
    choices as they are. Those defaults won on the projection alone; a fused GEMV takes them too."""
    keys = BF12_GEMV_OP_DEFAULTS.get(op, {}) if choice.impl == BF12_WEIGHT_IMPL else {}
    space_op = space.ops.get(op)
    bf16 = space_op.default("triton_gemv_splitk") if space_op is not None else {}
    common = {k: BF12_GEMV_DEFAULTS.get(k, bf16.get(k)) for k in keys}
    common = {k: v for k, v in common.items() if v is not None}
    return choice.model_copy(update={"params": {**choice.params, **common}}) if common else choice


def fusion_retrials(lab: Lab, setting: SearchSetting, board: Board, agent: str = "plan-search",
                    min_gain: float = FUSION_MIN_GAIN, deadline: float | None = None) -> list[str]:
    """The GEMV fusions the tuned ops retile (``plan.retiled_fusions``), each tried again as
    ``fusion_trials`` tries it, beside the base with every tuned op instead of the bare base; the
    composite then counts a retiled fusion by this trial alone (``Board.retried_fusions``).

    Why: a fused GEMV runs its projection's tiles and weight copy, so its trial on the base timed
    another kernel than the composite would run, and the composite dropped it. Session 45's chat
    compile put every projection on the bf12 GEMV: gate_up_silu, kept on the base at x0.994, was left
    out; linear_norm and norm_stats, x1.15 and x1.01 there (where they also took o / down off
    cuBLAS), were never timed over bf12, though the norm kernels they remove were ~0.2 ms of a
    ~6.7-ms step. Runs after the op trials (the tuned ops are final then), best on the base first
    (``Board.fusion_ratios``); none when no tuned op retiles a fusion of the space. A fusion that
    loses there by less than ``FUSION_COMMON_TILES_BAND`` is tried once more with its projections on
    the common tiles (``common_tiles``), read against the tuned ops, so the tiles' cost is in its
    ratio; the composite then weighs the two (``Board._retiled_for_fusions``). Returns the fusions
    it tried."""
    tuned = board.tuned_ops(setting.base).model_copy(update={"name": None})
    names = [f for f in retiled_fusions(tuned, setting.base) if f in setting.space.fusions]
    # the best on the base first, those never read there last: a short budget ends these trials
    # early (session 48's H200 chat compile read four of them, norm_stats not among them)
    names.sort(key=lambda f: board.fusion_ratios.get(f, math.inf))
    if not names:
        return []
    ratios = fusion_trials(lab, setting, board, agent, min_gain, base=tuned, names=names, seed=FUSION_RETRIAL_SEED,
                           deadline=deadline, keep=lambda f, ratio: board.keep_retried_fusion(tuned, f, ratio),
                           where=" beside the tuned ops")
    # A fusion that lost narrowly, on projections the per-projection defaults retile: once more on
    # the common tiles, read against the tuned ops (the composite weighs the two: Board._retiled_for_fusions)
    near = sorted((r, f) for f, r in ratios.items()
                  if f not in board.retried_fusions and r < 1 + FUSION_COMMON_TILES_BAND)
    on_common: dict[str, Plan] = {}
    for _, f in near:
        ops = {p: common_tiles(setting.space, p, tuned.choice(p)) for p in GEMV_FUSION_PROJECTIONS.get(f, ())}
        ops = {p: ch for p, ch in ops.items() if ch != tuned.choice(p)}
        if ops:
            on_common[f] = tuned.with_ops(**ops)
    if on_common:
        fusion_trials(lab, setting, board, agent, min_gain, base=tuned, names=list(on_common),
                      seed=FUSION_COMMON_TILES_SEED, deadline=deadline, ops_for=on_common.__getitem__,
                      keep=lambda f, ratio: board.keep_retried_fusion(on_common[f], f, ratio, against=tuned),
                      where=" on the common tiles, beside the tuned ops")
    return names


def fusion_additions(lab: Lab, setting: SearchSetting, board: Board, agent: str = "plan-search",
                     min_gain: float = FUSION_MIN_GAIN, deadline: float | None = None) -> list[str]:
    """Each fusion the composite lacks (and its ops allow), tried on the composite as
    ``fusion_trials`` tries one on the base (C F C, a fresh seed each fusion), the best on the base first; one
    that wins is kept, as a retrial on the composite's tiles where those retile it, and the next is
    tried on the composite that carries it. Those that lost on the base by more than
    ``FUSION_ADDITION_BAND`` are not tried. Returns the fusions it kept.

    Why: a fusion can pay more beside another than alone. rope_attention read x0.996 on the base in
    session 50's chat compile and was dropped; beside folded_norm it also applies the 1/rms the
    separate RoPE kernel would, and the hand-set plan that carries both ran its bs-12 step in 5121 µs
    against 5211 for the compile's plan without it."""
    kept: list[str] = []
    tried: set[str] = set()
    while True:
        comp = board.composite(setting.base).model_copy(update={"name": None})
        names = [f for f in setting.space.fusions if not comp.fusions.get(f) and f not in tried
                 and board.fusion_ratios.get(f, 1.0) < 1 + FUSION_ADDITION_BAND]
        names.sort(key=lambda f: board.fusion_ratios.get(f, math.inf))
        if not names:
            return kept
        f = names[0]
        tried.add(f)
        retiled = f in retiled_fusions(comp, setting.base)

        def keep(name: str, ratio: float, comp: Plan = comp, retiled: bool = retiled) -> None:
            if retiled:  # its fused GEMV runs the composite's tiles: it counts while they stay
                board.keep_retried_fusion(comp, name, ratio)
            else:
                board.keep_fusion(name, ratio)
            kept.append(name)

        fusion_trials(lab, setting, board, agent, min_gain, base=comp, names=[f],
                      seed=FUSION_ADDITION_SEED + 10 * len(tried), deadline=deadline, keep=keep,
                      where=" on the composite")


def fusion_stack_check(lab: Lab, setting: SearchSetting, board: Board, agent: str = "plan-search",
                       deadline: float | None = None) -> list[str]:
    """The composite's fusions timed together: while it runs two or more, each one's step is read
    against the composite without it (C W1 C W2 C ..., a fresh seed each), and the one that gains
    least, if it gains nothing there (its whole-model ratio at or above 1), leaves the board; then
    the new composite is read the same way. Returns the fusions dropped, in order.

    Why: each fusion was kept on a trial that ran it alone, and the composite takes their gains to
    compound (``Board._fusion_set``), but one fusion can change another's kernel: under
    ``folded_norm`` the gate_up_silu GEMV scales by o_proj's row statistics (GEMV ``NORM`` mode 4).
    Session 50's chat compile kept both (x0.983 and x0.981 alone beside the tuned ops), never timed
    them together, and promoted the pair: its GEMV ran 81.5 us against 63 at bs 12 and the plan
    replayed x1.213 where folded_norm alone read x1.330. One fusion goes a round, the worst: a pair
    that hurts only together would otherwise lose both."""
    dropped: list[str] = []
    spec = setting.decode_spec.model_copy(update={"per_op": False})
    seeds = itertools.count(FUSION_STACK_SEED)

    def step_ms(plan: Plan, note: str, grace_s: float = 0.0) -> float | None:
        return _decode_step_ms(lab, agent, spec, plan, next(seeds), note, deadline=deadline, grace_s=grace_s)[0]

    while True:
        comp = board.composite(setting.base).model_copy(update={"name": None})
        names = sorted(f for f, on in comp.fusions.items() if on and not setting.base.fusions.get(f))
        if len(names) < 2:
            return dropped
        together = "+".join(names)
        ratios: dict[str, float] = {}
        prev = step_ms(comp, f"fusion stack {together}: all")
        for f in names:
            without = normalized(comp.model_copy(update={"fusions": {k: v for k, v in comp.fusions.items() if k != f}}))
            alone = step_ms(without, f"fusion stack {together}: without {f}")
            after = step_ms(comp, f"fusion stack {together}: all", grace_s=CLOSING_BASE_GRACE_S if alone else 0.0)
            if None not in (prev, alone, after):
                ratios[f] = full_model_ratio(lab.cost_model, f, without, spec, alone, (prev + after) / 2)
            prev = after
        if not ratios:
            board.note(f"fusions {together} together: no step time; all kept")
            return dropped
        worst = max(ratios, key=ratios.get)
        board.note(f"fusions {together} together: each one's whole-model ratio beside the others "
                   + ", ".join(f"{f} x{r:.3f}" for f, r in sorted(ratios.items()))
                   + (f"; {worst} dropped" if ratios[worst] >= 1.0 else "; all kept"))
        if ratios[worst] < 1.0:
            return dropped
        board.drop_fusion(worst)
        dropped.append(worst)


class PlanSearch:
    name = "plan-search"

    def __init__(self, population: int = 6, max_children: int | None = None, stall_limit: int = 40,
                 fusion_min_gain: float = FUSION_MIN_GAIN):
        self.population = population
        self.max_children = max_children
        self.stall_limit = stall_limit  # stop after this many children in a row add nothing new
        self.fusion_min_gain = fusion_min_gain

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        rng = setting.rng(self.name)
        space, spec = setting.space, setting.decode_spec
        pop: list[tuple[float, Plan]] = []
        seen: set[str] = set()

        def evaluate(plan: Plan, note: str, parent: str | None = None) -> None:
            seen.add(plan.hash)
            exp = lab.measure(Candidate(plan=plan, agent=self.name, note=note, parent=parent), spec)
            if exp.verdict.status == "measured" and exp.measurement is not None:
                ms = exp.measurement.median_ms
                # parents chosen as the whole model would rank them, not by the head-heavy fast step
                pop.append((ms if lab.cost_model is None else lab.cost_model.whole_model_ms(plan, spec, ms), plan))
                pop.sort(key=lambda t: t[0])
                del pop[self.population:]
                board.offer_plan(ms, plan, self.name)

        try:
            evaluate(setting.base, "baseline")
            fusion_trials(lab, setting, board, self.name, self.fusion_min_gain)
            for plan in setting.seeds:
                if plan.hash not in seen:
                    evaluate(plan, f"seed {plan.name or plan.hash[:12]}")
            for i in range(max(1, self.population // 2)):
                evaluate(space.random_plan(rng, setting.base), f"random #{i}")
            children, stall = 0, 0
            while self.max_children is None or children < self.max_children:
                lab.check_budget()
                tuned = board.composite(setting.base)
                if tuned.hash not in seen:
                    evaluate(tuned.model_copy(update={"name": None}), "kernel-tuner findings")
                    continue
                fused = board.composite(setting.base, fusions_first=True)  # the kept fusions over tuned ops
                if fused.hash not in seen:
                    evaluate(fused.model_copy(update={"name": None}), "kept fusions + kernel-tuner findings they allow")
                    continue
                if not pop:
                    evaluate(space.random_plan(rng, setting.base), "random restart")
                    continue
                a = _tournament(pop, rng)
                if len(pop) > 1 and rng.random() < 0.5:
                    b = _tournament(pop, rng)
                    child = space.mutate(space.crossover(a, b, rng), rng, n=rng.randint(0, 1), moves=STEP_MOVES)
                    note = f"crossover {a.hash[:6]}x{b.hash[:6]}"
                else:
                    child = space.mutate(a, rng, n=rng.randint(1, 2), moves=STEP_MOVES)
                    note = f"mutate {a.hash[:6]}"
                if child.hash in seen:
                    stall += 1
                    if stall >= self.stall_limit:
                        return  # the reachable neighbourhood is exhausted
                    continue
                stall = 0
                children += 1
                evaluate(child, note, parent=a.hash)
        except BudgetExhausted:
            return


def _tournament(pop: list[tuple[float, Plan]], rng, k: int = 2) -> Plan:
    picks = [pop[rng.randrange(len(pop))] for _ in range(min(k, len(pop)))]
    return min(picks, key=lambda t: t[0] if math.isfinite(t[0]) else math.inf)[1]
