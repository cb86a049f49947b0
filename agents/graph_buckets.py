"""CUDA-graph batch sizes fitted to the traffic's batch-size distribution, and token graphs for its
prompt steps when its replay runs faster with them.

Why: a decode step at batch ``b`` replays the smallest captured graph ``>= b`` (padding the rest)
or runs eagerly when ``b`` exceeds them all; each captured graph costs capture time and memory.
The fit picks at most ``max_graphs`` sizes minimising the expected step time over the batch sizes
a replay of the traffic actually ran (drain included), by dynamic programming.
"""

from __future__ import annotations

import math

from anneal.agents.board import Board, SearchSetting
from anneal.agents.lab import BudgetExhausted, Lab
from anneal.agents.space import normalized
from anneal.agents.types import Candidate, Measurement

TOKEN_TRIAL_SEEDS = (7001, 7002)  # request samples of the token-graph trial, none a search's own


def prompt_step_ratio(base: Measurement, plan: Measurement) -> float:
    """``plan``'s replay time over ``base``'s, of two replays of the same requests that differ only in
    their prompt (prefill and mixed) steps: the base's replay with its prompt steps at the plan's
    time per prompt token. The rest of two replays (decode steps, the drain, the time between
    steps) moves by several percent from one replay to the next on a shared host; counting it would
    bury a prompt-step gain in that noise. Without a time split (an engine that reports none), the
    whole replays' ratio."""
    b, p = base.time_split or {}, plan.time_split or {}
    if not (b.get("tokens_in_prefill_steps") and p.get("tokens_in_prefill_steps") and b.get("total_ms")
            and b.get("prefill_ms")):
        return plan.median_ms / base.median_ms
    per_token = (p["prefill_ms"] / p["tokens_in_prefill_steps"]) / (b["prefill_ms"] / b["tokens_in_prefill_steps"])
    share = b["prefill_ms"] / b["total_ms"]
    return 1 - share * (1 - per_token)


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


