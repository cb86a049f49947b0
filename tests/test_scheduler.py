"""Scheduler: continuous batching, chunked prefill, preemption and abort.

Pure-Python tests drive the scheduler with a fake step (the tokens' KV "computed", a new token
appended when a sequence finishes its chunk); the preemption and abort tests also run the real
engine on `random:tiny` on the CPU. No test leaves a block allocated.
"""

from __future__ import annotations

import random

import pytest

from anneal.engine.block_manager import BlockManager
from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.plan import Plan, SchedulerKnobs
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.scheduler import Scheduler
from anneal.engine.sequence import Sequence, Status

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), seed=3)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def fake_step(sched: Scheduler, rng: random.Random) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
    """schedule -> 'run' -> postprocess, as Engine.step does, with random next tokens."""
    batch = sched.schedule()
    finished = []
    for seq, n in batch.items:
        seq.num_computed_tokens += n
        sched.blocks.mark_computed(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(rng.randrange(1, 500))
            if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= sched.max_model_len:
                sched.finish(seq, "length")
                finished.append(seq)
    return batch.items, finished


def scheduler(num_blocks=64, block_size=4, max_model_len=128, **knobs) -> Scheduler:
    return Scheduler(SchedulerKnobs(**knobs), BlockManager(num_blocks, block_size), max_model_len)


def assert_all_free(sched: Scheduler) -> None:
    sched.blocks.check_consistency()
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("mixed", [True, False])
def test_random_workload_respects_budget_and_max_num_seqs(seed, mixed):
    rng = random.Random(seed)
    B, S = 40, 6
    sched = scheduler(num_blocks=80, block_size=4, max_model_len=200,
                      max_num_batched_tokens=B, max_num_seqs=S, mixed_prefill=mixed)
    seqs = [make_seq(f"r{i}", rand_tokens(rng, rng.randrange(1, 90)), rng.randrange(1, 12))
            for i in range(30)]
    done: list[Sequence] = []
    pending = list(seqs)
    steps = 0
    max_batch = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(0, 3)):  # arrivals while running
            if pending:
                sched.add(pending.pop(0))
        items, finished = fake_step(sched, rng)
        done += finished
        steps += 1
        assert steps < 2000
        assert sum(n for _, n in items) <= B
        assert len(items) <= S and len(sched.running) <= S
        assert len({id(s) for s, _ in items}) == len(items)
        for s, n in items:
            assert 1 <= n and s.num_computed_tokens <= len(s)
        max_batch = max(max_batch, sum(n for _, n in items))
        sched.blocks.check_consistency()
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in done)
    assert max_batch == B, "the budget was never filled: the test did not load the scheduler"
    assert_all_free(sched)


@pytest.mark.parametrize("seed", [3, 4, 5])
@pytest.mark.parametrize("mixed", [True, False])
def test_random_workload_under_block_pressure_preempts_and_completes(seed, mixed):
    """Few blocks, shared prefixes, arrivals and aborts: every request still finishes with its
    tokens, preemptions happen, the budget holds and no block leaks."""
    rng = random.Random(seed)
    B = 24
    sched = scheduler(num_blocks=14, block_size=4, max_model_len=48,
                      max_num_batched_tokens=B, max_num_seqs=8, mixed_prefill=mixed)
    shared = rand_tokens(rng, 16)
    seqs = []
    for i in range(24):
        p = shared[: rng.randrange(0, 17)] + rand_tokens(rng, rng.randrange(1, 14))
        seqs.append(make_seq(f"r{i}", p, rng.randrange(1, 48 - len(p))))
    pending, done, aborted = list(seqs), [], set()
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        if rng.random() < 0.03 and (sched.running or sched.waiting):
            victim = rng.choice(list(sched.running) + list(sched.waiting))
            assert sched.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
        items, finished = fake_step(sched, rng)
        done += finished
        steps += 1
        assert steps < 3000, "no progress"
        assert sum(n for _, n in items) <= B and len(items) <= 8
        for s, _ in items:
            assert s.is_finished or (s.status is Status.RUNNING and s.block_table)
            assert not s.is_finished or not s.block_table
        sched.blocks.check_consistency()
        held = set().union(*(s.block_table for s in sched.running))  # waiting ones hold none
        assert all(not s.block_table for s in sched.waiting)
        assert len(held) == sched.blocks.num_blocks - sched.blocks.num_free_blocks
    assert sched.num_preemptions > 0, "no block pressure: the test is too easy"
    assert {s.request_id for s in done} | aborted == {s.request_id for s in seqs}
    for s in done:
        assert s.num_output_tokens == s.params.max_tokens
    assert_all_free(sched)


