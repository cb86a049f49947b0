"""A whole model under a plan of Triton kernels and fusions (norm in the GEMV prologue, SiLU-mul in
the down GEMV, Triton argmax, PDL) generates what the reference plan generates. On the CPU the
kernels run in Triton's interpreter; on a GPU (``-m gpu``) compiled, with CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.plan import OpChoice, Plan
from anneal.engine.sampling_params import SamplingParams


def fused_plan(device: str, fusions: tuple[str, ...]) -> Plan:
    pdl = device == "cuda"
    gemv = {"m1": "fma", "reduce": "ticket", "pdl": pdl, "block_k": 64 if device == "cpu" else 128}
    ops = {op: OpChoice(impl="triton", params={"pdl": pdl})
           for op in ("rmsnorm", "add_rmsnorm", "qk_rope_store", "silu_and_mul", "argmax")}
    ops["attention_decode"] = OpChoice(impl="triton_splitk", params={"merge": "ticket", "pdl": pdl})
    ops["attention_prefill"] = OpChoice(impl="triton")
    for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        ops[op] = OpChoice(impl="triton_gemv_splitk", params=gemv)
    ops["qkv_proj"] = OpChoice(impl="triton_gemv_splitk", params={**gemv, "block_n": 32})  # whole heads per tile
    return Plan(ops=ops, fusions={f: True for f in fusions},
                cuda_graph_batch_sizes=[1, 2, 4] if device == "cuda" else [])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
@pytest.mark.parametrize("fusions", [("norm_linear", "silu_mul_down"), ("qkv_rope", "linear_norm", "gate_up_silu"),
                                     ("norm_stats", "qkv_rope", "gate_up_silu"), ("norm_stats", "silu_mul_down"),
                                     ("norm_stats", "rope_attention", "gate_up_silu")])
def test_fused_plan_generates_as_reference(device, model, fusions, monkeypatch):
    params = SamplingParams(max_tokens=12 if device == "cpu" else 48, temperature=0, ignore_eos=True)
    eng = Engine(EngineArgs(model=model, device=device, dtype="float32", num_kv_blocks=128, max_model_len=256))
    g = torch.Generator().manual_seed(3)
    # 5 + 37 + 70 rows (23 on the CPU: 65, still one past them): a first step above the GEMVs' 64
    # rows (their torch fallback), then decode steps through the fused kernels. Interpreted, each
    # prompt row costs a program of every per-row kernel, so on the CPU only Llama's cases take the
    # third prompt; Qwen3's first step (42 rows) runs the fused kernels instead.
    lengths = {("cpu", "random:tiny-qwen3"): (5, 37), ("cpu", "random:tiny"): (5, 37, 23)}.get(
        (device, model), (5, 37, 70))
    prompts = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    ref = eng.generate(prompts, params)
    from anneal.engine.kernels import gemv

    calls = []
    fused_rope = gemv.qkv_rope_store
    monkeypatch.setattr(gemv, "qkv_rope_store", lambda *a, **k: calls.append(1) or fused_rope(*a, **k))
    silu_calls = []
    fused_silu = gemv.gate_up_silu
    monkeypatch.setattr(gemv, "gate_up_silu", lambda *a, **k: silu_calls.append(1) or fused_silu(*a, **k))
    norm_calls = []
    fused_norm = gemv.linear_add_rmsnorm
    monkeypatch.setattr(gemv, "linear_add_rmsnorm", lambda *a, **k: norm_calls.append(1) or fused_norm(*a, **k))
    stats_calls, stats_used = [], []
    add_stats, small = gemv.linear_add_stats, gemv.small_m_gemm
    monkeypatch.setattr(gemv, "linear_add_stats", lambda *a, **k: stats_calls.append(1) or add_stats(*a, **k))
    monkeypatch.setattr(gemv, "small_m_gemm", lambda *a, **k: stats_used.append(k.get("norm_stats") is not None)
                        or small(*a, **k))
    from anneal.engine.kernels import attention_decode

    rope_attn_calls = []
    rope_attn = attention_decode.rope_decode_attention
    monkeypatch.setattr(attention_decode, "rope_decode_attention",
                        lambda *a, **k: rope_attn_calls.append(1) or rope_attn(*a, **k))
    report = eng.apply_plan(fused_plan(device, fusions))
    assert report is not None
    ops = eng.runner.ops
    if "norm_linear" in fusions:
        assert ops.norm_qkv_proj is not None and ops.silu_mul_down is not None
    if "linear_norm" in fusions:
        assert ops.o_proj_add_rmsnorm is not None and ops.down_proj_add_rmsnorm is not None
    if "gate_up_silu" in fusions:
        assert ops.gate_up_silu is not None
    if "norm_stats" in fusions:
        assert ops.o_proj_add_stats is not None and ops.norm_stats_gate_up is not None
    got = eng.generate(prompts, params)
    if "qkv_rope" in fusions:  # decode rows of Llama take the fused kernel; Qwen3 (q/k norm) never does
        assert bool(calls) == (model == "random:tiny"), len(calls)
    if "linear_norm" in fusions:  # every decode step, both families
        assert norm_calls
    if "gate_up_silu" in fusions:
        assert silu_calls
    if "norm_stats" in fusions:  # every decode step: both producers, and consumers normalising from them
        assert stats_calls and sum(stats_used) >= len(stats_calls)
    # under norm_stats too, the attention rotates and stores what the qkv GEMV normalised
    assert bool(rope_attn_calls) == ("rope_attention" in fusions)
    agree = sum(a == b for r, o in zip(ref, got) for a, b in zip(r, o)) / sum(len(r) for r in ref)
    assert agree > 0.98, (agree, ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu"])  # on the GPU: tests/test_engine_gpu.py (nothing compiles after an apply)
def test_the_prompt_warmup_runs_a_fused_plan_at_every_row_tile(device):
    """The warm-up's steps run the fused GEMVs at every row tile and row class up to 64 rows
    (prompt_warmup.ROW_LADDER) through the kernels, not around them, and store nothing in the
    engine's cache. A pass that failed would fail the apply of a plan that serves fine."""
    from anneal.engine.kernels import gemv
    from anneal.engine.prompt_warmup import prompt_step_layouts

    eng = Engine(EngineArgs(model="random:tiny", device=device, dtype="float32", num_kv_blocks=64, max_model_len=64))
    eng.apply_plan(fused_plan(device, ("norm_stats", "qkv_rope", "gate_up_silu")))
    before = eng.runner.kv.clone()
    rows: list[int] = []
    small = gemv.small_m_gemm
    gemv.small_m_gemm = lambda x, *a, **k: rows.append(x.shape[0]) or small(x, *a, **k)
    try:
        passes = eng.runner.ahead_passes(eng.runner.ops, [], max_seqs=16)
        for p in passes:
            p()
    finally:
        gemv.small_m_gemm = small
    assert len(passes) == len(prompt_step_layouts(64, 16, 0))
    assert {1, 2, 16, 17, 32, 33, 48, 64} <= set(rows)
    assert torch.equal(eng.runner.kv, before)


