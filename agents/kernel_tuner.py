"""Per-op kernel parameter tuning, per shape bucket.

Why per bucket: the best tile size for a GEMV at batch 1 is not the best at batch 64. The tuner
times every declared configuration of each tunable op (the registry declares few, so this stays
small; ``max_configs`` caps it) at each representative decode batch size, keeping the rest of the
plan fixed, and picks the configuration with the lowest traffic-weighted time. The op's own time
comes from the engine's per-op timings when it reports them, else the whole step's.
"""

from __future__ import annotations

import math

from anneal.engine.plan import OpChoice
from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.types import Candidate


class KernelTuner:
    name = "kernel-tuner"

    def __init__(self, max_configs: int = 12):
        self.max_configs = max_configs

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        rng = setting.rng(self.name)
        ops = setting.space.tunable_ops()
        rng.shuffle(ops)
        for op in ops:
            try:
                self.tune_op(op, lab, setting, board, rng)
            except BudgetExhausted:
                return

    def tune_op(self, op: str, lab: Lab, setting: SearchSetting, board: Board, rng) -> None:
        space = setting.space.ops[op]
        choices = [OpChoice(impl=i, params=p) for i in sorted(space.impls) for p in space.configs(i)]
        current = setting.base.choice(op)
        rest = [c for c in choices if c != current]
        rng.shuffle(rest)
        choices = [current, *rest][: self.max_configs]
        buckets = [1] if op == "attention_prefill" else setting.buckets
        weights = _bucket_weights(buckets, setting.batch_dist)
        scores: dict[int, float] = {}
        for idx, choice in enumerate(choices):
            total, complete = 0.0, True
            for b in buckets:
                spec = setting.spec_for(op, b)
                plan = setting.base.with_ops(**{op: choice})
                exp = lab.measure(Candidate(plan=plan, agent=self.name,
                                            note=f"{op}={choice.impl}{choice.params} b={b}"), spec)
                if exp.verdict.status != "measured" or exp.measurement is None:
                    complete = False
                    break
                m = exp.measurement
                ms = (m.per_op_ms or {}).get(op, m.median_ms)
                total += weights[b] * ms
                if spec == setting.decode_spec:
                    board.offer_plan(m.median_ms, plan, self.name)
            if complete:
                scores[idx] = total
        if scores:
            best = min(scores, key=scores.get)
            if choices[best] != current or op not in board.best_ops:
                board.offer_op(op, choices[best], scores[best])
            board.note(f"{op}: best {choices[best].impl} {choices[best].params} "
                       f"({scores[best]:.3f} ms weighted) of {len(scores)} configs")


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