def test_unmixed_steps_hold_decodes_or_prefills_and_alternate():
    """mixed_prefill=False: no step holds both decodes and prefill chunks (decodes keep the graph
    path); while both kinds have work the steps alternate, so a stream of arrivals never stalls
    the decodes and the decodes never stall admission."""
    rng = random.Random(21)
    sched = scheduler(num_blocks=200, block_size=4, max_model_len=200, max_num_batched_tokens=16,
                      max_num_seqs=8, mixed_prefill=False)
    seqs = [make_seq(f"r{i}", rand_tokens(rng, rng.randrange(10, 40)), 12) for i in range(12)]
    pending, done, kinds = list(seqs), [], []
    while pending or sched.has_unfinished():
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        decoding = any(not s.in_prefill for s in sched.running)
        prefill_work = any(s.in_prefill for s in sched.running) or bool(sched.waiting)
        items, finished = fake_step(sched, rng)
        done += finished
        if not items:
            continue
        decode_items = [s for s, n in items if n == 1 and s.num_output_tokens > 1]  # had a token before
        assert not decode_items or len(decode_items) == len(items), "a step mixed decodes and prefill chunks"
        if decoding and prefill_work and kinds:
            assert kinds[-1] != ("decode" if decode_items else "prefill"), "two steps of one kind while both waited"
        kinds.append("decode" if decode_items else "prefill")
        assert len(kinds) < 2000
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in seqs)
    assert {"decode", "prefill"} <= set(kinds)
    assert_all_free(sched)


def test_unmixed_prefill_engine_outputs_equal_mixed():
    """The step mix changes only when tokens are computed, never what they are."""
    rng = random.Random(13)
    prompts = [rand_tokens(rng, rng.randrange(8, 30)) for _ in range(6)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)] * 6
    want = run_with_logprobs(tiny_engine(200, max_num_batched_tokens=24), prompts, params)
    got = run_with_logprobs(tiny_engine(200, max_num_batched_tokens=24, mixed_prefill=False), prompts, params)
    assert_same_outputs(want, got)


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    rng = random.Random(3)
    sched = scheduler(max_num_batched_tokens=32, max_model_len=200)
    s = make_seq("long", rand_tokens(rng, 100), max_tokens=2)
    sched.add(s)
    chunks = []
    while s.num_output_tokens == 0:
        items, _ = fake_step(sched, rng)
        assert [x for x, _ in items] == [s]
        chunks.append(items[0][1])
    assert chunks == [32, 32, 32, 4]
    assert s.num_computed_tokens == 100 and len(s) == 101
    while sched.has_unfinished():
        fake_step(sched, rng)
    assert_all_free(sched)


def test_without_chunked_prefill_a_prompt_runs_whole_and_waits_for_room():
    rng = random.Random(4)
    sched = scheduler(max_num_batched_tokens=64, max_model_len=64, chunked_prefill=False)
    a = make_seq("a", rand_tokens(rng, 10), max_tokens=6)
    sched.add(a)
    fake_step(sched, rng)
    b = make_seq("b", rand_tokens(rng, 60), max_tokens=2)
    sched.add(b)
    items, _ = fake_step(sched, rng)  # a's decode takes 1 token; 63 are left, so b's 60 fit
    assert [(x.request_id, n) for x, n in items] == [("a", 1), ("b", 60)]
    while sched.has_unfinished():
        fake_step(sched, rng)
    assert_all_free(sched)


