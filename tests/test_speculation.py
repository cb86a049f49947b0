"""Speculative decoding with the n-gram drafter (engine/speculation.py): the tokens of plain greedy
decoding in fewer steps, on real CPU engines."""

from __future__ import annotations

import random

import pytest

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.ngram_draft import NgramIndex
from anneal.engine.plan import Plan, SchedulerKnobs
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.scheduler import Scheduler
from anneal.engine.sequence import Sequence
from anneal.engine.speculation import BACKGROUND_INDEX_MIN, MAX_BACKOFF, Speculator

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = Plan(scheduler={"speculative_tokens": 4})


def _engine(model: str = "random:tiny", **kw) -> Engine:
    return Engine(EngineArgs(model=model, device="cpu", max_model_len=256, num_kv_blocks=kw.pop("blocks", 160), **kw))


def _requests(seed: int, n: int = 7):
    rng = random.Random(seed)
    prompts = [[rng.randrange(16, 500) for _ in range(rng.randrange(3, 60))] for _ in range(n)]
    # a repeated pattern the model does not continue: drafts rejected first, then its own loop accepted
    prompts[0] = [300, 301, 302] * 6
    params = [SamplingParams(max_tokens=rng.randrange(1, 90), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
def test_the_tokens_of_plain_greedy_decoding_in_fewer_steps(model):
    eng = _engine(model)
    prompts, params = _requests(0)
    plain = eng.generate(prompts, params)
    plain_steps = eng.stats().steps
    eng.apply_plan(SPEC)
    spec = eng.generate(prompts, params)
    st = eng.stats()
    assert spec == plain
    assert [len(o) for o in spec] == [p.max_tokens for p in params]
    assert st.speculative_steps > 0 and 0 < st.accepted_tokens <= st.drafted_tokens
    assert st.steps - plain_steps < plain_steps / 2  # the tiny model loops: most drafts hold
    eng.blocks.check_consistency()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    again = eng.generate(prompts, params)  # prefix-cache hits on the blocks the speculative run hashed
    assert again == plain and eng.blocks.hit_tokens > 0


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
    """The model (its answer planted: it agrees with every draft) accepts three drafts, the first of
    which is a stop token: the request ends on it, and the prefix cache hashes no block holding the
    drafts' KV past the sequence's end."""
    eng = _engine()
    eng.apply_plan(SPEC)
    prompt = [300, 301, 302] * 4  # 12 tokens: with the first output 13, the drafts reach position 15
    (first,) = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    x, y, z = [t for t in (400, 401, 402, 403) if t != first[0]][:3]
    eng.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[x]))
    eng.step()  # the prompt step
    seq = eng._requests["r"]
    assert eng.blocks.append_slots(seq) and seq.num_computed_tokens == len(seq) - 1 == 12
    eng.runner.verify_drafts = lambda items: [[*s.token_ids[len(s) - n + 1:], 17] for s, n in items]
    (out,) = eng._speculator.step(eng, [(seq, 1)], [[x, y, z]])
    assert out.new_token_ids == [x] and out.finished and out.finish_reason == "stop"
    assert "r" not in eng._requests and eng.stats().accepted_tokens == 3
    bs = eng.blocks.block_size
    assert all(len(b.token_ids) == bs for b in eng.blocks.blocks if b.hash is not None)
    eng.blocks.check_consistency()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def _unique_sequence(n: int) -> Sequence:
    return Sequence("r", list(range(100, 100 + n)), SamplingParams(max_tokens=10_000, temperature=0), seed=0)


def test_lookups_back_off_while_nothing_is_drafted_and_resume_after_an_accepted_draft(monkeypatch):
    """Outputs that never repeat their context are looked up at steps 0, 2, 5, 10, 19, 36, ... (skips
    of 1, 2, 4, 8, 16, ..., at most MAX_BACKOFF): the lookups were the knob's whole cost there. An
    accepted draft puts the sequence (and the step) back on every step."""
    sp, seq = Speculator(), _unique_sequence(40)
    looked_at: list[int] = []
    real = NgramIndex.propose
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k: looked_at.append(len(self.tokens)) or real(self, k))
    for step in range(300):
        seq.token_ids.append(1000 + step)  # never seen before: nothing to draft
        assert sp.propose([(seq, 1)], 4, 64, 100_000) is None
    steps = [n - 41 for n in looked_at]
    assert steps[:6] == [0, 2, 5, 10, 19, 36]
    assert max(b - a for a, b in zip(steps, steps[1:])) == MAX_BACKOFF + 1
    sp._state["r"].hit()  # what step() does when a draft is accepted
    sp._steps.hit()
    seq.token_ids += [1000, 1001]  # a suffix seen before: drafted at once
    assert sp.propose([(seq, 1)], 4, 64, 100_000) == [[1002, 1003, 1004, 1005]]