def folded_plan(device: str) -> Plan:
    """Projections on the reference GEMM (cuBLAS on the GPU), the norms folded around them. On the
    CPU attention stays the reference (the interpreter's Triton attention would cost minutes here and
    is tested on its own)."""
    pdl = device == "cuda"
    ops = {op: OpChoice(impl="triton", params={"pdl": pdl}) for op in ("rmsnorm", "qk_rope_store", "silu_and_mul")}
    if device == "cuda":
        ops["attention_decode"] = OpChoice(impl="triton_splitk", params={"pdl": pdl})
        ops["attention_prefill"] = OpChoice(impl="triton")
    return Plan(ops=ops, fusions={"folded_norm": True}, cuda_graph_batch_sizes=[1, 2, 4] if device == "cuda" else [])


@pytest.mark.parametrize("device,dtype", [("cpu", "float32"), pytest.param("cuda", "float32", marks=pytest.mark.gpu),
                                          pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
def test_folded_norm_plan_passes_verification_without_a_norm_kernel(device, dtype, model):
    """``folded_norm`` passes verification against the reference plan (on the GPU the whole suite:
    quality, poisoned and recycled KV blocks, batch invariance, prefix hits, determinism; on the CPU,
    where each check costs the interpreter ~20-60 s, output quality), and its layers run no
    add_rmsnorm: the residual adds happen in the o / down GEMMs."""
    from anneal.engine.verify import VerifyRequest, verify

    eng = Engine(EngineArgs(model=model, device=device, dtype=dtype, num_kv_blocks=128, max_model_len=256))
    plan = folded_plan(device)
    cpu = device == "cpu"
    rep = verify(eng, VerifyRequest(plan=plan, checks=["quality"] if cpu else None, num_prompts=2 if cpu else 4,
                                    steps=6 if cpu else 24, max_prompt_len=40 if cpu else 120))
    assert rep.passed, [c for c in rep.checks if not c.passed]
    eng.apply_plan(plan)
    assert eng.weights.folded is not None and len(eng.weights.folded) == eng.num_layers
    ops = eng.runner.ops
    adds = []

    def no_norm(*a, **k):
        raise AssertionError("add_rmsnorm ran under folded_norm")

    ops.add_rmsnorm = no_norm
    o_res, down_res = ops.o_proj_residual_, ops.down_proj_residual_
    ops.o_proj_residual_ = lambda *a: adds.append(1) or o_res(*a)
    ops.down_proj_residual_ = lambda *a: adds.append(1) or down_res(*a)
    eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    if device == "cpu":  # on the GPU the decode steps replay graphs captured before the wrap
        assert len(adds) == 4 * 2 * eng.num_layers
    eng.apply_plan(Plan(cuda_graph_batch_sizes=[]))
    assert eng.weights.folded is None, "a plan without the fusion must give its weights back"


def test_the_engine_refuses_folded_norm_beside_a_fusion_of_the_same_ops_or_a_kernel_without_the_residual_add():
    """A plan that enables two fusions of the same ops is refused before anything is swapped: the old
    plan keeps serving. folded_norm adds the residual in o / down, which cuBLAS (beta = 1) and the
    Triton GEMV (its epilogue) do and an agent-written kernel does not: such a plan is blocked."""
    from anneal.engine.ops.registry import OpError
    from anneal.engine.plan import fusion_blockers

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64))
    before = eng.plan.hash
    clash = folded_plan("cpu").model_copy(update={"fusions": {"folded_norm": True, "norm_stats": True}})
    with pytest.raises(OpError, match="folded_norm with norm_stats"):
        eng.apply_plan(clash)
    agent_o = folded_plan("cpu").with_ops(o_proj=OpChoice(impl="agent_o_proj"))
    assert "o_proj must be the reference GEMM or the Triton GEMV" in fusion_blockers(agent_o)["folded_norm"]
    for impl in ("reference", "triton_gemv_splitk", "triton_gemv_bf12", "triton_gemv_fp8"):
        assert not fusion_blockers(folded_plan("cpu").with_ops(o_proj=OpChoice(impl=impl), down_proj=OpChoice(impl=impl)))
    with pytest.raises(OpError):
        eng.apply_plan(agent_o)
    assert eng.plan.hash == before and eng.weights.folded is None
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))


