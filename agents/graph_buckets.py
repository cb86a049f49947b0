"""CUDA-graph batch sizes fitted to the traffic's batch-size distribution.

Why: a decode step at batch ``b`` replays the smallest captured graph ``>= b`` (padding the rest)
or runs eagerly when ``b`` exceeds them all; each captured graph costs capture time and memory.
The fit picks at most ``max_graphs`` sizes minimising the expected padded work plus the eager
penalty, by dynamic programming over the distinct batch sizes the traffic produces.
"""

from __future__ import annotations

import math

from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.types import Candidate


def batch_size_distribution(concurrency: float, max_num_seqs: int, tail: float = 1e-3) -> dict[int, float]:
    """Decode batch sizes under ``concurrency`` requests in flight: Poisson(concurrency), 1..max."""
    lam = max(concurrency, 1e-6)
    hi = max(1, min(max_num_seqs, int(lam + 6 * math.sqrt(lam) + 4)))
    logp = [k * math.log(lam) - lam - math.lgamma(k + 1) for k in range(1, hi + 1)]
    m = max(logp)
    probs = [math.exp(x - m) for x in logp]
    total = sum(probs)
    dist = {k + 1: p / total for k, p in enumerate(probs) if p / total >= tail}
    s = sum(dist.values())
    return {k: v / s for k, v in dist.items()}


def fit_graph_buckets(dist: dict[int, float], max_graphs: int = 6) -> list[int]:
    """At most ``max_graphs`` sizes minimising the expected padded batch.

    Every chosen size is a batch size the traffic produces; the largest observed one is always
    covered, so eager steps only happen above the distribution.
    """
    sizes = sorted(b for b, p in dist.items() if p > 0)
    if not sizes:
        return [1]
    n, k_max = len(sizes), max(1, min(max_graphs, len(sizes)))
    # cost(i, j): sizes[i..j] all padded up to sizes[j]
    prefix_p = [0.0]
    for b in sizes:
        prefix_p.append(prefix_p[-1] + dist[b])

    def cost(i: int, j: int) -> float:
        return sizes[j] * (prefix_p[j + 1] - prefix_p[i])

    INF = math.inf
    # best[k][j]: k graphs cover sizes[0..j] with the top graph at sizes[j]
    best = [[INF] * n for _ in range(k_max + 1)]
    back = [[-1] * n for _ in range(k_max + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for k in range(2, k_max + 1):
        for j in range(n):
            for i in range(j):
                c = best[k - 1][i] + cost(i + 1, j)
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, k_max + 1), key=lambda kk: best[kk][n - 1])
    out, j = [], n - 1
    while k >= 1 and j >= 0:
        out.append(sizes[j])
        j = back[k][j]
        k -= 1
    return sorted(out)


def expected_padding(dist: dict[int, float], buckets: list[int]) -> float:
    """E[padded batch] / E[batch]: 1.0 means no wasted rows."""
    buckets = sorted(buckets)
    mean = sum(b * p for b, p in dist.items())
    if not buckets or not mean:
        return math.inf
    padded = 0.0
    for b, p in dist.items():
        top = next((g for g in buckets if g >= b), None)
        padded += p * (top if top is not None else b)
    return padded / mean


def quantile_sizes(dist: dict[int, float], qs: tuple[float, ...] = (0.25, 0.5, 0.9)) -> list[int]:
    """Batch sizes at the given quantiles of the distribution (distinct, ascending)."""
    out, acc = [], 0.0
    items = sorted(dist.items())
    for q in qs:
        acc = 0.0
        for b, p in items:
            acc += p
            if acc >= q:
                out.append(b)
                break
        else:
            out.append(items[-1][0])
    return sorted(set(out))


class GraphBucketAgent:
    """Fits the graph sizes; on a GPU engine it also times the fitted set against the base set."""

    name = "graph-buckets"

    def __init__(self, max_graphs: int = 6):
        self.max_graphs = max_graphs

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        fitted = fit_graph_buckets(setting.batch_dist, self.max_graphs)
        before = expected_padding(setting.batch_dist, setting.base.cuda_graph_batch_sizes)
        after = expected_padding(setting.batch_dist, fitted)
        board.note(f"graph buckets {fitted}: expected padding x{after:.3f} "
                   f"(base {setting.base.cuda_graph_batch_sizes}: x{before:.3f})")
        if not setting.space.uses_graphs:
            return  # no CUDA graphs on this device: the fit is reported, the plan keeps its sizes
        plan = setting.base.model_copy(update={"cuda_graph_batch_sizes": fitted, "name": None})
        try:
            totals = {}
            for label, p in (("base", setting.base), ("fitted", plan)):
                total = 0.0
                for b in quantile_sizes(setting.batch_dist):
                    exp = lab.measure(Candidate(plan=p, agent=self.name, note=f"{label} graphs b={b}"),
                                      setting.spec_for("graphs", b), prune=False)
                    if exp.measurement is None:
                        total = math.inf
                        break
                    total += setting.batch_dist.get(b, 0.0) * exp.measurement.median_ms + 1e-9
                totals[label] = total
        except BudgetExhausted:
            board.set(graph_batch_sizes=fitted)
            return
        board.set(graph_batch_sizes=fitted if totals["fitted"] <= totals["base"] * 1.02 else None)
