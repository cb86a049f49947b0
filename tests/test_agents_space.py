"""The candidate space: read from the engine's declared variants; moves stay inside it."""

from __future__ import annotations

import random

from anneal.engine.plan import OpChoice, Plan
from anneal.agents.space import CandidateSpace
from anneal.agents.types import EngineState

STATE = EngineState(
    model="random:tiny", device="cpu",
    ops={"rmsnorm": ["reference", "triton"], "attention_decode": ["reference", "splitk"], "embedding": ["reference"]},
    variants={
        "rmsnorm": {"reference": {}, "triton": {"block": [64, 128, 256]}},
        "attention_decode": {"reference": {}, "splitk": {"split_k": [1, 2, 4], "block_n": [16, 32]},
                             "cuda_only": {"x": [1, 2]}},
        "embedding": {"reference": {}},
    },
)


def _valid(space: CandidateSpace, plan: Plan) -> None:
    for op, ch in plan.ops.items():
        impls = space.ops[op].impls
        assert ch.impl in impls, (op, ch)
        for name, value in ch.params.items():
            assert value in impls[ch.impl][name], (op, ch)


def test_from_state_reads_declared_params_and_device_usable_impls():
    space = CandidateSpace.from_state(STATE)
    assert set(space.ops) == {"rmsnorm", "attention_decode", "embedding"}
    # "cuda_only" is declared but not listed as usable on this device.
    assert set(space.ops["attention_decode"].impls) == {"reference", "splitk"}
    assert space.ops["attention_decode"].size == 1 + 6
    assert space.tunable_ops() == ["attention_decode", "rmsnorm"]
    assert {tuple(sorted(c.items())) for c in space.ops["rmsnorm"].configs("triton")} == {
        (("block", 64),), (("block", 128),), (("block", 256),)}
    assert not space.uses_graphs


def test_fp8_weights_enter_the_space_only_when_asked():
    """Weight-only fp8 is lossy by design: the search proposes it only under ``--fp8-weights``; bf12
    (bf16 in 12 bits, near-lossless) is always in the space, and verification judges it as any other."""
    impls = ("reference", "triton_gemv_splitk", "triton_gemv_fp8", "triton_gemv_bf12")
    gpu = EngineState(model="random:tiny", device="cuda:0", ops={"o_proj": list(impls)},
                      variants={"o_proj": {i: ({} if i == "reference" else {"block_k": [64, 128]}) for i in impls}})
    assert set(CandidateSpace.from_state(gpu).ops["o_proj"].impls) == set(impls) - {"triton_gemv_fp8"}
    asked = CandidateSpace.from_state(gpu, fp8_weights=True)
    assert set(asked.ops["o_proj"].impls) == set(impls)
    rng = random.Random(1)
    picked = {asked.random_plan(rng).choice("o_proj").impl for _ in range(80)}
    assert {"triton_gemv_fp8", "triton_gemv_bf12"} <= picked


def test_moves_stay_in_the_space_and_explore_it():
    space = CandidateSpace.from_state(STATE)
    rng = random.Random(0)
    seen = set()
    plan = Plan()
    for _ in range(300):
        a = space.random_plan(rng)
        plan = space.mutate(plan, rng)
        child = space.crossover(a, plan, rng)
        for p in (a, plan, child):
            _valid(space, p)
            seen.add(p.hash)
    assert len(seen) > 100  # a search, not a fixed list
    # Mutation changes something most of the time (a plan is not its own neighbour).
    changed = sum(space.mutate(plan, rng).hash != plan.hash for _ in range(50))
    assert changed >= 40


def test_scheduler_grid_respects_token_budget():
    grid = CandidateSpace.from_state(STATE).scheduler_grid()
    assert grid and all(k.max_num_batched_tokens >= k.max_num_seqs for k in grid)
    assert {k.chunked_prefill for k in grid} == {True, False}
    assert {k.mixed_prefill for k in grid} == {True, False}