def test_folded_weights_are_given_back_before_the_next_plans_capture_and_restored_when_it_fails(monkeypatch):
    """On the H200 (session 19) a compile's slow tier ran out of memory after a folded_norm
    candidate: its 9 GB of folded weights outlived it while the next plan was captured. A plan
    without the fusion now frees them before its capture; when that capture fails, the old plan
    gets them back and keeps serving."""
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64))
    folded = folded_plan("cpu")
    eng.apply_plan(folded)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = eng.generate([[5, 6, 7]], params)
    held, real = [], eng.runner.capture

    def capture(*a, **k):
        held.append(eng.weights.folded is not None)
        if len(held) == 1:
            raise RuntimeError("capture failed")
        return real(*a, **k)

    monkeypatch.setattr(eng.runner, "capture", capture)
    with pytest.raises(RuntimeError, match="capture failed"):
        eng.apply_plan(Plan(cuda_graph_batch_sizes=[]))
    assert held == [False, True]  # freed for the new plan's capture, back for the old plan's
    assert eng.plan == folded and eng.weights.folded is not None
    assert eng.generate([[5, 6, 7]], params) == want


def folded_gemv_plan(device: str, copies: str | None = None, silu: bool = False) -> Plan:
    """``folded_plan`` with every layer projection on the Triton GEMV (o / down add the residual in its
    epilogue), or with ``copies="bf12"`` on the GEMV over their bf12 copies (qkv / gate_up: copies of
    the folded weights); with ``silu`` also ``gate_up_silu`` (the SiLU and its 1/rms in gate_up's
    epilogue, from o_proj's statistics)."""
    pdl = device == "cuda"
    impl = "triton_gemv_splitk" if copies is None else f"triton_gemv_{copies}"
    tiles = {"reduce": "ticket", "pdl": pdl, "block_k": 64 if device == "cpu" else 256, "block_n": 32}
    split = [{"split_k": 2}, {"split_k": 1}]  # o: the last split adds, down: each tile's one program
    ops = {"qkv_proj": OpChoice(impl=impl, params=tiles), "gate_up_proj": OpChoice(impl=impl, params=tiles),
           "o_proj": OpChoice(impl=impl, params={**tiles, **split[0]}),
           "down_proj": OpChoice(impl=impl, params={**tiles, **split[1]})}
    plan = folded_plan(device).with_ops(**ops)
    return plan.model_copy(update={"fusions": {**plan.fusions, "gate_up_silu": True}}) if silu else plan


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("copies", [None, "bf12"], ids=["bf16", "bf12"])
@pytest.mark.parametrize("silu", [False, True], ids=["", "silu"])
def test_folded_norm_on_gemvs_generates_as_folded_norm_on_cublas(device, copies, silu, monkeypatch):
    """folded_norm with its projections on the Triton GEMV: o / down add the residual into the stream
    in their epilogue (no addmm in decode steps), qkv / gate_up read bf12 copies made of the folded
    weights (not of the layer's own, which keep none), and the plan generates what folded_norm on
    cuBLAS generates on the same weights (bf12: rounded through bf12 first, so both runs use the same
    numbers). With ``gate_up_silu`` beside it the decode steps launch no SiLU kernel: the gate_up
    GEMV scales by the 1/rms o_proj's GEMV left and applies the activation."""
    from anneal.engine import bf12_weights as b12
    from anneal.engine import weight_copies
    from anneal.engine.kernels import activation, gemv

    dtype = "bfloat16" if copies else "float32"
    eng = Engine(EngineArgs(model="random:tiny", device=device, dtype=dtype, num_kv_blocks=128, max_model_len=256))
    if copies:  # the copies stand for exactly these weights; the folded ones are rounded from them
        for L in eng.weights.layers:
            for name in ("o", "down"):
                w = getattr(L, name)
                w.copy_(b12.unpacked(b12.pack(w)).to(w.dtype))
    params = SamplingParams(max_tokens=8 if device == "cpu" else 32, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in (5, 19)]
    eng.apply_plan(folded_plan(device))
    if copies:  # the folded weights as their bf12 copies will hold them
        for F in eng.weights.folded:
            for name in ("qkv", "gate_up"):
                w = getattr(F, name)
                w.copy_(b12.unpacked(b12.pack(w)).to(w.dtype))
    want = eng.generate(prompts, params)
    folded_before = [(F.qkv, F.gate_up) for F in eng.weights.folded]
    added, silu_rows, fused_rows = [], [], []
    real, real_silu, real_fused = gemv.linear_residual_, activation.silu_and_mul, gemv.gate_up_silu
    monkeypatch.setattr(gemv, "linear_residual_", lambda x, w, s, **p: added.append(x.shape[0]) or real(x, w, s, **p))
    monkeypatch.setattr(activation, "silu_and_mul", lambda x, **k: silu_rows.append(x.shape[0]) or real_silu(x, **k))
    monkeypatch.setattr(gemv, "gate_up_silu", lambda x, w, **k: fused_rows.append(x.shape[0]) or real_fused(x, w, **k))
    eng.apply_plan(folded_gemv_plan(device, copies, silu))
    assert [(F.qkv, F.gate_up) for F in eng.weights.folded] == folded_before  # folded once, kept
    if copies:
        assert all(weight_copies.has_copy(t, copies) for F in eng.weights.folded for t in (F.qkv, F.gate_up))
        assert not any(weight_copies.has_copy(t, copies) for L in eng.weights.layers for t in (L.qkv, L.gate_up))
        assert all(weight_copies.has_copy(t, copies) for L in eng.weights.layers for t in (L.o, L.down))
    got = eng.generate(prompts, params)
    agree = sum(a == b for r, o in zip(want, got) for a, b in zip(r, o)) / sum(len(r) for r in want)
    assert agree > (0.9 if copies else 0.98), (agree, want, got)
    if device == "cpu":  # every decode step's o and down (2 a layer) through the GEMV's residual epilogue
        decode_rows = [m for m in added if m <= 2]
        decode_steps = eng.num_layers * (params.max_tokens - 1)
        assert len(decode_rows) == 2 * decode_steps, added
        assert [m for m in silu_rows if m <= 2] == ([] if silu else [2] * decode_steps), silu_rows
        assert [m for m in fused_rows if m <= 2] == ([2] * decode_steps if silu else []), fused_rows
    eng.apply_plan(Plan(cuda_graph_batch_sizes=[]))
    assert eng.weights.folded is None
    assert not any(weight_copies.has_copy(t, copies or "bf12") for L in eng.weights.layers for t in (L.o, L.down))


