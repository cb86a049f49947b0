"""The workload replay of POST /admin/benchmark paces requests like the traffic it replays."""

from __future__ import annotations

import pytest

from anneal.engine.benchmark import BenchmarkRequest, run_benchmark
from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.traffic import load_traffic


@pytest.fixture(scope="module")
def eng() -> Engine:
    return Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=128, num_kv_blocks=256))


def _replay_stepping(eng: Engine, shape, n: int, wrap):
    """A replay of ``n`` requests whose every engine step runs as ``wrap(step)``."""
    step = eng.step
    eng.step = lambda: wrap(step)
    try:
        return run_benchmark(eng, BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"),
                                                   num_requests=n, steps=1, warmup=0))
    finally:
        del eng.step


def _replay(eng: Engine, shape, n: int) -> tuple[list[int], dict]:
    """Running-batch sizes seen at every step of a replay of ``n`` requests, and the result."""
    seen: list[int] = []

    def counting(step):
        seen.append(len(eng.scheduler.running) + len(eng.scheduler.waiting))
        return step()

    return seen, _replay_stepping(eng, shape, n, counting).extra


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_keeps_the_traffic_concurrency_in_flight(eng, concurrency):
    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": float(concurrency)})
    seen, extra = _replay(eng, shape, 8)
    assert max(seen) == concurrency  # never more in flight, and the level is reached
    assert extra["pacing"] == f"closed loop, {concurrency} in flight"
    assert extra["num_requests"] == 8 and extra["output_tokens"] > 0
    assert not eng.has_unfinished_requests()


def test_poisson_arrivals_are_released_over_time(eng):
    shape = load_traffic("chat").scaled(60).model_copy(update={"concurrency": None, "arrival_rate": 40.0})
    seen, extra = _replay(eng, shape, 6)
    assert extra["pacing"] == "poisson arrivals"
    assert seen[0] < 6  # not all at once: later requests wait for their arrival times
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_time_split_accounts_for_every_step(eng):
    """The replay says where its wall time went: every step counted once as decode-only or as
    carrying prompt tokens, decode batches never wider than the concurrency, parts within the total."""
    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": 3.0})
    kinds: list[bool] = []

    def recording(step):
        outs = step()
        kinds.append(eng.stats().last_decode_only)
        return outs

    res = _replay_stepping(eng, shape, 6, recording)
    split = res.extra["time_split"]
    assert split["decode_steps"] == sum(kinds) and split["decode_steps"] > 0
    assert split["prefill_steps"] == len(kinds) - sum(kinds) and split["prefill_steps"] >= 1
    assert 1 <= split["decode_mean_batch"] <= 3
    assert split["tokens_in_prefill_steps"] >= split["prefill_steps"]
    assert split["decode_ms"] > 0 and split["prefill_ms"] > 0 and split["between_steps_ms"] >= 0
    parts = split["decode_ms"] + split["prefill_ms"] + split["between_steps_ms"]
    assert parts == pytest.approx(split["total_ms"]) and split["total_ms"] == pytest.approx(res.median_ms)
    assert 0 < split["drain_ms"] < split["total_ms"]


def test_replay_reports_its_steady_part_apart_from_the_drain(eng):
    """Until the last admission the traffic's concurrency is in flight; after it the batch shrinks
    (a third of the H200 chat replay). The steady part has its own tokens/s; a replay of one wave
    (as many requests as the concurrency) has none."""
    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": 2.0})
    _, extra = _replay(eng, shape, 6)
    split = extra["time_split"]
    assert 0 < split["steady_ms"] < split["total_ms"]
    assert 0 < split["steady_output_tokens"] < extra["output_tokens"]
    assert extra["steady_tokens_per_s"] == pytest.approx(split["steady_output_tokens"] / split["steady_ms"] * 1e3)
    _, extra = _replay(eng, shape, 2)  # both admitted at once: all drain
    assert extra["steady_tokens_per_s"] is None and extra["time_split"]["steady_output_tokens"] == 0


def test_decode_benchmark_without_graph_replays_ranks_on_the_wall_clock(eng):
    res = run_benchmark(eng, BenchmarkRequest(mode="decode", batch_size=2, context_len=40, steps=5, warmup=1))
    assert res.extra["timing"].startswith("wall")
    assert res.median_ms == res.extra["wall_median_ms"] > 0
    assert len(res.samples_ms) == 5 and "host_median_ms" not in res.extra


