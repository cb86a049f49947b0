"""The search setting of one compile: what to time and how, from the engine and the traffic shape.

Why here and not in the agents: every agent must measure against the same objective — the decode
step at the traffic's typical batch and context, the traffic's batch-size distribution for
weighting shape buckets, the workload replay sized to the device — so it is decided once.
"""

from __future__ import annotations

from typing import Any

from anneal.agents.board import SearchSetting
from anneal.agents.graph_buckets import batch_size_distribution, quantile_sizes
from anneal.agents.space import CandidateSpace
from anneal.agents.types import BenchSpec, EngineState

SEQS_HEADROOM = 2.0  # candidates' max_num_seqs >= this x the traffic's concurrency
CPU_MAX_LEN = 128  # CPU engines: traffic lengths scaled to fit (a CPU step costs ~50 ms even when tiny)


def make_setting(state: EngineState, traffic, *, seed: int, max_len: int | None,
                 num_requests: int | None = None, quick: bool = False,
                 fp8_weights: bool = False) -> tuple[SearchSetting, Any]:
    """The search setting from the engine's space and the traffic shape (lengths scaled to fit).

    ``quick`` (the CPU) times fewer steps per candidate: a CPU step of even a tiny model costs
    tens of milliseconds, and the README's compile must finish in a couple of minutes.
    ``fp8_weights``: the space holds the lossy fp8 projections (``anneal compile --fp8-weights``).
    ``num_requests`` (per workload replay) defaults to :func:`workload_requests` of the scaled
    shape, as every other replay of it counts them (session 11: counted on the unscaled agentic
    shape, the compile replayed 16 requests where ``bench/plans.py`` replayed 26).
    """
    if max_len:
        traffic = traffic.scaled(max_len)
    if num_requests is None:
        num_requests = workload_requests(traffic, quick)
    space = CandidateSpace.from_state(state, fp8_weights=fp8_weights)
    base = state.plan
    conc = traffic.concurrency or max(1.0, (traffic.arrival_rate or 1.0) * 4)
    # No candidate admits fewer sequences than twice the traffic's concurrency. Below it a plan
    # wins nothing measurable on its own shape (s12, H200: agentic at max_num_seqs 8 and at 16 both
    # x1.04 over the hand-set plan) and queues every burst: the same max_num_seqs-8 plan on chat
    # (concurrency 16) ran x0.63-0.67 with TTFT p90 x11.
    space.max_num_seqs = (tuple(m for m in space.max_num_seqs if m >= SEQS_HEADROOM * conc)
                          or (max(space.max_num_seqs),))
    # The batches the traffic would form, bounded by the largest cap a candidate may choose — not
    # by the serving plan's cap: when concurrency drifts above it, raising it is the point.
    dist = batch_size_distribution(conc, max(base.scheduler.max_num_seqs, *space.max_num_seqs))
    typical = quantile_sizes(dist, (0.5,))[0]
    buckets = sorted({1, typical})
    prompt = max(1, round(traffic.prompt_len.quantile(0.5)))
    output = max(1, round(traffic.output_len.quantile(0.5)))
    context = prompt + output // 2
    long_context = round(traffic.prompt_len.quantile(0.9) + traffic.output_len.quantile(0.9) / 2)
    if max_len:
        long_context = min(long_context, max_len - 1)
    # Each request brings its prompt in ceil(prompt / token budget) steps and leaves in `output`
    # decode steps shared with `typical` others. An upper estimate (prompts that arrive together
    # share a step): the 8B's H200 replays ran 0.031 (chat) and 0.055 (agentic); this gives 0.069
    # and 0.099. The order of magnitude is what the kernel tuner needs.
    chunks = -(-prompt // max(1, base.scheduler.max_num_batched_tokens)) if base.scheduler.chunked_prefill else 1
    prefill_per_decode = chunks * typical / output
    decode = BenchSpec(mode="decode", batch_size=typical, context_len=context, prompt_len=prompt,
                       steps=4 if quick else 8, warmup=1 if quick else 2, repeats=3 if quick else 5,
                       seed=seed, per_op=True)  # op by op too: the tuner's signal, the cost model's per-op fits
    setting = SearchSetting(space=space, base=base, decode_spec=decode, batch_dist=dist, buckets=buckets,
                            context_len=context, prompt_len=prompt, seed=seed,
                            workload_requests=num_requests, long_context_len=long_context,
                            prefill_steps_per_decode_step=prefill_per_decode, model_config=state.config)
    return setting, traffic


def workload_requests(traffic, quick: bool) -> int:
    """Requests per workload replay of ``traffic``, the same wherever it is replayed (its own compile,
    another shape's cross-measurement): fewer requests than its concurrency never load the engine
    as the shape does. 4 on the CPU (``quick``)."""
    return 4 if quick else gpu_requests(traffic)


def gpu_requests(traffic, tokens_per_replay: float = 1e5) -> int:
    """Requests per workload replay on a GPU: ~100k tokens, 8..64 requests (long prompts, fewer), and
    at least twice the concurrency. Why the last: with as many requests as the concurrency every
    one is admitted at once and the replay is a single drain (session 10's agentic replay: 8
    requests at concurrency 8, no steady serving at all, and its ratios moved ±3% by sample)."""
    per_request = traffic.prompt_len.mean() + traffic.output_len.mean()
    by_tokens = max(8, min(64, tokens_per_replay / max(per_request, 1.0)))
    return int(max(by_tokens, 2 * round(traffic.concurrency or 0)))
