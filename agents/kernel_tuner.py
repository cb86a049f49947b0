"""Per-op kernel parameter tuning, per shape bucket, by coordinate descent over the declared params.

Why per bucket: the best tile size for a GEMV at batch 1 is not the best at batch 64. Why
coordinate descent: a GEMV variant declares ~40k combinations, but its parameters are mostly
separable — walking one parameter at a time from the defaults (then a second pass from the best)
finds a near-best config in ~30 timings instead of 40k. Each config is timed at every
representative decode batch size with the rest of the plan fixed; the score is the traffic-weighted
time of the op itself (the engine times each op in a few eager steps when asked: on the H200 a
whole 2-layer step of 0.58 ms moved ~1% run to run, more than most single-op changes).

Why turns: the ops' descents take turns, one configuration each. Descending one op to the end
before the next spent a whole 200 s H200 budget on gate_up (39 timings, none better than the base)
and never timed qkv, o or down. When the budget runs out, every op offers the best it has found.
Within an op, each implementation is timed at its defaults first and the descents start from the
most promising one.

Why turns by the gap to the roofline: once every op has timed its base configuration, each takes
turns in proportion to how far its time is above what its bytes and FLOPs allow. On the H200 (8B,
batch 12) gate_up ran at 96% of its bytes' time and o at 61%: turns in proportion to the ops' share
of the step gave gate_up the most, though it had the least to win.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from anneal.engine.plan import OpChoice
from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.types import Candidate


class KernelTuner:
    name = "kernel-tuner"

    def __init__(self, passes: int = 2, major_share: float = 0.05):
        self.passes = passes
        self.major_share = major_share  # ops predicted below this share of their step go last
        self.gaps: dict[str, float] = {}  # op -> weighted ms of its base above its roofline
        # (op, (batch, context)) -> the best config at that shape alone
        self.bucket_best: dict[tuple[str, tuple[int, int | None]], tuple[float, OpChoice]] = {}

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        rng = setting.rng(self.name)
        ops = setting.space.tunable_ops()
        rng.shuffle(ops)
        major, minor = self.phases(ops, lab, setting)
        self.gaps = {}
        descents = {op: _Descent(op, self, lab, setting, board) for op in ops}
        unfinished = set(ops)
        try:
            for phase in (major, minor):
                self._take_turns(phase, descents, unfinished, lab, setting)
        except BudgetExhausted:
            pass
        for op in ops:
            descents[op].finish(interrupted=op in unfinished)
        gaps = {op: g for op, g in self.gaps.items() if math.isfinite(g)}
        if gaps:
            board.note("kernel turns by the gap to the roofline (weighted ms above it): "
                       + ", ".join(f"{op} {g:.4f} ({descents[op].tried} configs)"
                                   for op, g in sorted(gaps.items(), key=lambda t: -t[1])))

    def _take_turns(self, phase: list[str], descents: dict[str, "_Descent"], unfinished: set[str],
                    lab: Lab, setting: SearchSetting) -> None:
        """Every op of ``phase`` times its base and each other implementation at its defaults first
        (its opening, in ``phase`` order); then the op with the fewest turns per ms of gap to its
        roofline goes next (stride scheduling: each op's turns grow in proportion to its gap, and
        none starves). Why the openings first: session 46's 180-s chat compile gave lm_head one
        turn (its gap the smallest), so its bf12 copy, a quarter of its bytes, was never timed."""
        turns = {op: descents[op].steps() for op in phase}
        taken = dict.fromkeys(phase, 0)
        opening = {op: len(descents[op].openings()) for op in phase}
        while turns:
            fresh = [op for op in phase if op in turns and taken[op] < opening[op]]
            op = fresh[0] if fresh else min(turns, key=lambda o: (taken[o] / self.gaps[o], phase.index(o)))
            try:
                next(turns[op])
            except StopIteration:
                del turns[op]
                unfinished.discard(op)
                continue
            taken[op] += 1
            if taken[op] == 1:
                self.gaps[op] = self.gap(op, descents[op].best, lab, setting)

    def gap(self, op: str, measured_ms: float, lab: Lab, setting: SearchSetting) -> float:
        """Weighted ms of ``op`` above its roofline (at least 2% of its time, so an op at the roofline
        still gets some turns), as the whole model would run it, per decode step of a replay (prefill
        attention's steps come round far less often: in chat's s12 compile its 1.34 ms gap per prompt
        step took 10 turns to decode attention's 4); its time itself without a cost model."""
        if not math.isfinite(measured_ms):
            return 1e-9  # its base does not run: the other configs get the fewest turns
        if lab.cost_model is None:
            return max(measured_ms, 1e-9)
        floor = self.floor_ms(op, lab, setting)
        return (max(measured_ms - floor, 0.02 * measured_ms, 1e-9) * lab.cost_model.full_model_factor(op)
                * setting.steps_weight(op))

    def floor_ms(self, op: str, lab: Lab, setting: SearchSetting) -> float:
        """``op``'s roofline (bytes at copy bandwidth or FLOPs at the matmul rate, one launch) under
        the implementation of its space that reads the fewest bytes, weighted over the shape buckets
        as ``score`` weighs its timings. Why the fewest: a projection whose space holds a bf12 copy
        can drop a quarter of its bytes, however close to its bf16 roofline cuBLAS runs it (lm_head
        on the 8B: 0.37 ms at ~95% of it, one turn in session 45's chat compile, its bf12 copy never
        timed)."""
        space = setting.space.ops.get(op)
        plans = [setting.base] + ([setting.base.with_ops(**{op: OpChoice(impl=impl, params=space.default(impl))})
                                   for impl in sorted(space.impls)] if space is not None else [])
        total = 0.0
        for (b, ctx), w in _shape_weights(op, setting).items():
            spec = setting.spec_for(op, b, ctx)
            total += w * min((lab.cost_model.predict(plan, spec, calibrated=False, step_factor=False).per_op_ms
                              or {}).get(op, 0.0) for plan in plans)
        return total

    def phases(self, ops: list[str], lab: Lab, setting: SearchSetting) -> tuple[list[str], list[str]]:
        """(major, minor): the ops the cost model puts at ``major_share`` or more of the whole
        model's step (projections, attention), largest first, take turns before the rest. Why: a
        compile's budget buys each configuration a timing at every bucket, and on the H200 a 290 s
        budget reached only 2-3 configurations per op when the norms and argmax took equal turns
        with the projections."""
        if lab.cost_model is None:
            return ops, []
        share = self.shares(ops, lab, setting)
        ranked = sorted(ops, key=lambda o: -share[o])
        major = [o for o in ranked if share[o] >= self.major_share]
        return major, [o for o in ranked if o not in major]

    @staticmethod
    def shares(ops: list[str], lab: Lab, setting: SearchSetting) -> dict[str, float]:
        """Each op's predicted share of the whole model's step, at the traffic's typical batch (at
        batch 1 decode attention looked negligible; at the chat replay's 12 it is 12% of the step).
        The whole model's, not the fast tier's: on 2 of the 8B's 32 layers lm_head was 60% of the
        step, and o_proj and decode attention fell under ``major_share`` and never got a turn."""
        cm = lab.cost_model
        share: dict[str, float] = {}
        for op in ops:
            spec = setting.spec_for(op, setting.decode_spec.batch_size)
            predicted = cm.predict(setting.base, spec).per_op_ms or {}
            per_op = {o: ms * cm.full_model_factor(o) for o, ms in predicted.items()}
            total = sum(per_op.values())
            share[op] = per_op.get(op, 0.0) / total if total > 0 else 0.0
        return share

    def score(self, op: str, choice: OpChoice, lab: Lab, setting: SearchSetting, board: Board) -> float:
        """Traffic-weighted ms of ``op`` with ``choice``; inf when any bucket fails."""
        total = 0.0
        per_bucket: dict[tuple[int, int | None], float] = {}
        # The op's own time (the setting's specs ask the engine to time ops one by one), unless the
        # base fuses ops: then an op may run alone in one config and inside a fused kernel in
        # another, and only the step compares them.
        own_time = not setting.base.fusions
        for (b, ctx), w in _shape_weights(op, setting).items():
            spec = setting.spec_for(op, b, ctx)
            plan = setting.base.with_ops(**{op: choice})
            where = f"b={b}" + (f" ctx={ctx}" if ctx else "")
            exp = lab.measure(Candidate(plan=plan, agent=self.name,
                                        note=f"{op}={choice.impl}{choice.params} {where}"), spec)
            if exp.verdict.status != "measured" or exp.measurement is None:
                return math.inf
            m = exp.measurement
            per_bucket[(b, ctx)] = (m.per_op_ms or {}).get(op, m.median_ms) if own_time else m.median_ms
            total += w * per_bucket[(b, ctx)]
            if spec == setting.decode_spec:
                board.offer_plan(m.median_ms, plan, self.name)
        for b, ms in per_bucket.items():
            if ms < self.bucket_best.get((op, b), (math.inf, None))[0]:
                self.bucket_best[(op, b)] = (ms, choice)
        return total


class _Descent:
    """One op's coordinate descent, a configuration per turn (``steps`` yields after each timing)."""

    def __init__(self, op: str, tuner: KernelTuner, lab: Lab, setting: SearchSetting, board: Board):
        self.op, self.tuner, self.lab, self.setting, self.board = op, tuner, lab, setting, board
        self.best, self.best_choice = math.inf, setting.base.choice(op)
        self.tried = 0

    def _score(self, choice: OpChoice) -> float:
        self.tried += 1
        ms = self.tuner.score(self.op, choice, self.lab, self.setting, self.board)
        if ms < self.best:
            self.best, self.best_choice = ms, choice
        return ms

    def openings(self) -> list[OpChoice]:
        """The base's choice, then each implementation of the space at its defaults (the base's own
        at its params) that differs from it: what the descent times before it walks any param."""
        space = self.setting.space.ops[self.op]
        current = self.setting.base.choice(self.op)
        out = [current]
        for impl in sorted(space.impls):
            params = space.default(impl) if impl != current.impl else {**space.default(impl), **current.params}
            if OpChoice(impl=impl, params=params) != current:
                out.append(OpChoice(impl=impl, params=params))
        return out

    def steps(self) -> Iterator[None]:
        space = self.setting.space.ops[self.op]
        current, *others = self.openings()
        current_ms = self._score(current)
        yield
        # the descents' starting points; an impl that does not build or run at its defaults has none
        starts: list[tuple[float, str, dict[str, Any]]] = []
        if current.impl in space.impls and all(c.impl != current.impl for c in others) and math.isfinite(current_ms):
            starts.append((current_ms, current.impl, dict(current.params)))  # at its defaults already
        for choice in others:
            ms = self._score(choice)
            yield
            if math.isfinite(ms):
                starts.append((ms, choice.impl, dict(choice.params)))
        for ms, impl, params in sorted(starts, key=lambda t: t[0]):
            names = sorted(n for n, ch in space.impls[impl].items() if len(ch) > 1)
            for _ in range(self.tuner.passes):
                improved = False
                for name in names:
                    for value in space.impls[impl][name]:
                        if value == params.get(name):
                            continue
                        s = self._score(OpChoice(impl=impl, params={**params, name: value}))
                        yield
                        if s < ms:
                            ms, params, improved = s, {**params, name: value}, True
                if not improved:
                    break

    def finish(self, interrupted: bool) -> None:
        """Offer the best configuration found (all of it, or what the budget allowed)."""
        if not math.isfinite(self.best):
            return
        op, board = self.op, self.board
        board.offer_op(op, self.best_choice, self.best)
        size = self.setting.space.ops[op].size
        board.note(f"{op}: best {self.best_choice.impl} {self.best_choice.params} ({self.best:.4f} ms weighted) "
                   f"after {self.tried} configs of {size}" + (" (budget spent)" if interrupted else ""))
        own = {b: ch for (o, b), (_, ch) in self.tuner.bucket_best.items() if o == op and ch != self.best_choice}
        if own:  # a plan holds one config per op: say what each shape would have preferred
            board.note(f"{op}: per-bucket optima differ from the weighted choice: "
                       + "; ".join(f"batch {b}{f' ctx {c}' if c else ''}: {ch.impl} {ch.params}"
                                   for (b, c), ch in sorted(own.items(), key=lambda t: (t[0][0], t[0][1] or 0))))


def _shape_weights(op: str, setting: SearchSetting) -> dict[tuple[int, int | None], float]:
    """Each (batch, context) shape ``op`` is tuned at, with its share of the traffic (contexts
    weigh alike)."""
    shapes = setting.shape_buckets(op)
    weights = _bucket_weights(sorted({b for b, _ in shapes}), setting.batch_dist)
    n_ctx = len({c for _, c in shapes})
    return {(b, ctx): weights[b] / n_ctx for b, ctx in shapes}


def _bucket_weights(buckets: list[int], dist: dict[int, float]) -> dict[int, float]:
    """Each bucket's share of the traffic: batch sizes go to the nearest bucket at or above."""
    w = {b: 0.0 for b in buckets}
    for bs, p in dist.items():
        b = next((b for b in sorted(buckets) if b >= bs), max(buckets))
        w[b] += p
    total = sum(w.values())
    if total <= 0 or not math.isfinite(total):
        return {b: 1.0 / len(buckets) for b in buckets}
    return {b: v / total for b, v in w.items()}