def test_time_split_counts_a_step_that_finishes_a_request_as_decode():
    """A decode step in which a request ends frees its blocks; the step must still count as a
    decode step (it did: as one carrying prompt tokens, so session 5's chat split overstated the
    prefill share)."""
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=2048, num_kv_blocks=2048))
    schedule = eng.scheduler.schedule
    with_prompt = []

    def counting():
        batch = schedule()
        if batch.items and not batch.decode_only:
            with_prompt.append(batch.num_tokens)
        return batch

    eng.scheduler.schedule = counting
    res = run_benchmark(eng, BenchmarkRequest(mode="workload", traffic="chat", num_requests=8, steps=1, warmup=0))
    split = res.extra["time_split"]
    assert split["prefill_steps"] == len(with_prompt) > 0
    assert split["tokens_in_prefill_steps"] == sum(with_prompt)


def test_replay_reports_how_many_decode_steps_ran_at_each_batch_size(eng):
    """What the graph-bucket fit is fitted to: the batches a replay ran, its drain included (the
    batch falls from the concurrency to 1), not a distribution assumed from the concurrency."""
    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": 3.0})
    _, extra = _replay(eng, shape, 7)
    batches, split = extra["decode_batches"], extra["time_split"]
    assert sum(batches.values()) == split["decode_steps"]
    assert sum(b * n for b, n in batches.items()) == pytest.approx(split["decode_mean_batch"] * split["decode_steps"])
    assert max(batches) == 3 and 1 in batches  # the full batch, and the drain's last request alone


@pytest.mark.parametrize("overlap", [False, True])
def test_time_split_reports_the_positions_decode_rows_attend(overlap):
    """``decode_mean_context`` (with the batch, what the decode steps read: the report's roofline
    headroom) is the mean over decode rows of the positions each attends, its new token included;
    ``prefill_mean_context`` the same per token of the steps with prompt tokens (a chunk of n after
    c computed attends c+1 ... c+n)."""
    from anneal.engine.plan import Plan, SchedulerKnobs

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=512, num_kv_blocks=512))
    eng.apply_plan(Plan(scheduler=SchedulerKnobs(overlap=overlap)))
    schedule = eng.scheduler.schedule
    rows: list[int] = []
    prompt_steps: list[tuple[int, int]] = []  # (tokens, positions attended)

    def counting():
        batch = schedule()
        if batch.items and batch.decode_only:
            rows.extend(len(s) for s, _ in batch.items)
        elif batch.items:
            prompt_steps.append((batch.num_tokens, sum(sum(range(s.num_computed_tokens + 1,
                                                                 s.num_computed_tokens + n + 1))
                                                       for s, n in batch.items)))
        return batch

    eng.scheduler.schedule = counting
    shape = load_traffic("chat").scaled(200).model_copy(update={"concurrency": 3.0})
    res = run_benchmark(eng, BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"),
                                              num_requests=6, steps=1, warmup=0))
    split = res.extra["time_split"]
    assert rows and split["decode_mean_context"] > 1
    if overlap:  # a step() that only completes the step in flight is counted with that step's rows
        assert split["decode_mean_context"] == pytest.approx(sum(rows) / len(rows), rel=0.1)
    else:
        assert split["decode_mean_context"] == pytest.approx(sum(rows) / len(rows))
        assert split["decode_mean_batch"] * split["decode_steps"] == pytest.approx(len(rows))
    tokens = sum(t for t, _ in prompt_steps)
    assert split["tokens_in_prefill_steps"] == tokens
    assert split["prefill_mean_context"] == pytest.approx(sum(a for _, a in prompt_steps) / tokens)


def test_a_replay_does_not_hit_the_prompts_the_last_replay_cached():
    """Replaying the same requests again (the next repetition, the next plan's measurement) must
    not find their prompts cached: each replay sees only the prefix sharing its traffic has."""
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=1024, num_kv_blocks=4096))
    shape = load_traffic("agentic").scaled(800)
    hits = []
    for _ in range(2):
        before = eng.blocks.hit_tokens
        run_benchmark(eng, BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"),
                                            num_requests=4, steps=1, warmup=0, seed=3))
        hits.append(eng.blocks.hit_tokens - before)
    assert hits[0] == hits[1]
    res = run_benchmark(eng, BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"),
                                              num_requests=4, steps=2, warmup=1, seed=3))
    assert res.extra["time_split"]["prefill_steps"] >= 1  # the timed replay still prefills its prompts


