"""Weight-only fp8 projections: the quantizer, the GEMV over the e4m3 copy against its plain-PyTorch
reference, the fused GEMVs reading it, and a whole model on an fp8 plan against the reference plan
run on the same (dequantized) weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anneal.engine import fp8_weights as f8
from anneal.engine.kernels import gemv
from anneal.engine.ops.registry import build_op
from anneal.engine.plan import FP8_WEIGHT_IMPL
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, device_configs, gen, randn

SHAPES_CPU = [(1, 70, 130), (3, 33, 200), (17, 50, 64), (70, 20, 37)]  # M, N, K; 70 rows: above max_m
SHAPES_GPU = [(1, 6144, 4096), (8, 4096, 4096), (16, 28672, 4096), (1, 4096, 14336), (200, 1000, 2048), (3, 1023, 4000)]
PARAMS_CPU = [
    {"split_k": 1, "block_n": 16, "block_k": 64, "m1": "fma"},
    {"split_k": 4, "block_n": 32, "block_k": 64, "block_m": 16},
    {"split_k": 4, "block_n": 16, "block_k": 64, "reduce": "ticket", "m1": "fma", "ahead": 2},
    {"split_k": 2, "block_n": 32, "block_k": 64, "max_m": 0, "reduce": "ticket", "block_m": 16},
]
PARAMS_GPU = [
    {},
    {"split_k": 8, "block_n": 32, "block_k": 256, "num_warps": 8, "m1": "fma"},
    {"split_k": 4, "block_k": 256, "reduce": "ticket", "pdl": True},
    {"block_n": 128, "block_k": 256, "max_m": 0, "num_stages": 4},
]


def test_quantize_rows_scaled_to_e4m3_range():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 300, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    w[5] = 0.0
    q = f8.quantize(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.data.shape == w.shape and q.scale.shape == (40,)
    amax = q.data.float().abs().amax(dim=1)
    assert torch.equal(amax[torch.arange(40) != 5], torch.full((39,), 448.0))  # each row uses the whole range
    assert q.scale[5] == 1 and not q.data[5].float().any()
    back = f8.dequantized(q, torch.float32)
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself; tiny ones within half a subnormal step
    err = (back - w).abs()
    assert bool((err <= w.abs() * 2 ** -4 + q.scale[:, None] * 2 ** -10).all())
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        f8.quantize(torch.zeros(3))


def test_the_copy_is_kept_on_the_weight_and_dropped():
    w = torch.randn(8, 16)
    q = f8.fp8_of(w)
    assert f8.fp8_of(w) is q and f8.has_fp8(w)
    assert f8.drop([w, torch.randn(2, 2)]) == f8.fp8_bytes(w) == 8 * 16 + 4 * 8
    assert not f8.has_fp8(w) and f8.fp8_of(w) is not q


@pytest.mark.parametrize("device, pi, params", device_configs(PARAMS_CPU, PARAMS_GPU))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["qkv_proj", "down_proj"])
def test_fp8_gemv_matches_its_reference(device, pi, params, dtype, op):
    shapes = SHAPES_CPU if device == "cpu" else SHAPES_GPU
    fn = build_op(op, FP8_WEIGHT_IMPL, params)
    for i, (M, N, K) in enumerate(shapes):
        g = gen(5000 + 10 * pi + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        max_m = params.get("max_m", 64)
        prompt_rows = bool(max_m) and M > max_m  # above max_m (0: never): the bf16 weight through torch's GEMM
        expected = F.linear(x, w) if prompt_rows else f8.reference_linear(x, f8.fp8_of(w))
        assert_close(fn(x, w), expected, TOL_ACC, what=f"{params} {M}x{N}x{K} {dtype}")
        # and it is the fp8 copy that was read: the bf16 GEMV's answer differs by the rounding of W
        if M == 1 and dtype == torch.float32:
            assert not torch.allclose(fn(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_gemvs_read_the_fp8_copy(device, dtype):
    """Each GEMV fusion with ``fp8=True`` equals the same fusion over the dequantized weight (in
    fp32 the two are the same weights; in bf16 they differ by W's rounding to bf16)."""
    kw = {"block_k": 64, "split_k": 2, "reduce": "ticket", "block_n": 32} if device == "cpu" else {"reduce": "ticket"}
    for i, (M, N, K) in enumerate([(1, 64, 96), (5, 96, 64)] if device == "cpu" else [(1, 4096, 4096), (12, 4096, 4096)]):
        g = gen(5100 + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        r = randn(M, K, dtype=dtype, device=device, g=g)
        nw = randn(K, dtype=dtype, device=device, g=g, scale=0.1) + 1
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        wd = f8.dequantized(f8.fp8_of(w), dtype)
        gu = randn(M, 2 * K, dtype=dtype, device=device, g=g)
        wn = randn(K, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)  # o / down: [hidden, hidden]
        wnd = f8.dequantized(f8.fp8_of(wn), dtype)
        cases = {
            "gate_up_silu": (gemv.gate_up_silu(x, w, fp8=True, **kw), gemv.gate_up_silu(x, wd, **kw)),
            "silu_mul_down_proj": (gemv.silu_mul_down_proj(gu, w, fp8=True, **kw), gemv.silu_mul_down_proj(gu, wd, **kw)),
            "add_rmsnorm_linear": (gemv.add_rmsnorm_linear(x, r, nw, 1e-6, w, fp8=True, **kw)[0],
                                   gemv.add_rmsnorm_linear(x, r, nw, 1e-6, wd, **kw)[0]),
            "linear_add_rmsnorm": (gemv.linear_add_rmsnorm(x, wn, r, nw, 1e-6, fp8=True, **kw)[0],
                                   gemv.linear_add_rmsnorm(x, wnd, r, nw, 1e-6, **kw)[0]),
        }
        for name, (got, want) in cases.items():
            assert_close(got, want, TOL_ACC, what=f"{name} {M}x{N}x{K} {dtype}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_plan_generates_as_the_reference_on_the_same_weights(device):
    """A Llama on a fused plan whose four projections read fp8 copies generates what the reference
    plan generates on the dequantized weights (the weights are rounded through e4m3 first, so both
    runs use the same numbers); the copies exist while the plan serves and go with the next plan."""
    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.plan import OpChoice
    from anneal.engine.sampling_params import SamplingParams
    from test_fused_plan import fused_plan

    eng = Engine(EngineArgs(model="random:tiny", device=device, dtype="float32", num_kv_blocks=128, max_model_len=256))
    projections = [(L, name) for L in eng.weights.layers for name in ("qkv", "o", "gate_up", "down")]
    for L, name in projections:
        w = getattr(L, name)
        w.copy_(f8.dequantized(f8.quantize(w), w.dtype))
        assert not f8.has_fp8(w)
    params = SamplingParams(max_tokens=10 if device == "cpu" else 48, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist() for n in (6, 30)]
    ref = eng.generate(prompts, params)
    plan = fused_plan(device, ("norm_stats", "qkv_rope", "gate_up_silu"))
    gemv_params = plan.ops["qkv_proj"].params
    plan = plan.model_copy(update={"ops": {**plan.ops, **{
        op: OpChoice(impl=FP8_WEIGHT_IMPL, params=plan.ops[op].params) for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}}})
    assert plan.ops["qkv_proj"].params == gemv_params
    eng.apply_plan(plan)
    assert all(f8.has_fp8(getattr(L, name)) for L, name in projections)
    got = eng.generate(prompts, params)
    agree = sum(a == b for r, o in zip(ref, got) for a, b in zip(r, o)) / sum(len(r) for r in ref)
    assert agree > 0.98, (agree, ref, got)
    # the next plan's second copies are made only once this one's are gone (an 8B on an H100 has
    # room for one of them beside its KV cache: session 43)
    import anneal.engine.llm as llm_mod
    from test_fused_plan import folded_plan

    fold = llm_mod.fold_norms
    held = []
    llm_mod.fold_norms = lambda w: held.append(any(f8.has_fp8(getattr(L, n)) for L, n in projections)) or fold(w)
    try:
        eng.apply_plan(folded_plan(device))
    finally:
        llm_mod.fold_norms = fold
    assert held == [False]
    assert not any(f8.has_fp8(getattr(L, name)) for L, name in projections)
    assert eng.weights.folded is not None