def test_without_chunked_prefill_waiting_counts_the_prefix_query_once():
    """A prompt that waits for token budget is not allocated and freed every step.

    That would count its prefix-cache query again each step (the hit-rate metric drift detection
    reads) and evict cached blocks to make room for an allocation that is then undone.
    """
    rng = random.Random(5)
    sched = scheduler(num_blocks=64, max_num_batched_tokens=64, max_model_len=64,
                      chunked_prefill=False, max_num_seqs=8)
    decoders = [make_seq(f"d{i}", rand_tokens(rng, 3), max_tokens=8) for i in range(3)]
    for d in decoders:
        sched.add(d)
    fake_step(sched, rng)
    big = make_seq("big", rand_tokens(rng, 63), max_tokens=1)
    sched.add(big)
    waited = 0
    while big.status is Status.WAITING:  # 3 decodes leave 61 < 63 tokens of budget
        fake_step(sched, rng)
        waited += 1
    assert waited >= 5
    while sched.has_unfinished():
        fake_step(sched, rng)
    assert sched.blocks.queried_tokens == 3 * 3 + 63
    assert_all_free(sched)


def test_decodes_are_served_first():
    rng = random.Random(6)
    sched = scheduler(max_num_batched_tokens=32, max_model_len=200)
    a = make_seq("a", rand_tokens(rng, 5), max_tokens=10)
    sched.add(a)
    fake_step(sched, rng)  # a's prefill
    b = make_seq("b", rand_tokens(rng, 80), max_tokens=2)
    c = make_seq("c", rand_tokens(rng, 80), max_tokens=2)
    sched.add(b)
    sched.add(c)
    items, _ = fake_step(sched, rng)
    assert [(s.request_id, n) for s, n in items] == [("a", 1), ("b", 31)]
    items, _ = fake_step(sched, rng)
    # a's decode, then b's running prefill, then c gets what is left
    assert [(s.request_id, n) for s, n in items] == [("a", 1), ("b", 31)]
    items, _ = fake_step(sched, rng)
    assert [(s.request_id, n) for s, n in items] == [("a", 1), ("b", 18), ("c", 13)]
    assert not sched.schedule().decode_only
    while sched.has_unfinished():
        fake_step(sched, rng)
    assert_all_free(sched)


def test_max_num_seqs_caps_running_sequences():
    rng = random.Random(7)
    sched = scheduler(max_num_seqs=3, max_num_batched_tokens=256)
    seqs = [make_seq(f"r{i}", rand_tokens(rng, 4), max_tokens=5) for i in range(8)]
    for s in seqs:
        sched.add(s)
    items, _ = fake_step(sched, rng)
    assert [s.request_id for s, _ in items] == ["r0", "r1", "r2"]
    seen_max = 0
    while sched.has_unfinished():
        items, _ = fake_step(sched, rng)
        assert len(sched.running) <= 3 and len(items) <= 3
        seen_max = max(seen_max, len(items))
    assert seen_max == 3
    assert_all_free(sched)


def test_decode_only_batches_are_recognized():
    rng = random.Random(8)
    sched = scheduler()
    for i in range(3):
        sched.add(make_seq(f"r{i}", rand_tokens(rng, 6), max_tokens=5))
    fake_step(sched, rng)
    batch = sched.schedule()
    assert batch.decode_only and batch.num_tokens == 3 and len(batch) == 3
    for s in list(sched.running):
        sched.finish(s, "abort")
    assert_all_free(sched)


def test_preemption_frees_the_newest_sequence_and_requeues_it_first():
    rng = random.Random(9)
    # 4 blocks of 4 tokens: two sequences of 7 tokens hold 2 blocks each; the next decode
    # step needs a 5th block.
    sched = scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=64)
    old = make_seq("old", rand_tokens(rng, 7), max_tokens=5)
    new = make_seq("new", rand_tokens(rng, 7), max_tokens=5)
    sched.add(old)
    sched.add(new)
    fake_step(sched, rng)  # both prefilled; both now 8 tokens = 2 full blocks
    assert sched.blocks.num_free_blocks == 0
    batch = sched.schedule()  # old's decode fits in its blocks; new's too (token 8 -> pos 7)
    assert len(batch) == 2
    for s, n in batch.items:
        s.num_computed_tokens += n
        sched.blocks.mark_computed(s)
        s.token_ids.append(rng.randrange(1, 500))  # both now 9 tokens: need a third block
    new_blocks = list(new.block_table)
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.items] == ["old"]
    assert new.status is Status.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and new.num_preemptions == 1 and sched.num_preemptions == 1
    assert set(old.block_table) & set(new_blocks), "old did not get the freed block"
    sched.blocks.check_consistency()
    for s, n in batch.items:
        s.num_computed_tokens += n
        sched.blocks.mark_computed(s)
        s.token_ids.append(rng.randrange(1, 500))
    while sched.has_unfinished():
        fake_step(sched, rng)
    assert old.num_output_tokens == 5 and new.num_output_tokens == 5
    assert_all_free(sched)