def test_mixed_benchmark_runs_a_prompt_chunk_beside_decode_rows(eng):
    """``mode="mixed"``: the steps a mixed-prefill scheduler runs (decode rows, then a prompt chunk),
    so prefill attention is timed with the decode rows it also serves."""
    calls: list[tuple[list[tuple[int, int]], bool]] = []
    run = eng.runner.run

    def spy(items, decode_only, *a, **kw):
        calls.append(([(len(s), n) for s, n in items], decode_only))
        return run(items, decode_only, *a, **kw)

    eng.runner.run = spy
    try:
        res = run_benchmark(eng, BenchmarkRequest(mode="mixed", batch_size=3, context_len=50, prompt_len=20,
                                                  steps=4, warmup=1, per_op=True))
    finally:
        eng.runner.run = run
    assert calls and all(not d and shape == [(50, 1)] * 3 + [(20, 20)] for shape, d in calls), calls
    assert res.tokens_per_s == pytest.approx(23 / (res.median_ms / 1e3))
    assert "attention_prefill" in res.per_op_ms and "attention_decode" not in res.per_op_ms
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_a_benchmark_the_cache_cannot_hold_changes_nothing(eng, mode):
    """The second rotation not fitting used to leave the first one's blocks allocated."""
    per_set = eng.blocks.num_blocks // 2 // 8 + 1  # sequences of 8 blocks: one set fits, two do not
    with pytest.raises(ValueError, match="cannot hold"):
        run_benchmark(eng, BenchmarkRequest(mode=mode, batch_size=per_set, context_len=120, prompt_len=8,
                                            rotate=2, steps=1, warmup=0))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_replay_counts_the_garbage_collector_time_its_steps_took(eng):
    """A collection runs inside whichever step crossed the threshold, so the replay reports how
    long the collector took during it: here one step forces a full collection."""
    import gc

    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": 2.0})
    forced: list[int] = []

    def collecting(step):
        if not forced:
            forced.append(gc.collect())
        return step()

    split = _replay_stepping(eng, shape, 4, collecting).extra["time_split"]
    assert split["gc_full_collections"] >= 1 and split["gc_collections"] >= split["gc_full_collections"]
    assert 0 < split["gc_ms"] < split["total_ms"]
    # the clock stops with the replay: none stays hooked into the collector
    from anneal.engine.gc_control import GcClock

    assert not any(isinstance(getattr(cb, "__self__", None), GcClock) for cb in gc.callbacks)
    with pytest.raises(RuntimeError), GcClock():  # nor after a replay that fails
        raise RuntimeError("an engine step failed")
    assert not any(isinstance(getattr(cb, "__self__", None), GcClock) for cb in gc.callbacks)


