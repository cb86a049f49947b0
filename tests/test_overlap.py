"""Overlap scheduling (``scheduler.overlap``): the next decode step is launched before the host has
read the last one's tokens. The tokens, finish reasons and KV/prefix-cache state must be exactly
what the plain scheduler produces, through stops, aborts, admissions and sampled requests."""

from __future__ import annotations

import random

import pytest

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.overlap import PLACEHOLDER
from anneal.engine.plan import Plan
from anneal.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine(overlap: bool, **kw) -> Engine:
    plan = Plan.model_validate({"scheduler": {"overlap": overlap, "max_num_seqs": 8}})
    return Engine(EngineArgs(model="random:tiny", device="cpu", block_size=8, num_kv_blocks=kw.pop("blocks", 96),
                             max_model_len=kw.pop("max_model_len", 96), seed=3, plan=plan, **kw))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def run(eng: Engine, jobs: list[tuple[list[int], SamplingParams]], events=None) -> dict[str, tuple]:
    """Add the jobs, step to the end; returns each request's tokens and finish reason. ``events``:
    (request, tokens delivered) -> callable(engine), called once that many tokens have arrived
    (the overlap path delivers each token one call later, so step counts would not compare)."""
    out: dict[str, list[int]] = {}
    reason: dict[str, str | None] = {}
    cached: dict[str, int] = {}
    for i, (p, sp) in enumerate(jobs):
        eng.add_request(f"r{i}", p, sp)
        out[f"r{i}"] = []
    step = 0
    pending = dict(events or {})
    while eng.has_unfinished_requests():
        for (rid, n), action in list(pending.items()):
            if len(out.get(rid, ())) >= n:
                action(eng)
                del pending[(rid, n)]
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                reason[o.request_id] = o.finish_reason
            assert o.num_output_tokens == len(out[o.request_id])
        step += 1
        assert step < 2000
    eng.blocks.check_consistency()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, "blocks left allocated"
    assert all(b.token_ids is None or PLACEHOLDER not in b.token_ids for b in eng.blocks.blocks), \
        "a placeholder reached the prefix cache"
    return {r: (out[r], reason.get(r), cached.get(r, 0)) for r in out}


def greedy(max_tokens: int, stop=()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop_token_ids=list(stop))


def counting_launches(eng: Engine) -> list[bool]:
    """Which decode launches took their input ids from a step still in flight."""
    seen: list[bool] = []
    launch = eng.runner.launch_decode

    def spy(seqs, ids=None):
        seen.append(ids is not None)
        return launch(seqs, ids)

    eng.runner.launch_decode = spy
    return seen


def test_tokens_and_finish_reasons_match_the_plain_scheduler():
    ps = prompts(6)
    plain = run(engine(False), [(p, greedy(n)) for p, n in zip(ps, (1, 2, 5, 9, 17, 30))])
    stop = plain["r5"][0][6]  # a token r5 really produces: stops it (and maybe others) early
    jobs = [(p, greedy(n, stop=[stop])) for p, n in zip(ps, (1, 2, 5, 9, 17, 30))]
    plain = run(engine(False), jobs)
    eng = engine(True)
    launches = counting_launches(eng)
    assert run(eng, jobs) == plain
    assert any(r == "stop" for _, r, _ in plain.values()) and any(r == "length" for _, r, _ in plain.values())
    assert sum(launches) >= 10, f"only {sum(launches)} of {len(launches)} launches were pipelined"


def test_an_abort_and_a_new_request_while_a_step_is_in_flight():
    ps = prompts(5, seed=1)
    jobs = [(p, greedy(24)) for p in ps[:4]]
    late = (ps[4], greedy(6))

    def abort(e):
        assert e._overlap.inflight is not None or not e.plan.scheduler.overlap
        e.abort_request("r1")

    def admit(e):
        e.add_request("late", *late)

    events = {("r1", 5): abort, ("r0", 9): admit}
    plain = run(engine(False), jobs, events)
    assert run(engine(True), jobs, events) == plain
    assert plain["r1"][:2] == (plain["r1"][0][:5], None) and len(plain["late"][0]) == 6


