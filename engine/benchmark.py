"""Timing a plan inside the running engine: a fixed decode/prefill/mixed shape or a replayed workload.

Hardened against flattering numbers: the timed region ends in a device-wide synchronize (work an
op left on another stream is counted), inputs rotate among several sets of sequences (so caches
hold no single working set), outputs are poisoned before each timed step and checked after it,
and warm-up steps are never counted. Reports the median and p10/p90 over repetitions.
"""

from __future__ import annotations

from collections import Counter
import copy
import random
import statistics
import time
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

from anneal.engine.plan import Plan
from anneal.engine.gc_control import GcClock, collection_paused
from anneal.engine.ngram_draft import draft_stats
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.sequence import Sequence


class BenchmarkRequest(BaseModel):
    plan: Plan | None = Field(None, description="apply this plan first (default: the current one)")
    # mixed: one prompt chunk of prompt_len tokens beside batch_size decode rows at context_len, in
    # one step, as a chunked, mixed-prefill scheduler runs them (prefill attention serves both)
    mode: Literal["decode", "prefill", "mixed", "workload"] = "decode"
    batch_size: int = Field(1, ge=1, le=4096)
    context_len: int = Field(256, ge=2)
    prompt_len: int = Field(128, ge=1)
    steps: int = Field(20, ge=1, le=10000)
    warmup: int = Field(3, ge=0, le=1000)
    rotate: int = Field(2, ge=1, le=8, description="input sets cycled through")
    traffic: Any = Field(None, description="TrafficShape (object or preset name) for mode=workload")
    num_requests: int = Field(16, ge=1, le=10000)
    seed: int = 0
    per_op: bool = Field(False, description="also time each op in eager steps (decode/prefill/mixed)")


class BenchmarkResult(BaseModel):
    plan_hash: str
    mode: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    tokens_per_s: float
    samples_ms: list[float]
    per_op_ms: dict[str, float] | None = Field(
        None, description="ms per step spent in each op (eager, events around each call)")
    extra: dict[str, Any] = Field(default_factory=dict)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _sequences(engine, n: int, length: int, computed: int, rng: random.Random,
               name: str = "bench") -> list[Sequence]:
    V = engine.config.vocab_size
    seqs = []
    for i in range(n):
        s = Sequence(f"{name}-{i}", [rng.randrange(V) for _ in range(length)],
                     SamplingParams(temperature=0), seed=i)
        if not engine.blocks.allocate(s):
            for t in seqs:
                engine.blocks.free(t)
            raise ValueError(f"the KV cache cannot hold {n} sequences of {length} tokens")
        s.num_computed_tokens = computed
        seqs.append(s)
    return seqs


def _timed_steps(engine, sets: list[list[tuple[Sequence, int]]], req: BenchmarkRequest,
                 decode_only: bool) -> tuple[list[float], list[float]]:
    """Wall time of each step (host prep + device, synced device-wide, so work on other streams
    counts) and, for graph replays on a GPU, the device time of each replay alone."""
    samples = []
    events = engine.runner.replay_events = [] if engine.device.type == "cuda" else None
    try:  # a step that raises must not leave every later serving replay recording events
        for i in range(req.warmup + req.steps):
            items = sets[i % len(sets)]
            with torch.inference_mode():  # graph outputs are inference tensors
                for outputs in engine.runner.all_graph_outputs():  # poison graph outputs: a skipped write shows up
                    for t in outputs.values():
                        if t is not None:
                            t.fill_(float("nan") if t.is_floating_point() else -1)
            _sync(engine)
            t0 = time.perf_counter()
            engine.runner.run(items, decode_only)
            _sync(engine)
            dt = time.perf_counter() - t0
            if i >= req.warmup:
                samples.append(dt)
            elif events:
                events.clear()
    finally:
        engine.runner.replay_events = None
    device = [a.elapsed_time(b) / 1e3 for a, b in events or []]
    return samples, device


# GPU cycles (~0.25 ms on an H200) the device sleeps before each timed op, so the host has queued
# the op's launches by the time the start event runs.
_HIDE_LAUNCH_CYCLES = 500_000