def test_per_op_times_are_the_median_step_so_one_stalled_step_moves_nothing(eng):
    """An op stalled in one of the timed steps (session 26: ops summing to 1.5x the graph step in
    21 of 669 fast-tier timings) reads at its other steps' time, not at a third of the stall."""
    import random
    import time

    from anneal.engine.benchmark import _per_op, _sequences

    ops = eng.runner.ops
    lm_head, calls = ops.lm_head, []

    def stalls_once(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # one warm-up step, then three timed: the second timed step stalls
            time.sleep(0.3)
        return lm_head(*a, **k)

    items = [(s, 1) for s in _sequences(eng, 2, 16, 15, random.Random(0))]
    ops.lm_head = stalls_once
    try:
        per_op = _per_op(eng, items, True, steps=3)
    finally:
        ops.lm_head = lm_head
        for s, _ in items:
            eng.blocks.free(s)
    assert len(calls) == 4
    assert per_op["lm_head"] < 50.0, per_op  # the mean of the three read >= 100 ms


def test_per_op_times_the_fused_head_a_decode_graph_runs_beside_the_eager_steps(eng):
    """The fused lm_head + argmax runs only in decode graphs, never in the eager steps per-op timing
    runs: it is timed beside each of them, so every plan's once-a-step part has a time (the cost
    model ranks plans on it); prompt steps do not run it."""
    import random

    from anneal.engine.benchmark import _per_op, _sequences

    ops, shapes = eng.runner.ops, []

    def fused(h, w):
        shapes.append(tuple(h.shape))
        return (h @ w.T).argmax(-1)

    items = [(s, 1) for s in _sequences(eng, 3, 16, 15, random.Random(0))]
    ops.lm_head_argmax = fused
    try:
        per_op = _per_op(eng, items, True, steps=3)
        prompt = _per_op(eng, items, False, steps=3)
    finally:
        ops.lm_head_argmax = None
        for s, _ in items:
            eng.blocks.free(s)
    assert shapes == [(3, eng.config.hidden_size)] * 4  # one warm-up and three timed steps
    assert per_op["lm_head_argmax"] > 0 and {"lm_head", "argmax"} <= set(per_op)
    assert "lm_head_argmax" not in prompt


def test_replay_reports_what_an_ngram_drafter_would_accept_on_its_outputs(eng):
    """The drafter is replayed over the replay's own greedy outputs: the same figures as the
    drafter over what the engine generates for those prompts; the tiny random model loops, so it
    accepts most drafts (a large-vocabulary random model accepts none: bench/NOTES.md, session 41)."""
    from anneal.engine.ngram_draft import draft_stats
    from anneal.engine.sampling_params import SamplingParams
    from anneal.engine.traffic import make_workload

    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": 2.0})
    res = _replay_stepping(eng, shape, 4, lambda step: step())
    spec = res.extra["speculation"]
    wl = make_workload(shape, 4, seed=0, vocab_size=eng.config.vocab_size, max_model_len=eng.max_model_len)
    prompts = [r.prompt_token_ids for r in wl.requests]
    outs = eng.generate(prompts, [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
                                  for r in wl.requests])
    want = draft_stats(list(zip(prompts, outs))).as_dict()
    assert spec == want
    assert spec["tokens"] == sum(len(o) - 1 for o in outs) and spec["accepted"] > 0
    assert 1.0 < spec["tokens_per_step"] <= spec["k"] + 1


def test_a_speculating_plan_replays_the_same_tokens_in_fewer_steps(eng):
    """With scheduler.speculative_tokens the replay's decode steps check drafts (the tiny model loops,
    so most hold): the same output tokens, fewer engine steps, the drafts counted in the time split."""
    from anneal.engine.plan import Plan

    shape = load_traffic("chat").scaled(100).model_copy(update={"concurrency": 2.0})
    plain = _replay_stepping(eng, shape, 4, lambda step: step()).extra
    eng.apply_plan(Plan(scheduler={"speculative_tokens": 4}))
    try:
        spec = _replay_stepping(eng, shape, 4, lambda step: step()).extra
    finally:
        eng.apply_plan(Plan())
    assert spec["output_tokens"] == plain["output_tokens"] and spec["speculation"] == plain["speculation"]
    s, p = spec["time_split"], plain["time_split"]
    assert p["speculative_steps"] == 0 and s["speculative_steps"] > 0
    assert 0 < s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["engine_steps"] < p["engine_steps"]


def test_itl_is_per_token_when_a_step_emits_several(eng):
    """A speculating step delivers several tokens at once; the replay's ITL spreads the gap over
    them, as the server's Prometheus ITL does. Every step here takes at least 20 ms, so plain decoding
    reads >= 20 ms a token, and the tiny model's accepted loops read well under it."""
    import time

    from anneal.engine.plan import Plan

    def slow(step):
        time.sleep(0.02)
        return step()

    # Outputs long enough that most tokens come from accepted drafts: with ~40 tokens about half did,
    # and the p50 sat on the boundary between grouped and single tokens (a flake under load).
    shape = load_traffic("chat").scaled(250).model_copy(update={"concurrency": 2.0})
    plain = _replay_stepping(eng, shape, 3, slow).extra
    eng.apply_plan(Plan(scheduler={"speculative_tokens": 4}))
    try:
        spec = _replay_stepping(eng, shape, 3, slow).extra
    finally:
        eng.apply_plan(Plan())
    assert plain["itl_p50_ms"] >= 20 and spec["time_split"]["accepted_tokens"] > 0
    assert spec["itl_p50_ms"] < plain["itl_p50_ms"] / 2


def test_a_benchmark_answer_says_where_its_engine_time_went(eng):
    """A plan in the body is applied first, and its apply breakdown rides along (the compiler's ledger
    keeps it per experiment); the same plan again is not applied, so it has no breakdown."""
    from anneal.engine.plan import Plan

    old = eng.plan
    plan = Plan(cuda_graph_batch_sizes=[], scheduler={"max_num_seqs": 7})
    req = BenchmarkRequest(plan=plan, mode="decode", batch_size=2, context_len=40, steps=3, warmup=1)
    try:
        first = run_benchmark(eng, req).extra
        again = run_benchmark(eng, req).extra
        workload = run_benchmark(eng, BenchmarkRequest(plan=old, mode="workload", num_requests=2, steps=1,
                                                       traffic=load_traffic("chat").scaled(100).model_dump(mode="json"))).extra
    finally:
        eng.apply_plan(old)
    apply = first["apply"]
    assert set(apply) == {"build_s", "warmup_s", "capture_s", "total_s"}
    assert all(v >= 0 for v in apply.values())
    assert apply["total_s"] >= apply["build_s"] + apply["warmup_s"] + apply["capture_s"] - 1e-6
    assert first["benchmark_s"] > 0 and again["benchmark_s"] > 0 and "apply" not in again
    assert workload["apply"]["total_s"] > 0 and workload["benchmark_s"] > 0