def graph_sizes_to_price(max_batch: int) -> list[int]:
    """Sizes a fit may capture: 1, 2, 4, then multiples of 8 up to the first covering ``max_batch``.

    Why not every size: a GEMM's time steps with its row tiles (16 rows or more in cuBLAS and in
    the Triton GEMVs), so odd sizes save padded rows but hardly any time; vLLM and SGLang capture
    the same kind of set. The fit then prices these few by measured step time.
    """
    top = max(1, max_batch)
    small = [g for g in (1, 2, 4) if g < top]
    if top <= 4:
        return small + [next(g for g in (1, 2, 4) if g >= top)]
    return small + list(range(8, -(-top // 8) * 8 + 1, 8))


def fit_graph_buckets(dist: dict[int, float], max_graphs: int = 6, *, sizes: list[int] | None = None,
                      step_ms: dict[int, float] | None = None) -> list[int]:
    """At most ``max_graphs`` of ``sizes`` minimising the expected step cost over ``dist``.

    A batch ``b`` replays the smallest chosen size ``>= b``; its cost is ``step_ms[size]`` when
    given (measured step times), else the size itself (padded rows). ``sizes`` defaults to the
    batch sizes the distribution holds; the largest size needed to cover the distribution is
    always chosen, so eager steps only happen above it.
    """
    batches = sorted(b for b, p in dist.items() if p > 0)
    if not batches:
        return [1]
    top = batches[-1]
    sizes = sorted(set(sizes or batches))
    cover = next((i for i, g in enumerate(sizes) if g >= top), None)
    if cover is None:
        raise ValueError(f"no size in {sizes} covers batch {top}")
    sizes = sizes[:cover + 1]
    price = (lambda g: step_ms[g]) if step_ms is not None else (lambda g: float(g))
    n, k_max = len(sizes), max(1, min(max_graphs, len(sizes)))

    def cost(lo: int, j: int) -> float:  # batches in (lo, sizes[j]] padded up to sizes[j]
        mass = sum(p for b, p in dist.items() if lo < b <= sizes[j])
        return mass * price(sizes[j]) if mass else 0.0

    INF = math.inf
    # best[k][j]: k graphs cover every batch <= sizes[j], the top graph at sizes[j]
    best = [[INF] * n for _ in range(k_max + 1)]
    back = [[-1] * n for _ in range(k_max + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for k in range(2, k_max + 1):
        for j in range(n):
            for i in range(j):
                c = best[k - 1][i] + cost(sizes[i], j)
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    # fewest graphs among the cheapest (an unused size adds capture time, nothing else)
    k = min(range(1, k_max + 1), key=lambda kk: (round(best[kk][n - 1], 12), kk))
    out, j = [], n - 1
    while k >= 1 and j >= 0:
        out.append(sizes[j])
        j = back[k][j]
        k -= 1
    return sorted(out)


def graph_for(batch: int, buckets: list[int]) -> int | None:
    """The captured size a decode step of ``batch`` rows replays (the smallest ``>= batch``); None
    when it exceeds them all and runs eagerly."""
    return min((g for g in buckets if g >= batch), default=None)


def expected_step_ms(dist: dict[int, float], buckets: list[int], step_ms: dict[int, float]) -> float:
    """E[step ms] when each batch replays its graph; inf when a batch has no graph to replay."""
    total = 0.0
    for b, p in dist.items():
        top = graph_for(b, buckets)
        if top is None or top not in step_ms:
            return math.inf
        total += p * step_ms[top]
    return total


def expected_padding(dist: dict[int, float], buckets: list[int]) -> float:
    """E[padded batch] / E[batch]: 1.0 means no wasted rows."""
    mean = sum(b * p for b, p in dist.items())
    if not buckets or not mean:
        return math.inf
    padded = 0.0
    for b, p in dist.items():
        top = graph_for(b, buckets)
        padded += p * (top if top is not None else b)
    return padded / mean


def replayed_distribution(decode_batches: dict[int, int] | None) -> dict[int, float] | None:
    """Decode-step batch sizes a workload replay ran, as probabilities (None when not reported)."""
    steps = {int(b): n for b, n in (decode_batches or {}).items() if n > 0 and int(b) > 0}
    total = sum(steps.values())
    return {b: n / total for b, n in sorted(steps.items())} if total else None


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
    """Fits the graph sizes to the batches the baseline's replay ran, priced by measured step time.

    Session 10 on the H200: the old fit (Poisson batches, padded rows) chose [12, 15, 17, 20, 23,
    29] for chat, whose replay spends a third of its time draining from 16 rows to 1 (every drain
    step below 12 rows replayed the 12-row graph): 7% of the replay lost against [1, 4, 16, 64].
    """

    name = "graph-buckets"

    min_gain = 0.01  # a fit this close to the base is within the fast tier's noise: keep the base

    def __init__(self, max_graphs: int = 8):
        self.max_graphs = max_graphs

    def run(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        base = setting.base
        try:
            replay = lab.measure(Candidate(plan=base, agent=self.name, note="baseline replay: its batch sizes"),
                                 setting.workload_spec(), prune=False)
        except BudgetExhausted:
            return
        dist = replayed_distribution(replay.measurement.decode_batches if replay.measurement else None)
        source = "the baseline's replay"
        if dist is None:
            dist, source = setting.batch_dist, "Poisson(concurrency)"
        if not setting.space.uses_graphs:  # no CUDA graphs on this device: the fit is reported only
            fitted = fit_graph_buckets(dist, self.max_graphs)
            board.note(f"graph buckets {fitted} for batches from {source}: expected padding "
                       f"x{expected_padding(dist, fitted):.3f} (base {base.cuda_graph_batch_sizes}: "
                       f"x{expected_padding(dist, base.cuda_graph_batch_sizes):.3f}); no CUDA graphs here")
            return
        top = max(dist)
        candidates = graph_sizes_to_price(top)
        base_targets = {graph_for(b, base.cuda_graph_batch_sizes) for b in dist} - {None}
        sizes = sorted(set(candidates) | base_targets)
        # One plan holding every size: each size's step is timed replaying its own graph.
        pricing = base.model_copy(update={"cuda_graph_batch_sizes": sizes, "name": None})
        step_ms: dict[int, float] = {}
        try:
            for g in sizes:
                exp = lab.measure(Candidate(plan=pricing, agent=self.name, note=f"graph b={g}"),
                                  setting.spec_for("graphs", g).model_copy(update={"per_op": False}), prune=False)
                if exp.measurement is None:
                    board.note(f"graph buckets: no step time at batch {g} ({exp.verdict.reason}); kept the base")
                    return
                step_ms[g] = exp.measurement.median_ms
        except BudgetExhausted:
            return
        fitted = fit_graph_buckets(dist, self.max_graphs, sizes=candidates, step_ms=step_ms)
        fit_ms = expected_step_ms(dist, fitted, step_ms)
        base_ms = expected_step_ms(dist, base.cuda_graph_batch_sizes, step_ms)
        keep = fit_ms < base_ms * (1 - self.min_gain)
        board.note(f"graph buckets {fitted} for batches 1-{top} from {source}: expected step "
                   f"{fit_ms:.3f} ms against {base_ms:.3f} ms for the base {base.cuda_graph_batch_sizes}"
                   + ("" if keep else f"; kept the base (less than {self.min_gain:.0%} apart)"))
        board.set(graph_batch_sizes=fitted if keep else None)
        self._token_graphs(lab, setting, board)

    def _token_graphs(self, lab: Lab, setting: SearchSetting, board: Board) -> None:
        """Token graphs for the prompt and mixed steps, kept when the traffic's replay runs faster
        with them. What they save (the host's launches in small steps) and cost (padded rows, a
        capture per bucket) depends on the step sizes the traffic brings, so replays of the same
        requests decide. Session 15 on the H200: chat's prompt steps 7-32% faster, tokens/s
        x1.01-1.05 on a compiled plan.

        Paired, ABBA on two fresh request samples (base, token, then token, base), the median of
        the two ratios: the fast tier's host is shared with compile-ahead's kernel builds, so its
        replays drift over a search. Session 16 compared the token plan mid-search with the base's
        replay from the search's start: every decode step read 21% slower in the token plan, though
        token graphs change no decode step, and the trial kept none.

        Each pair is judged by its prompt steps (``prompt_step_ratio``), the only steps token graphs
        change: session 22's pair of whole replays read x0.937 and x1.056 on chat (the drain and the
        decode steps' host time moving between two replays of the same requests) and kept none."""
        base = setting.base
        if base.cuda_graph_token_sizes:
            return
        sizes = next((list(s) for s in setting.space.token_graph_sets if s), [])  # the finest: every 64 to 512
        plan = normalized(base.model_copy(update={"cuda_graph_token_sizes": sizes, "name": None}))
        if not plan.cuda_graph_token_sizes:  # its attention_prefill cannot be captured
            return
        ratios, whole = [], []
        for seed, order in zip(TOKEN_TRIAL_SEEDS, ((base, plan), (plan, base))):
            spec = setting.workload_spec().model_copy(update={"seed": seed})
            ms = {}
            for p in order:
                note = "token graphs" if p is plan else "token graphs: the base beside them"
                try:
                    exp = lab.measure(Candidate(plan=p, agent=self.name, note=note), spec, prune=False)
                except BudgetExhausted:
                    return
                if exp.measurement is None:
                    board.note(f"token graphs: no replay ({exp.verdict.reason}); none")
                    return
                ms[p is plan] = exp.measurement
            ratios.append(prompt_step_ratio(ms[False], ms[True]))
            whole.append(ms[True].median_ms / ms[False].median_ms)
        ratio = sum(ratios) / len(ratios)  # the median of two
        keep = ratio < 1 - self.min_gain
        board.note(f"token graphs {plan.cuda_graph_token_sizes[0]}-{plan.cuda_graph_token_sizes[-1]}: replay "
                   f"x{ratio:.3f} the base's by its prompt steps ({', '.join(f'{r:.3f}' for r in ratios)}, paired; "
                   f"whole replays {', '.join(f'x{r:.3f}' for r in whole)})"
                   + ("" if keep else "; none"))
        board.set(token_graph_sizes=plan.cuda_graph_token_sizes if keep else None)
