"""Scheduler knobs against a latency objective: the most tokens/s whose p90 ITL and TTFT stay in bounds.

Why a workload and not a step: max_num_seqs, the token budget, chunked and mixed prefill and overlap
scheduling only show in how a stream of requests is scheduled, so each setting replays the traffic shape's workload on the
fast tier. Settings are tried in a seeded random order (a resumed run retries the same ones) and
the grid is small, so no exhaustive sweep is needed to stay within budget.
"""

from __future__ import annotations

from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.types import Candidate, Measurement


def score(m: Measurement) -> float:
    """Tokens/s when reported, else the inverse of the request time."""
    return m.tokens_per_s if m.tokens_per_s else 1e3 / m.median_ms


class SchedulerTuner:
    name = "scheduler-tuner"

    def __init__(self, max_settings: int | None = None):
        self.max_settings = max_settings

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        rng = setting.rng(self.name)
        grid = setting.space.scheduler_grid(limit_seqs=max(setting.batch_dist, default=64))
        rng.shuffle(grid)
        base = setting.base.scheduler
        # The base, then the base with overlap scheduling flipped; the grid's settings then take
        # whichever of those two scored better (overlap is orthogonal to the other knobs).
        flipped = base.model_copy(update={"overlap": not base.overlap})
        grid = [base, flipped, *[g for g in grid if g.model_copy(update={"overlap": base.overlap}) != base]]
        spec = setting.workload_spec()
        best = None
        ok: list[tuple[float, object]] = []
        scores: dict[bool, float] = {}
        try:
            for i, knobs in enumerate(grid[: self.max_settings or len(grid)]):
                if i >= 2:
                    knobs = knobs.model_copy(update={"overlap": max(scores, key=scores.get, default=base.overlap)})
                plan = setting.base.model_copy(update={"scheduler": knobs, "name": None})
                exp = lab.measure(Candidate(plan=plan, agent=self.name, note=_label(knobs)), spec)
                m = exp.measurement
                if exp.verdict.status != "measured" or m is None:
                    continue
                if not setting.objective.satisfied(m):
                    board.note(f"scheduler {_label(knobs)}: outside latency bounds "
                               f"(itl p90 {m.itl_p90_ms}, ttft p90 {m.ttft_p90_ms})")
                    continue
                if i < 2:
                    scores[knobs.overlap] = score(m)
                ok.append((score(m), knobs))
                if best is None or score(m) > best[0]:
                    best = (score(m), knobs)
        except BudgetExhausted:
            pass
        if best is not None:
            ok.sort(key=lambda t: -t[0])
            # The runners-up go to the slow tier too: the fast tier's latency is not the deployment's.
            board.set(scheduler=best[1], scheduler_runners_up=[k for _, k in ok[1:3]])
            board.note(f"scheduler, best on the fast tier: {_label(best[1])} at {best[0]:.1f} tok/s there; "
                       f"it and {len(board.scheduler_runners_up)} runner(s)-up go to the slow tier, whose "
                       f"replay picks the winner (max_num_seqs searched from {min(setting.space.max_num_seqs)}: "
                       f"kept at twice the traffic's concurrency or more, where the grid reaches, as headroom for bursts)")


def _label(k) -> str:
    return (f"max_num_seqs={k.max_num_seqs} max_batched_tokens={k.max_num_batched_tokens} "
            f"chunked={k.chunked_prefill} mixed={k.mixed_prefill} overlap={k.overlap}")