def test_sampled_requests_pipeline_too_and_draw_the_same_tokens():
    """The sampler is seeded per sequence and position, so a sampled token does not depend on when
    the host reads it; stops cut rows at different steps, so rows come and go mid-pipeline."""
    ps = prompts(4, seed=2)
    sampled = [SamplingParams(max_tokens=n, temperature=t, top_p=0.9, seed=7 + i, ignore_eos=True)
               for i, (n, t) in enumerate(((12, 0.8), (5, 1.0), (20, 0.6), (9, 0.0)))]
    jobs = list(zip(ps, sampled))
    eng = engine(True)
    launches = counting_launches(eng)
    assert run(eng, jobs) == run(engine(False), jobs)
    assert sum(launches) >= 8, f"only {sum(launches)} of {len(launches)} launches were pipelined"


def test_log_prob_requests_take_the_plain_path_with_the_same_results():
    ps = prompts(3, seed=2)
    jobs = [(ps[0], greedy(12)), (ps[1], SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)),
            (ps[2], SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True))]
    assert run(engine(True), jobs) == run(engine(False), jobs)


def test_the_context_limit_and_a_full_cache_end_the_pipeline_not_the_tokens():
    """Sequences run into max_model_len, and the cache is too small for all of them at once
    (preemption on the plain path): still the same tokens."""
    ps = [p[:6] for p in prompts(6, seed=3)]
    jobs = [(p, greedy(200)) for p in ps]
    kw = dict(blocks=20, max_model_len=48)
    assert run(engine(True, **kw), jobs) == run(engine(False, **kw), jobs)


def test_blocks_a_pipelined_decode_filled_are_prefix_cache_hits_later():
    """Full blocks of generated tokens enter the prefix cache once their placeholders are read: a
    later request repeating a sequence's prompt and output hits them as on the plain path."""
    p = prompts(1, seed=4)[0][:10]
    first = run(engine(False), [(p, greedy(30))])["r0"][0]
    repeat = p + first[:24]  # 34 tokens: four full 8-token blocks
    results = {}
    for overlap in (False, True):
        eng = engine(overlap)
        run(eng, [(p, greedy(30))])
        results[overlap] = run(eng, [(repeat, greedy(4))])
    assert results[True] == results[False]
    assert results[True]["r0"][2] == 32


def test_the_knob_leaves_existing_plan_hashes_alone():
    assert Plan().hash == Plan.model_validate({"scheduler": {"overlap": False}}).hash
    assert Plan().hash != Plan.model_validate({"scheduler": {"overlap": True}}).hash
    assert "overlap" not in Plan().canonical()["scheduler"]


def test_a_workload_replay_with_overlap_delivers_every_token():
    """The benchmark's workload replay (what the compiler ranks scheduler knobs on) with the knob:
    the same output tokens as without, and nothing left in flight afterwards."""
    from anneal.engine.benchmark import BenchmarkRequest, run_benchmark
    from anneal.engine.traffic import load_traffic

    shape = load_traffic("chat").scaled(60).model_copy(update={"concurrency": 3.0})
    req = BenchmarkRequest(mode="workload", traffic=shape.model_dump(mode="json"), num_requests=6,
                           steps=1, warmup=0)
    got, split = {}, {}
    for overlap in (False, True):
        eng = engine(overlap, max_model_len=128, blocks=256)
        extra = run_benchmark(eng, req).extra
        got[overlap], split[overlap] = extra["output_tokens"], extra["time_split"]
        assert not eng.has_unfinished_requests()
    assert got[True] == got[False] > 0
    assert split[False]["pipelined_steps"] == 0
    assert 0 < split[True]["pipelined_steps"] < split[True]["engine_steps"]  # the report says it engaged