def test_a_long_context_is_indexed_off_the_step_and_drafted_for_once_built():
    sp = Speculator()
    seq = _unique_sequence(BACKGROUND_INDEX_MIN)
    seq.token_ids += [100, 101]  # repeats the context's start
    assert sp.propose([(seq, 1)], 3, 64, 100_000) is None  # the index is still being built
    sp._state["r"].build.result(timeout=30)
    sp._steps.hit()  # the step that drafted nothing while it was built backed off
    assert sp.propose([(seq, 1)], 3, 64, 100_000) == [[102, 103, 104]]
    sp.forget("r")
    assert "r" not in sp._state


def test_a_step_where_no_sequence_drafts_skips_the_lookups_of_every_sequence(monkeypatch):
    """With nothing drafted anywhere, whole steps skip the per-sequence loop (its cost on the H100's host:
    3-5% of the 8B's replays); a sequence's own backoff runs on the same clock, so the two do not
    compound."""
    sp = Speculator()
    seqs = [_unique_sequence(40) for _ in range(3)]
    for i, s in enumerate(seqs):
        s.request_id = f"r{i}"
    looked: list[int] = []
    real = NgramIndex.propose
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k: looked.append(1) or real(self, k))
    for step in range(200):
        for i, s in enumerate(seqs):
            s.token_ids.append(10_000 * (i + 1) + step)
        assert sp.propose([(s, 1) for s in seqs], 4, 64, 100_000) is None
    # steps 0, 2, 5, 10, 19, 36, 69, 134, 199: the skips double to MAX_BACKOFF, each sequence looked up once
    assert len(looked) == 3 * 9 and sp._steps.backoff == MAX_BACKOFF == 64


def test_sampled_and_logprob_requests_are_never_drafted_for():
    eng = _engine()
    eng.apply_plan(SPEC)
    prompts, _ = _requests(1, n=3)
    sampled = [SamplingParams(max_tokens=20, temperature=0.8, seed=i) for i in range(3)]
    eng.generate(prompts, sampled)
    eng.generate(prompts, [SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)] * 3)
    assert eng.stats().speculative_steps == 0


def test_drafts_without_a_free_block_are_dropped_not_preempting():
    """Drafts that need a block when none is free are not checked; the step still decodes the
    sequence's next token, and nothing is preempted for them."""
    eng = _engine()
    eng.apply_plan(SPEC)
    prompt = [300, 301, 302] * 5  # 15 tokens: with the first output its one block is full
    (want,) = eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    seq = eng._requests["r"]
    bs = eng.blocks.block_size
    hog = Sequence("hog", [5] * (eng.blocks.num_free_blocks * bs), SamplingParams(), seed=0)
    assert eng.blocks.allocate(hog) and eng.blocks.num_free_blocks == 0
    assert eng.blocks.append_slots(seq) and len(seq.block_table) == 1
    before = eng.stats()
    (out,) = eng._speculator.step(eng, [(seq, 1)], [[7, 8]])
    assert out.new_token_ids == [want[1]] and not out.finished
    st = eng.stats()
    assert st.drafted_tokens == before.drafted_tokens and st.num_preemptions == before.num_preemptions
    assert len(seq.block_table) == 1 and st.speculative_steps == before.speculative_steps + 1
    eng.blocks.free(hog)
    eng.abort_request("r")
    eng.blocks.check_consistency()


def test_speculation_and_overlap_are_refused_together():
    with pytest.raises(ValueError, match="speculative_tokens and overlap"):
        Scheduler.check_knobs(SchedulerKnobs(speculative_tokens=2, overlap=True), 256)
    eng = _engine()
    with pytest.raises(ValueError, match="speculative_tokens and overlap"):
        eng.apply_plan(Plan(scheduler={"speculative_tokens": 2, "overlap": True}))
    assert eng.plan == Plan()  # the old plan keeps serving


def test_the_knob_leaves_older_plans_hashes_alone():
    assert Plan(scheduler={"speculative_tokens": 0}).hash == Plan().hash
    assert SPEC.hash != Plan().hash


def test_degree_two_checks_the_drafts_on_every_rank():
    """Each rank runs the check on its shard of heads and its slice of the logits' rows: the tokens
    are degree one's."""
    prompts, params = _requests(3, n=4)
    one = _engine()
    plain = one.generate(prompts, params)
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=256, num_kv_blocks=160,
                            plan=Plan(parallelism={"tensor_parallel": 2}, scheduler={"speculative_tokens": 3})))
    try:
        assert eng.generate(prompts, params) == plain
        assert eng.stats().accepted_tokens > 0
    finally:
        eng.close()
