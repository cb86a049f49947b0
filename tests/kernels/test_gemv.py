"""Small-M GEMM/GEMV (split-K), fused SiLU-mul + down-proj and fused lm_head + argmax."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.kernels.gemv import add_rmsnorm_linear, rmsnorm_linear, silu_mul_down_proj
from anneal.engine.kernels.lm_head_argmax import lm_head_argmax, norm_lm_head_argmax
from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op, get_op
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, device_configs, gen, randn

SHAPES_CPU = [(1, 70, 130), (3, 33, 200), (17, 50, 64), (40, 20, 37)]  # M, N, K
SHAPES_GPU = [(1, 6144, 4096), (8, 4096, 4096), (32, 28672, 4096), (128, 4096, 14336), (200, 1000, 2048), (3, 1023, 4000)]
PARAMS_CPU = [
    {"split_k": 1, "block_n": 16, "block_k": 64, "max_m": 0, "m1": "fma"},
    {"split_k": 4, "block_n": 32, "block_k": 64, "max_m": 0, "block_m": 16},
    {"split_k": 0, "block_n": 64, "block_k": 64, "block_m": 32, "max_m": 0},
    {"split_k": 4, "block_n": 16, "block_k": 64, "max_m": 0, "reduce": "ticket", "m1": "fma"},
    {"split_k": 2, "block_n": 32, "block_k": 64, "max_m": 0, "reduce": "ticket", "block_m": 16},
    {"split_k": 1, "block_n": 16, "block_k": 64, "max_m": 0, "m1": "fma", "ahead": 2},  # K 37: fewer tiles than ahead
    {"split_k": 2, "block_n": 32, "block_k": 64, "max_m": 0, "m1": "fma", "ahead": 3, "reduce": "ticket"},
    {"split_k": 2, "block_n": 32, "block_k": 64, "max_m": 0, "pdl": "late"},  # a GPU launch option: no-op here
    {"split_k": 2, "block_n": 32, "block_k": 64, "max_m": 0, "pdl": "after_wait", "reduce": "ticket"},
]
PARAMS_GPU = [
    {"max_m": 0},
    {"split_k": 8, "block_n": 32, "block_k": 256, "max_m": 0, "num_warps": 8, "m1": "fma"},
    {"split_k": 1, "block_n": 128, "block_k": 64, "block_m": 64, "max_m": 0, "num_stages": 4},
    {"max_m": 32},
    {"split_k": 4, "max_m": 0, "pdl": True},
    {"split_k": 8, "max_m": 0, "reduce": "ticket", "block_m": 16},
    {"split_k": 4, "max_m": 0, "reduce": "ticket", "pdl": True, "m1": "fma"},
    {"split_k": 8, "block_n": 128, "block_k": 64, "max_m": 0, "reduce": "ticket", "pdl": True, "m1": "fma", "ahead": 2},
    {"split_k": 16, "block_n": 128, "block_k": 64, "max_m": 0, "reduce": "ticket", "pdl": True, "m1": "fma", "ahead": 3},
    {"split_k": 4, "max_m": 0, "reduce": "ticket", "pdl": "late"},  # dependents launched after the main loop
    {"block_n": 32, "block_k": 256, "max_m": 0, "pdl": "late"},
    {"split_k": 8, "block_n": 128, "block_k": 64, "max_m": 0, "reduce": "ticket", "pdl": "late", "m1": "fma", "ahead": 2},
    {"split_k": 4, "max_m": 0, "reduce": "ticket", "pdl": "after_wait"},  # only the next kernel launches early
    {"split_k": 8, "block_n": 128, "block_k": 64, "max_m": 0, "reduce": "ticket", "pdl": "after_wait", "m1": "fma",
     "ahead": 2},
]


@pytest.mark.parametrize("device, pi, params", device_configs(PARAMS_CPU, PARAMS_GPU))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["qkv_proj", "down_proj"])
def test_gemv_splitk(device, pi, params, dtype, op):
    shapes = SHAPES_CPU if device == "cpu" else SHAPES_GPU
    fn = build_op(op, "triton_gemv_splitk", params)
    for i, (M, N, K) in enumerate(shapes):
        g = gen(3000 + 10 * pi + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        assert_close(fn(x, w), get_op(op).reference(x, w), TOL_ACC, what=f"{params} {M}x{N}x{K} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_down_proj(device, dtype):
    shapes = SHAPES_CPU if device == "cpu" else SHAPES_GPU
    for i, (M, N, K) in enumerate(shapes):
        g = gen(3100 + i, device)
        gu = randn(M, 2 * K, dtype=dtype, device=device, g=g, scale=2.0)
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        expected = get_op("down_proj").reference(ref.silu_and_mul(gu), w)
        kw = {"block_k": 64, "split_k": 2, "reduce": ("kernel", "ticket")[i % 2]} if device == "cpu" else {"reduce": ("kernel", "ticket")[i % 2]}
        assert_close(silu_mul_down_proj(gu, w, **kw), expected, TOL_ACC, what=f"{M}x{N}x{K} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_argmax(device, dtype):
    shapes = [(1, 1000, 64), (5, 777, 48), (20, 300, 40)] if device == "cpu" else [(1, 128256, 4096), (32, 151936, 4096), (7, 32000, 2048)]
    for i, (M, V, K) in enumerate(shapes):
        kw = {"block_n": 64, "block_k": 64} if device == "cpu" else {}
        kw["m1"] = ("dot", "fma")[i % 2]
        g = gen(3200 + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        w = randn(V, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        tokens = lm_head_argmax(x, w, **kw)
        logits = get_op("lm_head").reference(x, w)
        expected = logits.argmax(-1)
        assert tokens.dtype == torch.int64 and tokens.shape == (M,)
        # Exact unless accumulation order flips a near-tie: then the chosen logit must be a max too.
        chosen = logits.float().gather(1, tokens[:, None])[:, 0]
        best = logits.float().max(-1).values
        atol = 1e-5 if dtype == torch.float32 else 2e-2 * best.abs().max().item()
        assert torch.all(chosen >= best - atol), (tokens, expected)
        assert (tokens == expected).float().mean().item() >= 0.9


@pytest.mark.parametrize("device", DEVICES)
def test_lm_head_argmax_ties_go_to_lowest_index(device):
    """Duplicate vocabulary rows give exactly equal logits: the lowest id must win, across tiles."""
    g = gen(3300, device)
    K, V = 32, 500
    w = randn(V, K, dtype=torch.float32, device=device, g=g)
    x = randn(3, K, dtype=torch.float32, device=device, g=g)
    top = (x @ w.T).argmax(-1)
    for b in range(3):
        w[top[b] + 1 :: 97] = w[top[b]]  # copies in later tiles ...
        w[(top[b] * 7 + 3) % V] = w[top[b]]  # ... and one anywhere
    expected = get_op("lm_head").reference(x, w).argmax(-1)
    assert torch.equal(lm_head_argmax(x, w, block_n=32, block_k=32), expected)


def test_gemv_rejects_an_unknown_pdl_mode():
    from anneal.engine.kernels._common import KernelInputError
    from anneal.engine.kernels.gemv import small_m_gemm

    with pytest.raises(KernelInputError, match="pdl"):
        small_m_gemm(torch.zeros(2, 8), torch.zeros(4, 8), pdl="early")


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_rejects_mismatched_k(device):
    fn = build_op("o_proj", "triton_gemv_splitk")
    with pytest.raises(ValueError, match="weight\\[N, K\\]"):
        fn(torch.ones(2, 8, device=device), torch.ones(4, 9, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_linear(device, dtype):
    """(add_)rmsnorm in the GEMV prologue == reference (add_)rmsnorm then the projection."""
    shapes = SHAPES_CPU if device == "cpu" else SHAPES_GPU
    lin = get_op("qkv_proj").reference
    for i, (M, N, K) in enumerate(shapes):
        g = gen(3400 + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g, scale=2.0)
        r = randn(M, K, dtype=dtype, device=device, g=g)
        nw = randn(K, dtype=dtype, device=device, g=g)
        w = randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        kw = {"block_k": 64, "split_k": 1 + i % 3, "block_n": 32} if device == "cpu" else {"split_k": 1 + i % 4}
        kw["m1"] = ("dot", "fma")[i % 2]
        y, summed = add_rmsnorm_linear(x, r, nw, 1e-5, w, **kw)
        normed, esummed = ref.add_rmsnorm(x, r, nw, 1e-5)
        assert_close(summed, esummed, what=f"summed {M}x{N}x{K}")
        assert_close(y, lin(normed, w), TOL_ACC, what=f"add_rmsnorm_linear {M}x{N}x{K} {dtype}")
        assert_close(rmsnorm_linear(x, nw, 1e-5, w, **kw), lin(ref.rmsnorm(x, nw, 1e-5), w), TOL_ACC,
                     what=f"rmsnorm_linear {M}x{N}x{K} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_lm_head_argmax(device, dtype):
    """Final (add_)rmsnorm + lm_head + argmax in one kernel == reference norm, lm_head, argmax."""
    shapes = [(1, 500, 64), (6, 333, 40)] if device == "cpu" else [(1, 128256, 2048), (16, 151936, 4096)]
    lm_head = get_op("lm_head").reference
    for i, (M, V, K) in enumerate(shapes):
        g = gen(3500 + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        r = randn(M, K, dtype=dtype, device=device, g=g) if i % 2 == 0 else None
        nw = randn(K, dtype=dtype, device=device, g=g)
        w = randn(V, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        kw = {"block_n": 64, "block_k": 32} if device == "cpu" else {}
        tokens = norm_lm_head_argmax(x, r, nw, 1e-5, w, **kw)
        normed = ref.add_rmsnorm(x, r, nw, 1e-5)[0] if r is not None else ref.rmsnorm(x, nw, 1e-5)
        logits = lm_head(normed, w).float()
        chosen = logits.gather(1, tokens[:, None])[:, 0]
        best = logits.max(-1).values
        atol = 1e-5 if dtype == torch.float32 else 2e-2 * best.abs().max().item()
        assert torch.all(chosen >= best - atol), (tokens, logits.argmax(-1))
        assert (tokens == logits.argmax(-1)).float().mean().item() >= 0.8


def _cos_sin(P: int, D: int, g, device) -> torch.Tensor:
    ang = torch.rand(P, D // 2, generator=g) * 50.0
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_store(device, dtype):
    """qkv GEMV with RoPE + cache store in its epilogue == qkv_proj then qk_rope_store (Llama):
    q returned, rotated k and v in their slots, slot -1 rows not stored, other slots untouched."""
    from anneal.engine.kernels.gemv import qkv_rope_store

    if device == "cpu":
        (H, Hkv, D, K), cases = (4, 2, 16, 48), [(1, {"block_n": 32, "block_k": 16, "m1": "fma", "split_k": 2}),
                                                 (3, {"block_n": 16, "block_k": 32, "split_k": 1}),
                                                 (2, {"block_n": 32, "block_k": 16, "m1": "fma", "split_k": 1})]
    else:
        (H, Hkv, D, K), cases = (32, 8, 64, 2048), [(1, {"block_n": 128, "block_k": 64, "m1": "fma", "pdl": True,
                                                         "ahead": 2}),
                                                    (5, {"block_n": 64, "split_k": 4}),
                                                    (1, {"block_n": 64, "block_k": 128, "m1": "fma", "split_k": 1})]
    nb, bs = 6, 4
    for i, (M, params) in enumerate(cases):
        g = gen(5000 + i, device)
        x = randn(M, K, dtype=dtype, device=device, g=g)
        w = randn((H + 2 * Hkv) * D, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
        cs = _cos_sin(64, D, g, device)
        pos = torch.randint(0, 64, (M,), generator=g).to(device)
        slots = torch.randperm(nb * bs, generator=g)[:M].to(device)
        if M > 1:
            slots[1] = -1  # not stored
        kc = randn(nb, bs, Hkv, D, dtype=dtype, device=device, g=g)
        vc = randn(nb, bs, Hkv, D, dtype=dtype, device=device, g=g)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = qkv_rope_store(x, w, pos, cs, kc, vc, slots, H, Hkv, **params)
        q_ref = ref.qk_rope_store(get_op("qkv_proj").reference(x, w), pos, cs, kc_ref, vc_ref, slots, H, Hkv,
                                  None, None, 1e-6)
        what = f"M={M} {params} {dtype}"
        assert_close(q, q_ref, TOL_ACC, what=f"q {what}")
        assert_close(kc, kc_ref, TOL_ACC, what=f"k cache {what}")
        assert_close(vc, vc_ref, TOL_ACC, what=f"v cache {what}")


def test_qkv_rope_store_rejects_untileable_heads():
    from anneal.engine.kernels._common import KernelInputError
    from anneal.engine.kernels.gemv import qkv_rope_store, rope_fusable

    assert rope_fusable(128, 64, 32, 8) and not rope_fusable(32, 64, 32, 8) and not rope_fusable(128, 64, 32, 1)
    x, w = torch.zeros(1, 8), torch.zeros(3 * 16, 8)
    with pytest.raises(KernelInputError, match="block_n"):
        qkv_rope_store(x, w, torch.zeros(1, dtype=torch.long), torch.zeros(4, 16), torch.zeros(2, 4, 1, 16),
                       torch.zeros(2, 4, 1, 16), torch.zeros(1, dtype=torch.long), 1, 1, block_n=64)


def _projection_and_norm(M: int, N: int, K: int, dtype, device, g):
    """x[M, K], W[N, K], the residual [M, N] and the norm weight [N] of a projection + add_rmsnorm."""
    return (randn(M, K, dtype=dtype, device=device, g=g), randn(N, K, dtype=dtype, device=device, g=g, scale=K ** -0.5),
            randn(M, N, dtype=dtype, device=device, g=g), randn(N, dtype=dtype, device=device, g=g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_add_rmsnorm(device, dtype):
    """o_proj/down_proj GEMV whose last tile to finish does the add_rmsnorm after it == linear then
    add_rmsnorm; every tile size, split and M path, and the counters left ready for the next call."""
    from anneal.engine.kernels.gemv import linear_add_rmsnorm

    if device == "cpu":
        shapes = [(1, 48, 40), (3, 40, 96)]
        params = [{"block_n": 16, "block_k": 16, "m1": "fma", "split_k": 2},
                  {"block_n": 32, "block_k": 32, "split_k": 1}, {"block_n": 16, "block_k": 32, "split_k": 2}]
    else:
        shapes = [(1, 2048, 2048), (1, 2048, 8192), (4, 4096, 4096)]
        params = [{"block_n": 128, "block_k": 64, "m1": "fma", "reduce": "ticket", "pdl": True},
                  {"split_k": 1, "block_n": 64}, {"split_k": 4, "block_n": 32, "pdl": True}]
    for pi, p in enumerate(params):
        for i, (M, N, K) in enumerate(shapes):
            x, w, r, nw = _projection_and_norm(M, N, K, dtype, device, gen(7000 + 10 * pi + i, device))
            for _ in range(2):  # a second call finds the grid-wide counter reset
                h, summed = linear_add_rmsnorm(x, w, r, nw, 1e-5, **p)
                eh, esummed = ref.add_rmsnorm(get_op("o_proj").reference(x, w), r, nw, 1e-5)
                what = f"{p} {M}x{N}x{K} {dtype}"
                assert_close(summed, esummed, TOL_ACC, what=f"summed {what}")
                assert_close(h, eh, TOL_ACC, what=f"normed {what}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_silu(device, dtype):
    """gate_up GEMV with SiLU-and-mul in its epilogue == gate_up_proj then silu_and_mul, for tiles
    that divide I and tiles that do not, split or not, both M paths."""
    from anneal.engine.kernels.gemv import gate_up_silu

    if device == "cpu":
        shapes = [(1, 40, 48), (3, 36, 32)]  # M, I, K
        params = [{"block_n": 16, "block_k": 16, "m1": "fma", "split_k": 2},
                  {"block_n": 32, "block_k": 32, "split_k": 1}]
    else:
        shapes = [(1, 8192, 2048), (1, 14336, 4096), (5, 1000, 512)]
        params = [{"block_n": 32, "block_k": 256, "split_k": 1, "reduce": "ticket", "pdl": True},
                  {"block_n": 128, "block_k": 64, "m1": "fma", "pdl": True}, {"pdl": "late"}, {"pdl": "after_wait"}]
    for pi, p in enumerate(params):
        for i, (M, I, K) in enumerate(shapes):
            g = gen(8000 + 10 * pi + i, device)
            x = randn(M, K, dtype=dtype, device=device, g=g)
            w = randn(2 * I, K, dtype=dtype, device=device, g=g, scale=K ** -0.5)
            want = ref.silu_and_mul(get_op("gate_up_proj").reference(x, w))
            assert_close(gate_up_silu(x, w, **p), want, TOL_ACC, what=f"{p} {M}x{I}x{K} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_stats_pair(device, dtype):
    """The ``norm_stats`` fusion: o_proj/down_proj adding the residual and leaving each tile's share
    of the rows' sums of squares, then the next GEMV normalising as it loads == linear, add_rmsnorm,
    linear; also into the fused qkv + RoPE and gate_up + SiLU epilogues; bit-identical on a rerun."""
    from anneal.engine.kernels.gemv import gate_up_silu, linear_add_stats, norm_stats_linear, qkv_rope_store

    lin = get_op("o_proj").reference
    if device == "cpu":
        shapes = [(1, 48, 40), (3, 64, 96)]  # M, N (hidden), K (producer input)
        producer = [{"block_n": 16, "block_k": 16, "m1": "fma", "split_k": 2},
                    {"block_n": 32, "block_k": 32, "split_k": 1}]
        consumer = [{"block_n": 16, "block_k": 16, "m1": "fma", "split_k": 2}, {"block_n": 32, "block_k": 16}]
        H, Hkv, D = 2, 1, 16
    else:
        shapes = [(1, 4096, 4096), (12, 2048, 8192), (5, 4096, 14336)]
        producer = [{"block_n": 128, "block_k": 64, "m1": "fma", "reduce": "ticket", "pdl": True},
                    {"split_k": 1, "block_n": 64, "pdl": True}]
        consumer = [{"block_n": 128, "block_k": 64, "m1": "fma", "reduce": "ticket", "pdl": True},
                    {"split_k": 1, "block_n": 32, "block_k": 256, "pdl": True}]
        producer += [{"pdl": "late"}, {"pdl": "after_wait"}]
        consumer += [{"pdl": "late"}, {"pdl": "after_wait"}]
        H, Hkv, D = 16, 8, 128
    for pi, (pp, cp) in enumerate(zip(producer, consumer)):
        for i, (M, N, K) in enumerate(shapes):
            g = gen(9000 + 10 * pi + i, device)
            x, wo, r, nw = _projection_and_norm(M, N, K, dtype, device, g)
            wn = randn(3 * N, N, dtype=dtype, device=device, g=g, scale=N ** -0.5)
            what = f"{pp} / {cp} {M}x{N}x{K} {dtype}"
            summed, ss = linear_add_stats(x, wo, r, **pp)
            normed, esummed = ref.add_rmsnorm(lin(x, wo), r, nw, 1e-5)
            assert_close(summed, esummed, TOL_ACC, what=f"summed {what}")
            assert ss.dtype == torch.float32 and ss.shape[0] == M
            assert_close(ss.sum(1), summed.float().pow(2).sum(1), what=f"sums of squares {what}")
            y = norm_stats_linear(summed, ss, nw, 1e-5, wn, **cp)
            assert_close(y, lin(ref.rmsnorm(summed, nw, 1e-5), wn), TOL_ACC, what=f"normed linear {what}")
            again = linear_add_stats(x, wo, r, **pp)
            assert torch.equal(again[0], summed) and torch.equal(again[1], ss)
            assert torch.equal(norm_stats_linear(*again, nw, 1e-5, wn, **cp), y)
            act = gate_up_silu(summed, wn[: 2 * N], norm_stats=(ss, nw, 1e-5), **cp)
            assert_close(act, ref.silu_and_mul(lin(ref.rmsnorm(summed, nw, 1e-5), wn[: 2 * N])), TOL_ACC,
                         what=f"gate_up_silu {what}")
            if i == 0:  # qkv + RoPE + cache store, the norm from the statistics
                wq = randn((H + 2 * Hkv) * D, N, dtype=dtype, device=device, g=g, scale=N ** -0.5)
                cs = _cos_sin(32, D, g, device)
                pos = torch.randint(0, 32, (M,), generator=g).to(device)
                slots = torch.randperm(8, generator=g)[:M].to(device)
                kc = randn(2, 4, Hkv, D, dtype=dtype, device=device, g=g)
                vc = randn(2, 4, Hkv, D, dtype=dtype, device=device, g=g)
                kc_ref, vc_ref = kc.clone(), vc.clone()
                qp = {**cp, "block_n": D}  # RoPE pairs need whole heads per tile
                q = qkv_rope_store(summed, wq, pos, cs, kc, vc, slots, H, Hkv, norm_stats=(ss, nw, 1e-5), **qp)
                q_ref = ref.qk_rope_store(lin(ref.rmsnorm(summed, nw, 1e-5), wq), pos, cs, kc_ref, vc_ref, slots,
                                          H, Hkv, None, None, 1e-6)
                assert_close(q, q_ref, TOL_ACC, what=f"qkv_rope q {what}")
                assert_close(kc, kc_ref, TOL_ACC, what=f"qkv_rope k cache {what}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_residual_adds_into_the_stream_in_place(device, dtype):
    """o_proj / down_proj under ``folded_norm`` on the Triton GEMV: ``stream += linear(x, w)`` in the
    epilogue of each tile's finishing program (every split count, the kernel reduce turned into the
    ticket, the M == 1 FMA path), the sum rounded as ``add_rmsnorm`` rounds it, written into the
    stream itself; the same bits on a rerun from the same stream."""
    from anneal.engine.kernels._common import KernelInputError
    from anneal.engine.kernels.gemv import linear_residual_

    lin = get_op("o_proj").reference
    if device == "cpu":
        shapes = [(1, 48, 40), (3, 64, 96), (17, 40, 64)]
        configs = [{"block_n": 16, "block_k": 16, "m1": "fma", "split_k": 2}, {"block_n": 32, "block_k": 32, "split_k": 1},
                   {"block_n": 16, "block_k": 32, "split_k": 2, "reduce": "kernel", "block_m": 16}]
    else:
        shapes = [(1, 4096, 4096), (12, 4096, 4096), (16, 4096, 14336), (5, 1000, 3000)]
        configs = [{}, {"split_k": 2, "block_n": 32, "block_k": 256, "reduce": "ticket"},
                   {"split_k": 1, "block_n": 64, "pdl": "late"}, {"m1": "fma", "split_k": 4, "pdl": True}]
    for ci, cfg in enumerate(configs):
        for i, (M, N, K) in enumerate(shapes):
            g = gen(9500 + 10 * ci + i, device)
            x, w, r, _ = _projection_and_norm(M, N, K, dtype, device, g)
            want = (lin(x, w).float() + r.float()).to(dtype)
            stream = r.clone()
            ptr = stream.data_ptr()
            got = linear_residual_(x, w, stream, **cfg)
            what = f"{cfg} {M}x{N}x{K} {dtype}"
            assert got is stream and stream.data_ptr() == ptr, what
            assert_close(stream, want, TOL_ACC, what=what)
            again = r.clone()
            linear_residual_(x, w, again, **cfg)
            assert torch.equal(again, stream), what
    with pytest.raises(KernelInputError, match="residual must be"):
        linear_residual_(x, w, torch.zeros(M, N + 1, dtype=dtype, device=device))
    sq = randn(4, 4, dtype=dtype, device=device, g=gen(1, device))
    with pytest.raises(KernelInputError, match="must not be the input"):
        linear_residual_(sq, randn(4, 4, dtype=dtype, device=device, g=gen(2, device)), sq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_gate_up_silu_scales_rows_by_the_residual_gemv_statistics(device, dtype):
    """folded_norm + gate_up_silu on the Triton GEMV: o_proj adds into the stream and leaves each
    tile's share of its rows' sums of squares; gate_up over W with the norm's weight folded in scales
    each row's gate and up by that row's 1/rms in its SiLU epilogue == the folded SiLU's reference
    (``rms_scaled``, then silu_and_mul); the same bits on a rerun."""
    from anneal.engine.kernels._common import KernelInputError
    from anneal.engine.kernels.gemv import gate_up_silu, linear_residual_

    lin = get_op("o_proj").reference
    if device == "cpu":
        shapes = [(1, 48, 40, 32), (3, 64, 96, 48)]  # M, N (hidden), K (o_proj's input), I
        producer = [{"block_n": 16, "block_k": 16, "m1": "fma", "split_k": 2}, {"block_n": 32, "block_k": 32, "split_k": 1}]
        consumer = [{"block_n": 16, "block_k": 16, "split_k": 2}, {"block_n": 32, "block_k": 16, "m1": "fma"}]
    else:
        shapes = [(1, 4096, 4096, 14336), (12, 4096, 4096, 14336), (16, 2048, 8192, 6000)]
        producer = [{"split_k": 2, "block_n": 32, "block_k": 256, "reduce": "ticket"}, {"split_k": 1, "pdl": True}]
        consumer = [{"block_n": 64, "block_k": 256, "num_warps": 8}, {"split_k": 2, "block_n": 32, "pdl": True}]
    for pi, (pp, cp) in enumerate(zip(producer, consumer)):
        for i, (M, N, K, I) in enumerate(shapes):
            g = gen(9700 + 10 * pi + i, device)
            x, wo, r, _ = _projection_and_norm(M, N, K, dtype, device, g)
            wf = randn(2 * I, N, dtype=dtype, device=device, g=g, scale=N ** -0.5)  # W * norm_w, folded
            what = f"{pp} / {cp} {M}x{N}x{K}x{I} {dtype}"
            stream, ss = linear_residual_(x, wo, r.clone(), stats=True, **pp)
            assert_close(ss.sum(1), stream.float().pow(2).sum(1), what=f"sums of squares {what}")
            act = gate_up_silu(stream, wf, folded_stats=(ss, 1e-5), **cp)
            want = ref.silu_and_mul(ref.rms_scaled(lin(stream, wf), stream, 1e-5))
            assert_close(act, want, TOL_ACC, what=f"folded gate_up_silu {what}")
            assert torch.equal(gate_up_silu(stream, wf, folded_stats=(ss, 1e-5), **cp), act), what
    with pytest.raises(KernelInputError, match="folded_stats scales gate_up_silu"):
        from anneal.engine.kernels.gemv import small_m_gemm
        small_m_gemm(stream, wf, folded_stats=(ss, 1e-5))


def test_norm_stats_rejects_bad_statistics():
    from anneal.engine.kernels._common import KernelInputError
    from anneal.engine.kernels.gemv import linear_add_stats, norm_stats_linear

    x, w, nw = torch.zeros(2, 8), torch.zeros(4, 8), torch.ones(8)
    with pytest.raises(KernelInputError, match="float32"):
        norm_stats_linear(x, torch.zeros(3, 2), nw, 1e-5, w)
    with pytest.raises(KernelInputError, match="residual"):
        linear_add_stats(x, w, torch.zeros(2, 5))


def test_the_host_side_tile_arithmetic_matches_triton():
    """``pow2`` and ``cdiv`` size every launch's grid and blocks; they replace triton's slower
    host helpers and must agree with them everywhere."""
    import triton

    from anneal.engine.kernels._common import cdiv, pow2

    for n in range(0, 300):
        for minimum in (1, 16):
            assert pow2(n, minimum) == max(minimum, triton.next_power_of_2(n)), (n, minimum)
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