def test_gpu_space_has_fusions_and_graphs_and_equal_plans_hash_equal():
    gpu = CandidateSpace.from_state(STATE.model_copy(update={"device": "cuda"}))
    from anneal.engine.plan import FUSIONS

    assert gpu.uses_graphs and set(gpu.fusions) == set(FUSIONS)
    assert {"lm_head_argmax", "silu_mul_down", "norm_linear", "qkv_rope"} <= set(FUSIONS)
    rng = random.Random(1)
    for _ in range(100):
        p = gpu.mutate(gpu.random_plan(rng), rng, n=2)
        # What the search hands the engine is exactly what the engine would validate it to.
        assert p == Plan.model_validate(p.model_dump(mode="json"))
        assert all(p.fusions.values())


def test_the_search_never_proposes_fusions_the_engine_refuses_together():
    """folded_norm and the GEMV norm fusions rewrite the same ops, and folded_norm needs o_proj and
    down_proj on a variant that adds its residual in place (cuBLAS, the Triton GEMV; not an agent's
    kernel): no sampled, mutated or crossed plan breaks either rule, and folded_norm is still
    proposed, over the GEMV's residual epilogue too."""
    from anneal.engine.plan import fusion_conflicts

    impls = {"reference": {}, "triton_gemv_bf12": {"block_k": [64, 128]}, "agent_kernel": {"b": [1, 2]}}
    state = STATE.model_copy(update={"device": "cuda", "ops": {**STATE.ops, "o_proj": list(impls),
                                                                 "down_proj": list(impls)},
                                     "variants": {**STATE.variants, "o_proj": impls, "down_proj": impls}})
    gpu = CandidateSpace.from_state(state)
    rng = random.Random(2)
    folded = on_gemv = 0
    for _ in range(300):
        a, b = gpu.random_plan(rng), gpu.random_plan(rng)
        for p in (a, gpu.mutate(a, rng, n=3), gpu.crossover(a, b, rng)):
            assert not fusion_conflicts(p.fusions), p.fusions
            if "folded_norm" in p.fusions:
                folded += 1
                assert "agent_kernel" not in (p.choice("o_proj").impl, p.choice("down_proj").impl), p
                on_gemv += p.choice("o_proj").impl == "triton_gemv_bf12"
    assert folded > 20 and on_gemv > 5


def test_folded_norm_rides_with_weight_copies_of_its_folded_weights():
    """folded_norm's qkv and gate_up may read fp8 / bf12 copies (made of the folded weights,
    engine/weights.py): nothing blocks the pair, and the search proposes it."""
    from anneal.engine.plan import fusion_blockers

    plan = Plan(ops={"qkv_proj": OpChoice(impl="triton_gemv_bf12")}, fusions={"folded_norm": True})
    assert not fusion_blockers(plan)
    impls = {"reference": {}, "triton_gemv_bf12": {"block_k": [64, 128]}}
    state = STATE.model_copy(update={"device": "cuda", "ops": {**STATE.ops, **{p: list(impls) for p in ("qkv_proj", "gate_up_proj")}},
                                     "variants": {**STATE.variants, "qkv_proj": impls, "gate_up_proj": impls}})
    gpu = CandidateSpace.from_state(state)
    rng = random.Random(3)
    both = 0
    for _ in range(300):
        a, b = gpu.random_plan(rng), gpu.random_plan(rng)
        for p in (a, gpu.mutate(a, rng, n=3), gpu.crossover(a, b, rng)):
            on_copy = {p.choice(op).impl for op in ("qkv_proj", "gate_up_proj")} != {"reference"}
            both += "folded_norm" in p.fusions and on_copy
    assert both > 20


def test_without_chunked_prefill_a_step_holds_a_whole_prompt():
    space = CandidateSpace.from_state(STATE.model_copy(update={"max_model_len": 4096}))
    grid = space.scheduler_grid()
    assert all(k.max_num_batched_tokens >= 4096 for k in grid if not k.chunked_prefill)
    assert any(k.max_num_batched_tokens < 4096 for k in grid if k.chunked_prefill)
    rng = random.Random(0)
    knobs = Plan().scheduler
    for _ in range(200):
        knobs = space.mutate_scheduler(knobs, rng)
        assert knobs.chunked_prefill or knobs.max_num_batched_tokens >= 4096


