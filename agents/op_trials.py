"""The kernel tuner's findings confirmed on the decode step, before the composite carries them.

Why: the tuner ranks an op's configurations by the op's own time in eager steps (a 2-layer step
moves ~1% run to run, more than most single-op changes), at the traffic's typical batch and at 1.
Session 26's 30-minute chat compile kept three such findings; replayed one at a time on the hand-set
best plan (session 27, H200, two rounds), the decode attention it chose (ticket merge, 2 stages)
made the whole model's decode steps 2.1-2.7% slower and the Triton gate_up (up to 8 rows) 0.9-2.1%:
the ticket merge wins alone and loses inside a graph beside cuBLAS (session 22), and the GEMV's
batch limit of 8 put it at batches 2-8, where the tuner never timed it. So each finding runs alone
on the base plan, its decode step (graph replay) timed between two of the base's, at the typical
batch and in the drain below it, and the composite keeps it only when that step, projected to the
whole model, is faster. The decode step is not all a replay runs: a projection's finding also runs
in the prompt steps, where its row limit may hand thousands of rows to a GEMV (session 56: gate_up at
``max_m`` 0, x0.928 on the decode step, doubled the slow tier's prompt steps and failed every promoted
candidate). So a prompt step is timed the same way, and weighed by its share of a replay's time.
"""

from __future__ import annotations

import math

from anneal.engine.plan import Plan
from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted
from anneal.agents.types import Candidate

OP_TRIAL_SEED = 7300  # decode-step seeds of the op trials (7300, 7301, ...), none a search's own
# A replay's decode steps by batch: most at the typical batch, about a third in the drain from it to
# one row (session 10, chat on the H200), where a batch limit (the GEMVs' max_m) switches kernels.
TYPICAL_SHARE = 2 / 3
# A finding whose weighted ratio lands this close to 1 is read again (fresh seeds) and the mean of
# the two decides. On the H200 (8B, 2 layers, session 27) one reading of a choice that runs the
# base's very kernels at a batch (the Triton gate_up above its 8 rows) read x1.009-1.030 there.
OP_REREAD_BAND = 0.02
PROMPT = "prompt"  # the prompt step's key beside the decode batches' in a reading's shared base times


def trial_batches(setting: SearchSetting) -> dict[int, float]:
    """Batch -> weight: the typical batch, and the drain's 1 and geometric middle sharing the rest."""
    typical = setting.decode_spec.batch_size
    drain = sorted({1, max(1, round(typical ** 0.5))} - {typical})
    if not drain:
        return {typical: 1.0}
    return {typical: TYPICAL_SHARE, **{b: (1 - TYPICAL_SHARE) / len(drain) for b in drain}}