def test_qkv_and_gate_up_copies_move_to_the_folded_weights_before_they_are_folded(monkeypatch):
    """From a plan with bf12 copies of the layers' qkv / gate_up to folded_norm on bf12 copies: the
    layers' copies are given back before the folded weights are made (an 8B's 6.8 GB of them beside
    its 9 GB of folded weights did not fit an H200's room beside the KV cache), and back again."""
    import anneal.engine.llm as llm_mod
    from anneal.engine import weight_copies

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="bfloat16", num_kv_blocks=32, max_model_len=64))
    flat = folded_gemv_plan("cpu", "bf12").model_copy(update={"fusions": {}})
    eng.apply_plan(flat)
    layers = eng.weights.layers
    assert all(weight_copies.has_copy(t, "bf12") for L in layers for t in (L.qkv, L.gate_up, L.o))
    held, fold = [], llm_mod.fold_norms
    monkeypatch.setattr(llm_mod, "fold_norms", lambda w: held.append(
        [weight_copies.has_copy(t, "bf12") for L in layers for t in (L.qkv, L.gate_up, L.o)]) or fold(w))
    eng.apply_plan(folded_gemv_plan("cpu", "bf12"))
    assert held[0] == [False, False, True] * len(layers)  # o's copy stays: it is the same tensor's
    assert all(weight_copies.has_copy(t, "bf12") for F in eng.weights.folded for t in (F.qkv, F.gate_up))
    eng.apply_plan(flat)
    assert eng.weights.folded is None
    assert all(weight_copies.has_copy(t, "bf12") for L in layers for t in (L.qkv, L.gate_up, L.o))