def test_the_scheduler_grid_reaches_past_a_serving_cap_below_the_traffic_concurrency():
    """Concurrency drifted above the serving plan's max_num_seqs: the search must be able to raise it."""
    from anneal.agents.setting import make_setting
    from anneal.engine.plan import Plan
    from anneal.engine.traffic import load_traffic

    state = STATE.model_copy(update={"plan": Plan(scheduler={"max_num_seqs": 2})})
    traffic = load_traffic("chat")  # 16 requests in flight
    setting, _ = make_setting(state, traffic, seed=0, max_len=256, num_requests=4)
    assert max(setting.batch_dist) >= 16
    grid = setting.space.scheduler_grid(limit_seqs=max(setting.batch_dist))
    assert max(k.max_num_seqs for k in grid) >= 16


def test_no_candidate_admits_fewer_sequences_than_twice_the_traffic_concurrency():
    """Session 12 (H200): agentic's compile chose max_num_seqs 8 at its concurrency of 8, no better
    there than 16 (x1.04 both), and on chat (concurrency 16) the plan ran x0.63-0.67 with TTFT p90
    x11. Neither the scheduler grid nor a plan-search move may go below twice the concurrency."""
    from anneal.agents.setting import make_setting
    from anneal.engine.traffic import load_traffic

    for name, conc in (("agentic", 8), ("chat", 16)):
        traffic = load_traffic(name)
        assert traffic.concurrency == conc
        setting, _ = make_setting(STATE, traffic, seed=0, max_len=256, num_requests=4)
        assert min(setting.space.max_num_seqs) == 2 * conc
        grid = setting.space.scheduler_grid(limit_seqs=max(setting.batch_dist))
        assert grid and min(k.max_num_seqs for k in grid) >= 2 * conc
        rng = random.Random(0)
        seqs = {setting.space.mutate_scheduler(Plan().scheduler, rng).max_num_seqs for _ in range(200)}
        assert len(seqs) > 1 and min(seqs) >= 2 * conc  # the plan search's scheduler moves
    huge = load_traffic("chat").model_copy(update={"concurrency": 10_000})  # beyond every value: the largest
    setting, _ = make_setting(STATE, huge, seed=0, max_len=256, num_requests=4)
    assert setting.space.max_num_seqs == (max(setting.space.max_num_seqs),) and setting.space.max_num_seqs[0] == 256


def test_qkv_rope_is_inert_where_the_qkv_tiles_cannot_hold_whole_heads_or_the_model_norms_q_and_k():
    """Session 23: the 8B chat compile kept qkv_rope (x0.989), which on the 8B's 128-wide heads ran
    nothing at the qkv GEMV's default 64-wide tiles; the fused kernels fall back to the unfused ops."""
    from anneal.engine.plan import inert_fusions
    from anneal.engine.presets import PRESETS

    llama_8b, llama_1b, qwen3 = PRESETS["llama-3.1-8b"], PRESETS["llama-3.2-1b"], PRESETS["qwen3-8b"]
    fused = Plan(fusions={"qkv_rope": True, "norm_stats": True})
    assert "block_n 64 cannot tile whole heads of 128" in inert_fusions(fused, llama_8b)["qkv_rope"]
    assert set(inert_fusions(fused, llama_8b)) == {"qkv_rope"}  # norm_stats runs either way
    assert inert_fusions(fused, llama_1b) == {}  # 64-wide heads: one per tile
    wide = fused.with_ops(qkv_proj=OpChoice(impl="triton_gemv_splitk", params={"block_n": 128, "max_m": 64}))
    assert inert_fusions(wide, llama_8b) == {}
    narrow = fused.with_ops(qkv_proj=OpChoice(impl="triton_gemv_splitk", params={"block_n": 32}))
    assert "block_n 32" in inert_fusions(narrow, llama_1b)["qkv_rope"]
    assert "Qwen3" in inert_fusions(wide, qwen3)["qkv_rope"]
    assert inert_fusions(Plan(fusions={"norm_stats": True}), llama_8b) == {}
