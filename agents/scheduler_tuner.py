"""Scheduler knobs against a latency objective: the most tokens/s whose p90 ITL and TTFT stay in bounds.

Why a workload and not a step: max_num_seqs, the token budget, chunked and mixed prefill, overlap
scheduling and speculative decoding only show in how a stream of requests is scheduled, so each
setting replays the traffic shape's workload on the fast tier. Settings are tried in a seeded random
order (a resumed run retries the same ones) and the grid is small, so no exhaustive sweep is needed
to stay within budget.
"""

from __future__ import annotations

from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.types import Candidate, Measurement


def score(m: Measurement) -> float:
    """Tokens/s when reported, else the inverse of the request time."""
    return m.tokens_per_s if m.tokens_per_s else 1e3 / m.median_ms


# Speculative decoding (scheduler.speculative_tokens) is tried only where the base's own replay says
# an n-gram drafter would accept enough (its extra.speculation): below this many tokens a verify step
# the drafted rows cost about what they give back. Session 41: the 8B's random weights read 1.000.
SPECULATIVE_TOKENS = 4
MIN_TOKENS_PER_STEP = 1.1


class SchedulerTuner:
    name = "scheduler-tuner"

    def __init__(self, max_settings: int | None = None):
        self.max_settings = max_settings

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        rng = setting.rng(self.name)
        grid = setting.space.scheduler_grid(limit_seqs=max(setting.batch_dist, default=64))
        rng.shuffle(grid)
        base = setting.base.scheduler
        # Probes first: the base, the base with overlap scheduling flipped and, when the base's replay
        # promises it, the base speculating. The grid's settings then take whichever probe scored best
        # (those knobs are orthogonal to the others).
        flipped = base.model_copy(update={"overlap": not base.overlap, "speculative_tokens": 0})
        probes = [base, flipped]
        grid = [*probes, *[g for g in grid if g.model_copy(update=dict(_orthogonal(base))) != base]]
        grid = grid[: self.max_settings or len(grid)]
        spec = setting.workload_spec()
        best = None
        ok: list[tuple[float, object]] = []
        scores: dict[tuple, float] = {}
        try:
            i = 0
            while i < len(grid):
                knobs, probe = grid[i], i < len(probes)
                i += 1
                if not probe:  # the best probe's orthogonal knobs
                    knobs = knobs.model_copy(update=dict(max(scores, key=scores.get, default=_orthogonal(base))))
                plan = setting.base.model_copy(update={"scheduler": knobs, "name": None})
                exp = lab.measure(Candidate(plan=plan, agent=self.name, note=_label(knobs)), spec)
                m = exp.measurement
                if exp.verdict.status != "measured" or m is None:
                    continue
                if i == 1 and not base.speculative_tokens:
                    speculating = self._speculative_probe(base, m, board)
                    if speculating is not None:
                        probes.append(speculating)
                        grid.insert(len(probes) - 1, speculating)
                        del grid[self.max_settings or len(grid):]
                if not setting.objective.satisfied(m):
                    board.note(f"scheduler {_label(knobs)}: outside latency bounds "
                               f"(itl p90 {m.itl_p90_ms}, ttft p90 {m.ttft_p90_ms})")
                    continue
                if probe:
                    scores[_orthogonal(knobs)] = score(m)
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

    @staticmethod
    def _speculative_probe(base, m: Measurement, board: Board):
        """The base speculating, when its replay's drafter figures promise a gain; else None (noted)."""
        per_step = (m.speculation or {}).get("tokens_per_step")
        if per_step is None:
            return None
        if per_step < MIN_TOKENS_PER_STEP:
            board.note(f"speculative decoding not tried: an n-gram drafter would emit {per_step:.3f} tokens a "
                       f"verify step on the base's replay (needs {MIN_TOKENS_PER_STEP})")
            return None
        return base.model_copy(update={"overlap": False, "speculative_tokens": SPECULATIVE_TOKENS})


def _orthogonal(k) -> tuple:
    """The knobs the probes settle for every grid setting, as ``(name, value)`` pairs."""
    return (("overlap", k.overlap), ("speculative_tokens", k.speculative_tokens))


def _label(k) -> str:
    return (f"max_num_seqs={k.max_num_seqs} max_batched_tokens={k.max_num_batched_tokens} "
            f"chunked={k.chunked_prefill} mixed={k.mixed_prefill} overlap={k.overlap}"
            + (f" speculative={k.speculative_tokens}" if k.speculative_tokens else ""))