def test_preemption_picks_the_newest_not_the_next_oldest():
    rng = random.Random(14)
    sched = scheduler(num_blocks=6, block_size=4, max_model_len=16, max_num_batched_tokens=64)
    seqs = [make_seq(name, rand_tokens(rng, 7), max_tokens=6) for name in ("old", "mid", "new")]
    for s in seqs:
        sched.add(s)
    fake_step(sched, rng)  # prefills: 8 tokens = 2 full blocks each, no block left
    fake_step(sched, rng)  # decodes at position 7; now 9 tokens each: each needs a third block
    assert sched.blocks.num_free_blocks == 0
    late = make_seq("late", rand_tokens(rng, 3))
    sched.add(late)
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.items] == ["old", "mid"]
    # The preempted sequence goes back to the head of the queue, ahead of newer arrivals.
    assert [s.request_id for s in sched.waiting] == ["new", "late"]
    assert seqs[2].num_preemptions == 1 and seqs[0].num_preemptions == seqs[1].num_preemptions == 0
    for s in list(sched.running):
        sched.finish(s, "abort")
    sched.abort("new"), sched.abort("late")
    assert_all_free(sched)


def test_abort_frees_blocks_at_once():
    rng = random.Random(10)
    sched = scheduler(num_blocks=32, max_num_batched_tokens=16)
    a = make_seq("a", rand_tokens(rng, 40), max_tokens=4)
    b = make_seq("b", rand_tokens(rng, 10), max_tokens=4)
    sched.add(a)
    sched.add(b)
    fake_step(sched, rng)  # a mid-prefill, b waiting
    assert a.status is Status.RUNNING and sched.blocks.num_free_blocks < 32
    assert sched.abort("a") is a and a.finish_reason == "abort" and a.is_finished
    assert sched.blocks.num_free_blocks == 32
    assert sched.abort("b") is b and not sched.waiting
    assert sched.abort("nope") is None
    assert not sched.has_unfinished()
    assert_all_free(sched)


def test_no_chunked_prefill_needs_budget_for_a_whole_context():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        scheduler(max_model_len=4096, max_num_batched_tokens=2048, chunked_prefill=False)


# ---- through the real engine -----------------------------------------------------------------


def tiny_engine(num_kv_blocks: int, **knobs) -> Engine:
    plan = Plan(scheduler=SchedulerKnobs(**knobs)) if knobs else Plan()
    return Engine(EngineArgs(model="random:tiny", device="cpu", block_size=4,
                             num_kv_blocks=num_kv_blocks, max_model_len=64, plan=plan, seed=7))


def run_with_logprobs(eng: Engine, prompts, params) -> dict[str, list[tuple[int, float, dict]]]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    got: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += [(t, lp.logprob, lp.top) for t, lp in zip(o.new_token_ids, o.new_logprobs)]
    return got


def assert_same_outputs(want, got) -> None:
    assert want.keys() == got.keys()
    for rid in want:
        assert [t for t, _, _ in got[rid]] == [t for t, _, _ in want[rid]], rid
        for (_, a, top_a), (_, b, top_b) in zip(want[rid], got[rid]):
            # Greedy on a random tiny model mostly repeats tokens: the log-probs are the signal.
            assert abs(a - b) < 1e-4, rid
            assert top_a.keys() == top_b.keys()
            assert max(abs(top_a[k] - top_b[k]) for k in top_a) < 1e-4, rid


