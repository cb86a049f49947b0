"""The engine's request API on the CPU: bad requests are refused with a clear ValueError and change
nothing; stop conditions, logprobs, the fast tier and the offline helper behave as documented."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 96


@pytest.fixture
def eng() -> Engine:
    return Engine(EngineArgs(model="random:tiny", device="cpu", block_size=8, num_kv_blocks=64,
                             max_model_len=MAX_LEN, seed=5))


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Greedy on a random tiny model mostly repeats a token; the log-probs carry the real signal.
GREEDY_LP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


def drain(eng: Engine, outs=()) -> list[tuple]:
    """Step until idle; (request, token, logprob, top) per generated token."""
    got, batch = [], list(outs)
    while True:
        got += [(o.request_id, t, lp.logprob, tuple(lp.top.items()))
                for o in batch for t, lp in zip(o.new_token_ids, o.new_logprobs)]
        if not eng.has_unfinished_requests():
            return got
        batch = eng.step()


def state(eng: Engine):
    st = dataclasses.asdict(eng.stats())
    return st, {rid: (list(s.token_ids), list(s.block_table)) for rid, s in eng._requests.items()}


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([], "empty"),
        ([5, 512, 7], "512"),  # vocab_size is 512
        ([5, -1, 7], "-1"),
        ([5, 10**12], "vocabulary"),
        ([5, 7.0, 9], "vocabulary"),
        (["7", 9], "vocabulary"),
        ([5] * MAX_LEN, f"{MAX_LEN} tokens"),
        ([5] * (MAX_LEN + 40), "context"),
    ],
    ids=["empty", "vocab_size", "negative", "huge", "float", "string", "max_model_len", "longer"],
)
def test_bad_prompt_is_refused_and_changes_nothing(eng, prompt, message):
    rng = random.Random(1)
    good = rand_prompt(rng, 20)
    eng.add_request("ok", good, GREEDY_LP)
    first = eng.step()  # "ok" holds blocks now
    before = state(eng)
    assert before[0]["num_free_blocks"] < 64
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, GREEDY)
    assert state(eng) == before
    assert "bad" not in eng._requests
    # The request already in flight is untouched, and its output is what it gives alone.
    out = drain(eng, first)
    fresh = Engine(EngineArgs(model="random:tiny", device="cpu", block_size=8, num_kv_blocks=64,
                              max_model_len=MAX_LEN, seed=5))
    fresh.add_request("ok", good, GREEDY_LP)
    assert len(out) == 8 and out == drain(fresh)
    assert eng.stats().num_free_blocks == 64


def test_the_longest_prompt_accepted_gets_one_token(eng):
    rng = random.Random(2)
    out = eng.generate([rand_prompt(rng, MAX_LEN - 1)], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(out[0]) == 1
    assert eng.stats().num_free_blocks == 64


def test_duplicate_request_id_is_refused_and_changes_nothing(eng):
    rng = random.Random(3)
    first = rand_prompt(rng, 12)
    eng.add_request("dup", first, GREEDY)
    eng.step()
    before = state(eng)
    with pytest.raises(ValueError, match="already in flight"):
        eng.add_request("dup", rand_prompt(rng, 30), GREEDY)
    assert state(eng) == before
    out = []
    while eng.has_unfinished_requests():
        out += [o for o in eng.step()]
    assert all(o.request_id == "dup" for o in out)
    assert eng._requests == {}
    # Once finished, the id may be used again.
    eng.add_request("dup", first, GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().num_free_blocks == 64


def test_generate_with_one_bad_prompt_adds_none_of_them(eng):
    rng = random.Random(4)
    before = state(eng)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([rand_prompt(rng, 10), rand_prompt(rng, 5) + [600]], GREEDY)
    assert not eng.has_unfinished_requests()
    assert state(eng) == before
    with pytest.raises(ValueError, match="params"):
        eng.generate([rand_prompt(rng, 10)] * 3, [GREEDY] * 2)
    assert not eng.has_unfinished_requests()


def test_generate_leaves_other_in_flight_requests_alone(eng):
    rng = random.Random(5)
    other, mine = rand_prompt(rng, 15), rand_prompt(rng, 9)
    eng.add_request("other", other, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    seq = eng._requests["other"]
    got = eng.generate([mine], GREEDY)[0]
    assert len(got) == 8
    assert "other" in eng._requests, "generate returns when its own prompts finish"
    while eng.has_unfinished_requests():
        eng.step()
    assert seq.num_output_tokens == 30 and seq.finish_reason == "length"
    assert eng.stats().num_free_blocks == 64


def test_stop_conditions(eng):
    rng = random.Random(6)
    prompt = rand_prompt(rng, 10)
    free_run = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    eng.add_request("s", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    toks = [t for o in outs for t in o.new_token_ids]
    assert toks == free_run[: first + 1], "stops on (and includes) the stop token"
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert all(not o.finished for o in outs[:-1])
    assert outs[-1].num_output_tokens == first + 1 and outs[-1].num_prompt_tokens == 10
    # max_tokens -> "length"
    eng.add_request("l", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == free_run[:3]
    assert outs[-1].finish_reason == "length"
    assert eng.stats().num_free_blocks == 64


def test_eos_stops_unless_ignored():
    # A preset whose EOS is the model's first greedy token for this prompt.
    rng = random.Random(7)
    prompt = rand_prompt(rng, 10)
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", block_size=8, num_kv_blocks=64,
                            max_model_len=MAX_LEN, seed=5))
    first = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0][0]
    eng.config.eos_token_ids = [first]
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out == [first]
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out) == 6 and out[0] == first


def test_logprobs_are_the_log_softmax_of_the_logits(eng):
    rng = random.Random(8)
    prompt = rand_prompt(rng, 14)
    eng.add_request("lp", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    seen = list(prompt)
    ref = Engine(EngineArgs(model="random:tiny", device="cpu", block_size=8, num_kv_blocks=64,
                            max_model_len=MAX_LEN, seed=5))
    from anneal.engine.sequence import Sequence

    for o in outs:
        (lp,) = o.new_logprobs
        s = Sequence("ref", list(seen), GREEDY, seed=1)
        assert ref.blocks.allocate(s)
        logits = ref.runner.prefill_all_logits([(s, len(s))])[-1]
        ref.blocks.free(s)
        want = torch.log_softmax(logits.double(), -1)
        assert lp.token_id == o.new_token_ids[0] == int(want.argmax())
        assert abs(lp.logprob - want[lp.token_id].item()) < 1e-4
        top = want.topk(5)
        assert list(lp.top) == top.indices.tolist()
        assert max(abs(lp.top[i] - v) for i, v in zip(top.indices.tolist(), top.values.tolist())) < 1e-4
        seen += o.new_token_ids


def test_fast_tier_loads_the_first_layers():
    full = Engine(EngineArgs(model="random:tiny", device="cpu", num_kv_blocks=16, max_model_len=64))
    fast = Engine(EngineArgs(model="random:tiny", device="cpu", num_kv_blocks=16, max_model_len=64,
                             layers=2))
    assert full.num_layers == 4 and fast.num_layers == 2
    assert fast.runner.kv.shape[0] == 2
    assert torch.equal(full.weights.layers[1].qkv, fast.weights.layers[1].qkv)
    from anneal.engine.sequence import Sequence

    def logits(e: Engine) -> torch.Tensor:
        s = Sequence("x", [11, 22, 33, 44, 55], GREEDY, seed=1)
        assert e.blocks.allocate(s)
        out = e.runner.prefill_all_logits([(s, len(s))])
        e.blocks.free(s)
        return out

    assert (logits(full) - logits(fast)).abs().max() > 1e-3, "the fast tier ran all layers"


def test_too_few_kv_blocks_for_one_sequence_is_refused():
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(EngineArgs(model="random:tiny", device="cpu", block_size=16, num_kv_blocks=3,
                          max_model_len=64))


def test_invalid_sampling_params_are_refused():
    for bad in (dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5),
                dict(top_k=-1), dict(seed=-3), dict(logprobs=21), dict(unknown=1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_bfloat16_on_the_cpu_runs(eng):
    rng = random.Random(9)
    bf = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="bfloat16", block_size=8,
                           num_kv_blocks=64, max_model_len=MAX_LEN, seed=5))
    assert bf.runner.kv.dtype == torch.bfloat16
    out = bf.generate([rand_prompt(rng, 12)], GREEDY)[0]
    assert len(out) == 8 and all(0 <= t < 512 for t in out)
    with pytest.raises(ValueError, match="unknown dtype"):
        Engine(EngineArgs(model="random:tiny", device="cpu", dtype="float8", num_kv_blocks=16,
                          max_model_len=64))


def test_graph_buckets_above_max_num_seqs_are_not_captured():
    from anneal.engine.llm import graph_sizes
    from anneal.engine.plan import Plan

    plan = Plan(cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128], scheduler={"max_num_seqs": 20})
    assert graph_sizes(plan) == [1, 2, 4, 8, 16, 32]  # 32 holds 20 sequences; 64 and 128 never replay
    assert graph_sizes(plan.model_copy(update={"scheduler": plan.scheduler.model_copy(
        update={"max_num_seqs": 500})})) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_collection_paused_holds_off_gc_and_restores_it():
    """Graph captures and timed steps run with cyclic GC off (a collection mid-capture freed an old
    engine's CUDA graphs on the H200), without a full collection first (120 ms in a server)."""
    import gc

    from anneal.engine.gc_control import collection_paused

    seen: list[int] = []
    record = lambda phase, info: seen.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(record)
    try:
        assert gc.isenabled()
        with pytest.raises(RuntimeError):
            seen.clear()
            with collection_paused():
                assert not gc.isenabled() and 2 not in seen
                raise RuntimeError("a failed capture")
        assert gc.isenabled()
        gc.disable()
        with collection_paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
        gc.callbacks.remove(record)