def _per_op(engine, items: list[tuple[Sequence, int]], decode_only: bool, steps: int = 3) -> dict:
    """Time every op call of a few eager steps (graphs off): device events on the GPU, the host
    clock on the CPU. On the GPU the device first sleeps while the host queues the op, so the events
    time its kernels back to back. Without that they timed the host's launches: on an H200 (8B shape,
    2 layers, batch 12) the ops summed to 1.51-1.64 ms for a 0.575 ms graph step (add_rmsnorm
    240-266 µs against 21); with it, 0.622 ms.
    At tensor-parallel degree > 1 the plan's ops are timed apart from the collectives the split adds
    (``plan.COLLECTIVES``: ``all_reduce``, ``gather_logits``), each its own entry, so a
    projection's time is its kernels' and the link's cost is measured, not inferred."""
    runner = engine.runner
    cuda = engine.device.type == "cuda"
    calls: list[tuple[str, Any, Any]] = []

    def wrap(name, fn):
        def timed(*a, **k):
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(_HIDE_LAUNCH_CYCLES)
                s.record()
                out = fn(*a, **k)
                e.record()
                calls.append((name, s, e))
            else:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                calls.append((name, t0, time.perf_counter()))
            return out
        return timed

    plan_ops, serving = runner.plan_ops, runner.model.ops
    timed = copy.copy(plan_ops)
    for name in [*plan_ops.choices, *(n for n in plan_ops.FUSED if getattr(plan_ops, n, None) is not None)]:
        setattr(timed, name, wrap(name, getattr(plan_ops, name)))

    # The fused lm_head + argmax runs only inside decode graphs, never in the eager steps timed
    # here (they call lm_head and argmax): timed on its own beside each step, so what a step runs
    # once whatever its layer count has a time for every plan (agents/cost_model.once_a_step_ms).
    # The serving table's, timed whole: at degree > 1 it gathers the logits, left out by local_only.
    head = head_argmax = None
    if decode_only and serving.lm_head_argmax is not None:
        head = torch.randn(len(items), engine.config.hidden_size, dtype=runner.dtype, device=engine.device)
        head_argmax = wrap("lm_head_argmax", serving.lm_head_argmax)

    def step() -> None:
        runner.run(items, decode_only)
        if head is not None:
            with runner.tp.local_only():  # rank 0 alone: the other ranks run only the mirrored step
                head_argmax(head, runner.model.w.lm_head)

    try:
        with runner.eager():
            runner.model.ops = runner.tp.wrap(timed, around=wrap)
            step()  # warm-up, not counted
            calls.clear()
            for _ in range(steps):
                step()
            _sync(engine)
    finally:
        runner.model.ops = serving
    # each op's time in each step, then the median step, which one slow step (a host stall, a
    # kernel built on a late first call) does not move. Session 26's chat compile (8B, 2 layers):
    # in 21 of 669 decode timings the ops summed to over 1.5x the graph step, rmsnorm once 2.84 ms
    # and attention 0.82 ms in a 0.59 ms step, under the mean of three steps used until then.
    # Every step makes the same calls, in the same order.
    per_step = len(calls) // steps
    by_op: dict[str, list[float]] = {}
    for i, (name, s, e) in enumerate(calls):
        ms = s.elapsed_time(e) if cuda else (e - s) * 1e3
        times = by_op.setdefault(name, [0.0] * steps)
        times[min(i // per_step, steps - 1)] += ms
    return {name: statistics.median(times) for name, times in by_op.items()}


APPLY_PARTS = ("build_s", "warmup_s", "capture_s", "total_s")  # ApplyReport's seconds, as a benchmark answer reports them


def run_benchmark(engine, req: BenchmarkRequest) -> BenchmarkResult:
    """Runs on the engine thread with the engine idle."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the benchmark needs an idle engine")
    applied = engine.apply_plan(req.plan) if req.plan is not None and req.plan != engine.plan else None
    t0 = time.perf_counter()
    result = _measure(engine, req)
    # Where an experiment's engine time goes (the ledger keeps it): a compile's experiments/hour
    # halved on a fresh machine (session 53), and apply's warm-up, where Triton compiles, says whether
    # kernel compiles or the timing itself took it.
    result.extra["benchmark_s"] = time.perf_counter() - t0
    if applied is not None:
        result.extra["apply"] = {k: getattr(applied, k) for k in APPLY_PARTS}
    return result


def _measure(engine, req: BenchmarkRequest) -> BenchmarkResult:
    rng = random.Random(req.seed)
    if req.mode == "workload":
        return _workload(engine, req)
    if req.mode in ("decode", "mixed") and req.context_len >= engine.max_model_len:
        raise ValueError(f"context_len must be < max_model_len ({engine.max_model_len})")
    if req.mode in ("prefill", "mixed") and req.prompt_len > engine.max_model_len:
        raise ValueError(f"prompt_len must be <= max_model_len ({engine.max_model_len})")

    sets: list[list[tuple[Sequence, int]]] = []  # whatever is allocated is in here, freed below
    try:
        for _ in range(req.rotate):
            items: list[tuple[Sequence, int]] = []
            sets.append(items)
            if req.mode == "prefill":
                items += [(s, req.prompt_len) for s in _sequences(engine, req.batch_size, req.prompt_len, 0, rng)]
                continue
            items += [(s, 1) for s in _sequences(engine, req.batch_size, req.context_len, req.context_len - 1, rng)]
            if req.mode == "mixed":  # decodes first, then the chunk, as the scheduler does
                items += [(s, req.prompt_len) for s in _sequences(engine, 1, req.prompt_len, 0, rng, "bench-prompt")]
        tokens_per_step = sum(n for _, n in sets[0])
        with collection_paused():
            samples, device = _timed_steps(engine, sets, req, decode_only=req.mode == "decode")
        per_op = _per_op(engine, sets[0], req.mode == "decode") if req.per_op else None
    finally:  # also when the cache cannot hold a later rotation: the benchmark changes nothing
        for items in sets:
            for s, _ in items:
                engine.blocks.free(s)
    wall = {"wall_median_ms": statistics.median(samples) * 1e3,
            "wall_p10_ms": _quantile(samples, 0.1) * 1e3, "wall_p90_ms": _quantile(samples, 0.9) * 1e3}
    # Every timed step a graph replay: rank on the replay's CUDA-event time. All of a step's device
    # work is inside its graph (capture fails on unjoined side streams, and work launched outside the
    # capture never replays, so its outputs stay poisoned), while the host's share of the wall clock
    # does not depend on the plan and jumps between levels run to run (session 4: wall p90/p10 up
    # to 1.39, replay at most 1.015). Eager steps keep the wall clock, synced device-wide, and so do
    # prompt and mixed steps in token graphs: the host's share is what those graphs change (an eager
    # prompt step's launches against a replay's input copies), so their events would flatter them.
    graphed = bool(device) and len(device) == len(samples)
    timed = device if graphed and req.mode == "decode" else samples
    med = statistics.median(timed)
    return BenchmarkResult(
        plan_hash=engine.plan.hash, mode=req.mode, median_ms=med * 1e3,
        p10_ms=_quantile(timed, 0.1) * 1e3, p90_ms=_quantile(timed, 0.9) * 1e3,
        tokens_per_s=tokens_per_step / med, samples_ms=[x * 1e3 for x in timed],
        per_op_ms=per_op,
        extra={"batch_size": req.batch_size, "context_len": req.context_len,
               "graph": graphed,
               "timing": "graph replay (CUDA events)" if timed is device else "wall (device-wide sync)",
               **wall,
               **({"host_median_ms": statistics.median(w - d for w, d in zip(samples, device)) * 1e3}
                  if timed is device else {})},
    )


def _workload(engine, req: BenchmarkRequest) -> BenchmarkResult:
    """Replay a TrafficShape's synthetic workload, paced like the traffic; per-request timings."""
    from anneal.engine.traffic import TrafficShape, load_traffic, make_workload

    t = req.traffic or "chat"
    shape = load_traffic(t) if isinstance(t, str) else TrafficShape.model_validate(t)
    wl = make_workload(shape, req.num_requests, seed=req.seed, vocab_size=engine.config.vocab_size,
                       max_model_len=engine.max_model_len)
    # Pace requests as the traffic would: a shape with a concurrency keeps that many in flight
    # (closed loop, what throughput-vs-latency comparisons need); one with only an arrival rate
    # releases requests at their Poisson arrival times. All at once would measure a batch job.
    concurrency = round(shape.concurrency) if shape.concurrency else wl.concurrency
    # The warm-up replay (the first requests after a plan change pay its JIT and allocator
    # warm-up) needs every prompt-length regime once, not the whole workload.
    warm = [r.model_copy(update={"max_tokens": min(r.max_tokens, 8)})
            for r in wl.requests[:max(2, concurrency or 4)]]
    runs = []
    # A step's tokens are on the host when step() returns; the sync after each one also charges
    # it any device work it left behind. With overlap scheduling the next step is that work, by
    # design: the run's end is synced instead (and verification rejects side-stream kernels).
    overlap = engine.plan.scheduler.overlap
    for rep in range(max(1, min(req.steps, 3)) + (1 if req.warmup else 0)):
        first, last, starts = {}, {}, {}
        itl: list[float] = []
        pending = list(enumerate(warm if req.warmup and rep == 0 else wl.requests))
        # Every replay starts with a cold prefix cache: the same requests replayed again would hit
        # every prompt the last replay (or the warm-up) left cached (session 7: an agentic replay
        # read 1 prompt step instead of 18, and the search lost sight of prefill). Prefix sharing
        # within the workload is the traffic shape's own and still hits.
        engine.blocks.reset_prefix_cache()
        in_flight: set[str] = set()
        prompts: dict[str, list[int]] = {}
        produced: dict[str, list[int]] = {}  # greedy outputs: what a drafter would have accepted (after the run)

        def admit(now_s: float) -> None:
            while pending:
                i, r = pending[0]
                if concurrency is not None and len(in_flight) >= concurrency:
                    return
                if concurrency is None and r.arrival_s > now_s:
                    return
                pending.pop(0)
                rid = f"wl-{rep}-{i}"
                engine.add_request(rid, r.prompt_token_ids, SamplingParams(
                    max_tokens=r.max_tokens, temperature=0, ignore_eos=True))
                in_flight.add(rid)
                prompts[rid] = r.prompt_token_ids
                starts[rid] = time.perf_counter()

        _sync(engine)
        t0 = time.perf_counter()
        n_out = 0
        split = _TimeSplit(engine.stats())
        with GcClock() as gc_clock:  # unhooked from the collector however the replay ends
            admit(0.0)
            # Until the last admission the engine serves the traffic's concurrency; after it, a drain
            # with a shrinking batch that steady serving never sees (session 10: a third of the chat
            # replay). Its own tokens/s says which of the two a plan sped up.
            steady_end, steady_out = None, 0
            while pending or engine.has_unfinished_requests():
                if steady_end is None and not pending:
                    steady_end = time.perf_counter()
                if not engine.has_unfinished_requests():  # idle until the next Poisson arrival
                    time.sleep(max(0.0, pending[0][1].arrival_s - (time.perf_counter() - t0)))
                    admit(time.perf_counter() - t0)
                    continue
                t_step = time.perf_counter()
                outs = engine.step()
                if not overlap:  # overlap scheduling is the next step running past this point
                    _sync(engine)
                now = time.perf_counter()
                split.add(engine.stats(), now - t_step, draining=not pending)
                for o in outs:
                    n_out += len(o.new_token_ids)
                    produced.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if steady_end is None:
                        steady_out += len(o.new_token_ids)
                    if o.request_id not in first:
                        first[o.request_id] = now - starts[o.request_id]  # TTFT from its own admission
                    elif o.new_token_ids:  # per token, as the server's metrics count it: an output of
                        n = len(o.new_token_ids)  # several (speculative decoding) spreads its gap over them
                        itl.extend([(now - last[o.request_id]) / n] * n)
                    last[o.request_id] = now
                    if o.finished:
                        in_flight.discard(o.request_id)
                admit(now - t0)
            _sync(engine)  # whatever the last steps left on the device counts
        total = time.perf_counter() - t0
        summary = split.summary(total, engine.stats()) | gc_clock.totals()
        steady_s = (steady_end or t0) - t0  # ~0 when all requests were admitted at once: no steady part
        summary.update(steady_ms=steady_s * 1e3, steady_output_tokens=steady_out,
                       steady_tokens_per_s=steady_out / steady_s if steady_s > 0 else 0.0)
        runs.append((total, n_out, sorted(first.values()), itl, summary, dict(sorted(split.decode_batches.items())),
                     [(prompts[rid], out) for rid, out in produced.items()]))
    if req.warmup and len(runs) > 1:
        runs = runs[1:]
    totals = [r[0] for r in runs]
    med = statistics.median(totals)
    n_out = runs[-1][1]
    ttft = [x for r in runs for x in r[2]]
    itl = [x for r in runs for x in r[3]] or [0.0]
    return BenchmarkResult(
        plan_hash=engine.plan.hash, mode="workload", median_ms=med * 1e3,
        p10_ms=_quantile(totals, 0.1) * 1e3, p90_ms=_quantile(totals, 0.9) * 1e3,
        tokens_per_s=n_out / med, samples_ms=[x * 1e3 for x in totals],
        extra={"traffic": shape.name, "num_requests": len(wl.requests), "output_tokens": n_out,
               "pacing": f"closed loop, {concurrency} in flight" if concurrency else "poisson arrivals",
               "ttft_p50_ms": _quantile(ttft, 0.5) * 1e3, "ttft_p90_ms": _quantile(ttft, 0.9) * 1e3,
               "itl_p50_ms": _quantile(itl, 0.5) * 1e3, "itl_p90_ms": _quantile(itl, 0.9) * 1e3,
               "steady_tokens_per_s": runs[-1][4]["steady_tokens_per_s"] or None, "time_split": runs[-1][4],
               "decode_batches": runs[-1][5], "speculation": draft_stats(runs[-1][6]).as_dict()},
    )


class _TimeSplit:
    """Where a replay's wall time went: decode-only steps, steps that carried prompt tokens
    (prefill or mixed), everything between steps (admission, bookkeeping, idle), and how much of
    it came after the last request was admitted (the drain, where fewer requests are in flight).
    Says which part of a plan's tokens/s a kernel, a scheduler knob or the workload itself sets."""

    def __init__(self, start) -> None:
        self.start = start  # the engine's stats when the replay began
        self.decode_s = self.prefill_s = self.drain_s = 0.0
        self.prefill_steps = self.prompt_tokens = 0
        self.decode_context = 0  # KV positions the decode steps' rows attended, summed
        self.prefill_rows = self.prefill_context = 0  # the same for the steps with prompt tokens
        # decode-only steps per batch size (what graphs replay); their count and rows derive from it
        self.decode_batches: Counter[int] = Counter()

    def add(self, stats, dt: float, draining: bool) -> None:
        if stats.last_decode_only:
            self.decode_s += dt
            self.decode_batches[stats.last_batch_size] += 1
            self.decode_context += stats.last_context_tokens
        else:
            self.prefill_s += dt
            self.prefill_steps += 1
            self.prompt_tokens += stats.last_num_tokens
            self.prefill_rows += stats.last_batch_size
            self.prefill_context += stats.last_context_tokens
        if draining:
            self.drain_s += dt

    def summary(self, total_s: float, end) -> dict[str, float]:
        decode_steps = sum(self.decode_batches.values())
        decode_seqs = sum(b * n for b, n in self.decode_batches.items())
        return {
            # engine steps, and how many launched before the previous one's tokens were read
            # (overlap scheduling; the step() calls above count differently when it pipelines)
            "engine_steps": end.steps - self.start.steps,
            "pipelined_steps": end.pipelined_steps - self.start.pipelined_steps,
            # decode steps that checked n-gram drafts (scheduler.speculative_tokens), and their drafts
            "speculative_steps": end.speculative_steps - self.start.speculative_steps,
            "drafted_tokens": end.drafted_tokens - self.start.drafted_tokens,
            "accepted_tokens": end.accepted_tokens - self.start.accepted_tokens,
            "total_ms": total_s * 1e3,
            "decode_ms": self.decode_s * 1e3, "decode_steps": decode_steps,
            "decode_mean_batch": decode_seqs / max(1, decode_steps),
            "decode_step_ms": self.decode_s * 1e3 / max(1, decode_steps),
            # with the batch, what the decode steps had to read: the roofline headroom in reports
            "decode_mean_context": self.decode_context / max(1, decode_seqs),
            "prefill_ms": self.prefill_s * 1e3, "prefill_steps": self.prefill_steps,
            "tokens_in_prefill_steps": self.prompt_tokens,
            "prefill_mean_rows": self.prefill_rows / max(1, self.prefill_steps),
            "prefill_mean_context": self.prefill_context / max(1, self.prompt_tokens),  # per token
            "between_steps_ms": (total_s - self.decode_s - self.prefill_s) * 1e3,
            "drain_ms": self.drain_s * 1e3,
        }