def op_trials(lab, setting: SearchSetting, board: Board, agent: str = "kernel-tuner", seed: int = OP_TRIAL_SEED,
              deadline: float = math.inf) -> None:
    """Each op the board holds a tuned choice for, alone on the base, its decode step timed B T B
    at each of ``trial_batches`` (the B before a reading shared with the last one); one within
    ``OP_REREAD_BAND`` of 1 is read again and the mean decides. A choice whose weighted step ratio,
    projected to the whole model, is not below 1 leaves the board with a note;
    so does one the trials could not time. Runs after the search (its own seeds, so a resumed
    compile reuses them; ``seed`` the first, for a second independent reading); each reading is
    offered as a plan like any other step. No new reading starts after ``deadline``
    (``time.monotonic``; the ledger's are reused whatever the time): an op not tried by then is left
    at the base's choice too, as untried findings were what lost in session 26's composite."""
    base = setting.base
    changed = sorted((op, ch) for op, (ch, _) in board.best_ops.items() if ch != base.choice(op))
    decode_ops = [(op, ch) for op, ch in changed if setting.spec_for(op, 1).mode == "decode"]
    if not decode_ops:
        return
    cm = lab.cost_model
    spec = setting.decode_spec.model_copy(update={"per_op": False})
    prompt_spec = setting.spec_for("attention_prefill", 1).model_copy(update={"per_op": False})
    batches = trial_batches(setting)
    seeds = iter(range(seed, seed + 1000))
    prev: dict[int | str, float | None] = {}

    def step_ms(plan: Plan, batch: int | str, seed: int, note: str) -> float | None:
        how = prompt_spec if batch == PROMPT else spec.model_copy(update={"batch_size": batch})
        exp = lab.measure(Candidate(plan=plan, agent=agent, note=note), how.model_copy(update={"seed": seed}),
                          prune=False, deadline=deadline)
        return exp.measurement.median_ms if exp.measurement is not None else None

    def prompt_share() -> float:
        """The prompt steps' share of a replay's time, from the base's steps as timed here: ~0.2 for
        chat's 8B on an H100 (0.069 prompt steps a decode step, each ~3x as long)."""
        decode, prompt = prev.get(setting.decode_spec.batch_size), prev.get(PROMPT)
        w = setting.prefill_steps_per_decode_step
        return w * prompt / (decode + w * prompt) if decode and prompt and w > 0 else 0.0

    def b_t_b(plan: Plan, key: int | str, note: str, base_note: str) -> tuple[float, float] | None:
        """``plan``'s step between two of the base's (the one before shared with the last reading
        at ``key``): its ms and the base's mean, or None when one of them could not be timed."""
        if prev.get(key) is None:
            prev[key] = step_ms(base, key, next(seeds), base_note)
        seed = next(seeds)
        before = prev[key]
        ms = step_ms(plan, key, seed, note)
        after = prev[key] = step_ms(base, key, seed, base_note)
        return None if before is None or ms is None or after is None else (ms, (before + after) / 2)

    def read(op: str, choice, plan: Plan) -> tuple[float, str]:
        """One B T B reading of ``plan`` at every trial batch and on the prompt step: its weighted
        whole-model ratio (inf when a step could not be timed) and the per-step ratios."""
        ratio, readings = 0.0, []
        for batch, weight in batches.items():
            got = b_t_b(plan, batch, f"op trial: {op}={choice.impl} b={batch}", "op trials: the base")
            if got is None:
                return float("inf"), ", ".join(readings) or "no reading"
            ms, base_ms = got
            r = cm.whole_model_ratio(base, spec.model_copy(update={"batch_size": batch}), base_ms, ms,
                                     per_layer=cm.full_model_factor(op) != 1.0) if cm else ms / base_ms
            readings.append(f"b={batch} x{r:.3f}")
            ratio += weight * r
            if batch == setting.decode_spec.batch_size:
                board.offer_plan(ms, plan, agent)
        if setting.prefill_steps_per_decode_step > 0:
            got = b_t_b(plan, PROMPT, f"op trial: {op}={choice.impl} prompt step", "op trials: the base's prompt step")
            if got is None:
                return float("inf"), ", ".join(readings + ["prompt step: no reading"])
            share, r = prompt_share(), got[0] / got[1]
            readings.append(f"prompt step x{r:.3f} at {share:.0%} of a replay")
            ratio = (1 - share) * ratio + share * r
        return ratio, ", ".join(readings)

    plans = {}
    for op, choice in decode_ops:
        kernel = board.kernels.get(f"{op}/{choice.impl}")
        plans[op] = base.with_ops(**{op: choice}).model_copy(
            update={"name": None, "kernels": [*base.kernels, *([kernel] if kernel else [])]})
    first: dict[str, tuple[float, str] | None] = {}  # None: not tried before the deadline
    for op, choice in decode_ops:
        try:
            first[op] = read(op, choice, plans[op])
        except BudgetExhausted:
            first[op] = None
    for op, choice in decode_ops:
        if first[op] is None:
            board.drop_op(op)
            board.note(f"op trial {op}: {choice.impl} {choice.params} not tried: the trials' share of the "
                       f"budget was spent; left at the base's choice")
            continue
        ratio, detail = first[op]
        if abs(ratio - 1.0) < OP_REREAD_BAND:  # a near-tie: the mean of two readings decides
            try:
                again, detail2 = read(op, choice, plans[op])
                ratio, detail = (ratio + again) / 2, f"{detail}; again {detail2}: the mean"
            except BudgetExhausted:
                detail = f"{detail}; not read again: the trials' share of the budget was spent"
        if ratio < 1.0:
            board.note(f"op trial {op}: {choice.impl} {choice.params} x{ratio:.3f} on the whole model's steps "
                       f"({detail}); kept")
        else:
            board.drop_op(op)
            why = f"x{ratio:.3f} on the whole model's steps ({detail})" if ratio != float("inf") \
                else f"its step could not be timed ({detail})"
            board.note(f"op trial {op}: {choice.impl} {choice.params} {why}; left at the base's choice")
