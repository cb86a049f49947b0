"""CUDA graphs of prompt and mixed steps (``Plan.cuda_graph_token_sizes``), on the CPU: the padded
step a token graph captures computes what the eager step computes, steps pick the right bucket, and
the knob leaves older plans' hashes alone. The capture and replay themselves: tests/test_engine_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from anneal.engine.llm import Engine, EngineArgs, graph_shapes
from anneal.engine.plan import Plan
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineArgs(model="random:tiny", device="cpu", num_kv_blocks=128, max_model_len=256, seed=3))


def _mixed_step(eng: Engine, rng: random.Random, prompt_lens: list[int], decode_rows: int):
    """A step as the scheduler builds one: ``decode_rows`` sequences one token past their cached
    prompt, then prompts (of two or more, the last a chunk that stops short of its end, so it
    samples nothing)."""
    V = eng.config.vocab_size
    items = []
    for i in range(decode_rows):
        s = Sequence(f"d{i}", [rng.randrange(V) for _ in range(rng.randint(3, 40))], GREEDY, seed=i)
        assert eng.blocks.allocate(s)
        eng.runner.run([(s, len(s))], decode_only=False)  # its prompt into the cache
        s.num_computed_tokens = len(s)
        s.token_ids.append(rng.randrange(V))
        assert eng.blocks.append_slots(s)
        items.append((s, 1))
    for j, n in enumerate(prompt_lens):
        chunk = len(prompt_lens) > 1 and j == len(prompt_lens) - 1
        s = Sequence(f"p{j}", [rng.randrange(V) for _ in range(n + 5 * chunk)], GREEDY, seed=100 + j)
        assert eng.blocks.allocate(s)
        items.append((s, n))
    return items


@pytest.mark.parametrize("tokens,prompts,decodes", [(64, [17], 0), (64, [9, 20], 5), (128, [40, 33], 12)],
                         ids=["one-prompt", "mixed", "mixed-full-bucket"])
def test_the_padded_token_step_computes_the_eager_steps_logits(engine, tokens, prompts, decodes):
    """The body a token graph captures, run eagerly on its static buffers (the graph's warm-up),
    against the eager varlen step on the same cache: padding rows and padding sequences change no
    real row's logits, the sampled rows come out in the eager step's order, and padding stores
    nothing in the cache."""
    eng, runner = engine, engine.runner
    items = _mixed_step(eng, random.Random(tokens + decodes), prompts, decodes)
    assert sum(n for _, n in items) <= tokens
    max_seqs = 16
    seqs = min(tokens, max_seqs)
    runner._token_max_seqs = max_seqs
    runner._token_bufs = runner._token_buffers(256, min(256, max_seqs))
    kv_before = runner.kv.clone()
    with torch.inference_mode():
        want, _, want_rows = runner.extend(items)
        kv_eager = runner.kv.clone()
        runner.kv.copy_(kv_before)
        rows = runner._fill_token_buffers(items, tokens, seqs)
        out = runner._token_body(tokens, seqs)
    assert rows == want_rows == list(range(len(items) - (len(prompts) > 1)))  # a chunk samples nothing
    got = out["logits"][: len(rows)].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(out["greedy"][: len(rows)], want.argmax(-1))
    assert torch.equal(runner.kv, kv_eager), "the padded step stored what the eager step did not"
    for s, _ in items:
        eng.blocks.free(s)


def test_a_step_replays_the_smallest_token_graph_that_holds_it(engine):
    runner = engine.runner
    saved = dict(runner.token_graphs), runner._token_max_seqs
    try:
        runner.token_graphs.clear()
        runner.token_graphs.update({64: None, 256: None})  # the bucket choice reads only the keys
        runner._token_max_seqs = 8

        def items(*lens):
            return [(Sequence(str(i), [1] * n, GREEDY, seed=i), n) for i, n in enumerate(lens)]

        assert runner.token_bucket(items(10)) == 64
        assert runner.token_bucket(items(64)) == 64
        assert runner.token_bucket(items(60, 5)) == 256
        assert runner.token_bucket(items(257)) is None  # above the largest: eager
        assert runner.token_bucket(items(*[1] * 9)) is None  # more sequences than a step holds
        runner.token_graphs.clear()
        assert runner.token_bucket(items(10)) is None  # no token graphs: every step eager
    finally:
        runner.token_graphs.clear()
        runner.token_graphs.update(saved[0])
        runner._token_max_seqs = saved[1]


def test_a_token_graph_no_faster_than_a_larger_one_is_dropped():
    """Session 15, the 8B on the H200: cuBLAS ran gate_up 2x slower at 448 rows than at 480, so a
    step in the 448 graph ran slower than it would padded to 480."""
    from anneal.engine.runner import no_faster_than_a_larger

    assert no_faster_than_a_larger({64: 1.0, 128: 1.2, 448: 3.0, 480: 2.0, 512: 2.1}) == [448]
    assert no_faster_than_a_larger({32: 1.0, 64: 1.0, 128: 0.9}) == [32, 64]  # launch-bound: the largest holds all
    assert no_faster_than_a_larger({256: 5.0}) == []


def test_token_buckets_above_the_step_budget_are_not_captured():
    plan = Plan(cuda_graph_token_sizes=[1024, 128, 256, 512, 4096],
                scheduler={"max_num_batched_tokens": 300, "max_num_seqs": 20})
    assert graph_shapes(plan)[1:] == (20, [128, 256, 512])  # 512 holds 300 tokens; larger never replay
    assert Plan(cuda_graph_token_sizes=[512, 64, 64]).cuda_graph_token_sizes == [64, 512]
    with pytest.raises(ValueError, match="token sizes"):
        Plan(cuda_graph_token_sizes=[0])


def test_the_token_graph_knob_leaves_older_plans_hashes_alone():
    """Plans hashed before the knob existed (ledgers, CompiledPlans) keep their hash while it holds
    its default; setting it makes another plan."""
    assert Plan().hash == Plan.model_validate({"cuda_graph_token_sizes": []}).hash
    assert "cuda_graph_token_sizes" not in Plan().canonical()
    assert Plan().hash != Plan(cuda_graph_token_sizes=[256]).hash
    assert Plan(cuda_graph_token_sizes=[256]).canonical()["cuda_graph_token_sizes"] == [256]


def test_the_cpu_engine_runs_a_token_graph_plan_eagerly():
    """No GPU, no graphs: the plan applies and serves, every step eager."""
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", num_kv_blocks=64, max_model_len=128, seed=3))
    ref = eng.generate([[5, 6, 7, 8], [9, 10]], GREEDY)
    eng.apply_plan(Plan(cuda_graph_token_sizes=[64, 128]))
    assert not eng.runner.token_graphs
    assert eng.generate([[5, 6, 7, 8], [9, 10]], GREEDY) == ref


def test_the_cost_model_prices_a_token_graph_by_its_padded_rows_and_graph_launches():
    """Replayed, a mixed step's launches cost what a graph's do; its per-token ops run the bucket's
    rows, padding included, while attention and lm_head see only the step's own."""
    from anneal.agents.cost_model import CostModel
    from anneal.agents.types import BenchSpec, EngineState

    cm = CostModel.from_state(EngineState(model="random:llama-3.1-8b", device="cuda", gpu_name="NVIDIA H200",
                                          dtype="bfloat16", num_layers_total=32, num_layers_loaded=32))
    spec = BenchSpec(mode="mixed", batch_size=15, context_len=550, prompt_len=49)  # 64 tokens, 16 sequences
    eager = cm.predict(Plan(), spec)
    exact = cm.predict(Plan(cuda_graph_token_sizes=[64]), spec)
    padded = cm.predict(Plan(cuda_graph_token_sizes=[512]), spec)
    assert exact.ms < eager.ms  # same rows, cheaper launches
    assert padded.per_op_ms["gate_up_proj"] > 2 * exact.per_op_ms["gate_up_proj"]  # 512 rows: compute-bound
    for op in ("attention_prefill", "lm_head"):
        assert padded.per_op_ms[op] == exact.per_op_ms[op]
    # More sequences than the bucket holds (max_num_seqs 8): eager, as the engine runs it.
    few = Plan(cuda_graph_token_sizes=[64], scheduler={"max_num_seqs": 8})
    assert cm.predict(few, spec).ms == pytest.approx(eager.ms)


def test_the_search_moves_token_buckets_and_never_pairs_them_with_the_reference_prefill():
    from anneal.agents.space import TOKEN_GRAPH_SETS, CandidateSpace, normalized
    from anneal.agents.types import EngineState

    state = EngineState(model="random:tiny", device="cuda",
                        ops={"attention_prefill": ["reference", "triton"]},
                        variants={"attention_prefill": {"reference": {}, "triton": {"block_m": [32, 64]}}})
    space = CandidateSpace.from_state(state)
    rng = random.Random(0)
    seen = set()
    plan = Plan.model_validate({"ops": {"attention_prefill": {"impl": "triton"}}})
    for _ in range(200):
        for p in (space.random_plan(rng), plan := space.mutate(plan, rng)):
            seen.add(tuple(p.cuda_graph_token_sizes))
            if p.choice("attention_prefill").impl == "reference":
                assert not p.cuda_graph_token_sizes
    assert seen == set(TOKEN_GRAPH_SETS)
    ref = Plan(cuda_graph_token_sizes=[64])
    assert normalized(ref).cuda_graph_token_sizes == []


def test_compile_ahead_runs_each_token_graph_step_on_its_view(engine):
    """``ahead_passes`` launches what ``capture`` would, token graphs included, on the two-layer
    view with buffers and a cache of its own: the engine's cache stays as it was."""
    runner = engine.runner
    before = runner.kv.clone()
    ran = []
    body = runner._token_body
    runner._token_body = lambda tokens, seqs, **kw: ran.append((tokens, seqs, kw["model"] is not runner.model)) \
        or body(tokens, seqs, **kw)
    try:
        passes = runner.ahead_passes(runner.ops, [1, 2], max_seqs=4, token_sizes=[32, 16])
        for p in passes:
            p()
    finally:
        del runner._token_body
    assert sorted(ran) == [(16, 4, True), (32, 4, True)]  # (and the decode and prompt-step passes)
    assert torch.equal(runner.kv, before)