def rope_attention_plan(device: str, folded: bool) -> Plan:
    """The split-K decode attention doing RoPE + store (``rope_attention``), alone or beside
    ``folded_norm`` (then its 1/rms too); the projections on the reference GEMM."""
    pdl = device == "cuda"
    ops = {op: OpChoice(impl="triton", params={"pdl": pdl}) for op in ("rmsnorm", "qk_rope_store", "silu_and_mul")}
    ops["attention_decode"] = OpChoice(impl="triton_splitk", params={"pdl": pdl} if pdl else {"block_n": 16})
    if device == "cuda":
        ops["attention_prefill"] = OpChoice(impl="triton")
    fusions = {"rope_attention": True, "folded_norm": folded}
    return Plan(ops=ops, fusions=fusions, cuda_graph_batch_sizes=[1, 2, 4] if device == "cuda" else [])


@pytest.mark.parametrize("device,dtype", [("cpu", "float32"), pytest.param("cuda", "float32", marks=pytest.mark.gpu),
                                          pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen3"])
@pytest.mark.parametrize("folded", [False, True], ids=["alone", "folded"])
def test_rope_attention_plan_passes_verification_without_a_rope_kernel_in_decode(device, dtype, model, folded):
    """``rope_attention`` passes verification against the reference plan (GPU: the whole suite, with
    its poisoned and recycled KV blocks; CPU: output quality), and its decode steps launch no
    RoPE kernel: prompt steps still do (their queries go to the prefill attention)."""
    from anneal.engine.kernels import attention_decode, rope
    from anneal.engine.verify import VerifyRequest, verify

    eng = Engine(EngineArgs(model=model, device=device, dtype=dtype, num_kv_blocks=128, max_model_len=256))
    plan = rope_attention_plan(device, folded)
    cpu = device == "cpu"
    rep = verify(eng, VerifyRequest(plan=plan, checks=["quality"] if cpu else None, num_prompts=2 if cpu else 4,
                                    steps=6 if cpu else 24, max_prompt_len=40 if cpu else 120))
    assert rep.passed, [c for c in rep.checks if not c.passed]
    if not cpu:
        return  # decode steps replay graphs captured before any wrap below
    eng.apply_plan(plan)
    calls = {"rope": 0, "fused": 0}
    plain_rope, fused = rope.qk_rope_store, attention_decode.rope_decode_attention

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    rope.qk_rope_store = count("rope", plain_rope)
    attention_decode.rope_decode_attention = count("fused", fused)
    try:
        eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finally:
        rope.qk_rope_store, attention_decode.rope_decode_attention = plain_rope, fused
    assert calls == {"rope": eng.num_layers, "fused": 3 * eng.num_layers}, calls  # 1 prompt step, 3 decode steps


def test_the_engine_refuses_rope_attention_without_the_split_k_attention_or_beside_qkv_rope():
    from anneal.engine.ops.registry import OpError

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64))
    before = eng.plan.hash
    ref_attn = rope_attention_plan("cpu", False).with_ops(attention_decode=OpChoice(impl="reference"))
    with pytest.raises(OpError, match="attention_decode must be triton_splitk, not reference"):
        eng.apply_plan(ref_attn)
    clash = rope_attention_plan("cpu", False).model_copy(update={"fusions": {"rope_attention": True, "qkv_rope": True}})
    with pytest.raises(OpError, match="rope_attention with qkv_rope"):
        eng.apply_plan(clash)
    assert eng.plan.hash == before


@pytest.mark.parametrize("block_n,inert", [(64, True), (32, False)])
def test_a_qkv_rope_whose_tiles_cannot_hold_whole_heads_is_reported_inert_and_runs_unfused(block_n, inert,
                                                                                        monkeypatch):
    """random:tiny has 16-wide heads, 2 of them kv (32 columns): a 64-wide qkv tile would straddle
    k | v, so the fusion falls back to the unfused ops, and the apply report says so
    (``plan.inert_fusions``, what the compiler's fusion trials now skip); at 32 it runs."""
    from anneal.engine.kernels import gemv

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128))
    calls = []
    fused = gemv.qkv_rope_store
    monkeypatch.setattr(gemv, "qkv_rope_store", lambda *a, **k: calls.append(1) or fused(*a, **k))
    plan = Plan(ops={"qkv_proj": OpChoice(impl="triton_gemv_splitk", params={"block_n": block_n, "block_k": 64})},
                fusions={"qkv_rope": True})
    report = eng.apply_plan(plan)
    assert bool(report.inert_fusions) == inert and (not inert or "qkv_rope" in report.inert_fusions)
    eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert bool(calls) is not inert