def test_preemption_recomputes_and_gives_the_same_greedy_outputs():
    rng = random.Random(11)
    prompts = [rand_tokens(rng, rng.randrange(8, 20)) for _ in range(5)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=4)] * 5
    roomy = tiny_engine(200)
    want = run_with_logprobs(roomy, prompts, params)
    assert roomy.stats().num_preemptions == 0

    tight = tiny_engine(16)  # one max_model_len sequence fits; five do not
    got = run_with_logprobs(tight, prompts, params)
    st = tight.stats()
    assert st.num_preemptions > 0, "the test did not exercise preemption"
    assert_same_outputs(want, got)
    assert all(len(g) == 24 for g in got.values())
    assert st.num_free_blocks == st.num_blocks == 16
    tight.blocks.check_consistency()


def test_preemption_keeps_sampled_outputs_too():
    rng = random.Random(12)
    prompts = [rand_tokens(rng, rng.randrange(8, 20)) for _ in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    want = tiny_engine(200).generate(prompts, params)
    tight = tiny_engine(16)
    got = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert got == want
    assert tight.stats().num_free_blocks == 16


def test_engine_abort_frees_blocks_at_once_and_the_rest_completes():
    rng = random.Random(13)
    eng = tiny_engine(64, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": rand_tokens(rng, 20) for i in range(3)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, params)
    r0: list[int] = []
    for _ in range(3):
        r0 += [t for o in eng.step() if o.request_id == "r0" for t in o.new_token_ids]
    st = eng.stats()
    assert st.num_running >= 2 and st.num_free_blocks < 64
    held = {rid: list(eng._requests[rid].block_table) for rid in prompts}
    assert held["r1"] and held["r2"]
    assert eng.abort_request("r1")
    assert not eng.abort_request("r1"), "aborting twice"
    assert eng.stats().num_free_blocks == 64 - len(set(held["r0"]) | set(held["r2"]))
    assert eng.abort_request("r2")
    assert eng.stats().num_free_blocks == 64 - len(held["r0"])
    last = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "r0"
            r0 += o.new_token_ids
            last = o
    assert last.finished and last.finish_reason == "length"
    assert eng.stats().num_free_blocks == 64
    eng.blocks.check_consistency()
    # r0 gives what it gives alone: aborting its neighbours did not disturb it.
    solo = tiny_engine(64, max_num_batched_tokens=16).generate([prompts["r0"]], params)[0]
    assert r0 == solo and len(solo) == 30


def test_a_plan_of_another_tensor_parallel_degree_is_refused_on_apply():
    """The degree is fixed when the engine starts (its weights and cache are split then): a plan
    naming another one used to be served at degree 1 under its name (and hash). Refused, the old
    plan serving."""
    tp2 = Plan(parallelism={"tensor_parallel": 2})
    eng = tiny_engine(64)
    old = eng.plan
    for call in (eng.check_plan, eng.apply_plan):
        with pytest.raises(ValueError, match="tensor_parallel=2: this engine runs at tensor_parallel=1"):
            call(tp2)
    assert eng.plan == old
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0]) == 2


def test_apply_plan_refuses_knobs_that_could_never_admit_a_long_prompt():
    """Without chunked prefill a prompt runs whole, so the budget must cover max_model_len; a
    plan breaking that would leave long prompts waiting forever. The old plan keeps serving."""
    rng = random.Random(15)
    eng = tiny_engine(64)
    old = eng.plan
    bad = Plan(scheduler=SchedulerKnobs(chunked_prefill=False, max_num_batched_tokens=32))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        eng.apply_plan(bad)
    assert eng.plan == old and eng.scheduler.knobs == old.scheduler
    out = eng.generate([rand_tokens(rng, 50)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0]) == 3
    # A non-chunked plan whose budget covers the context is fine.
    good = Plan(scheduler=SchedulerKnobs(chunked_prefill=False, max_num_batched_tokens=64))
    eng.apply_plan(good)
    assert eng.scheduler.knobs == good.scheduler
    out = eng.generate([rand_tokens(rng, 60)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0]) == 2 and eng.stats().num_free_blocks == 64
