"""A chain of dependent kernels launched with PDL inside a CUDA graph gives the reference's result
(each kernel waits for its predecessor's writes: no race from the early launch). GPU only."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op, get_op
from kernel_testing import TOL_ACC, assert_close, gen, randn


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows,m1", [(4, "dot"), (1, "fma")])
def test_pdl_chain_in_cuda_graph(device, rows, m1):
    """With m1="fma" each GEMV requests its first weight tile before the PDL wait."""
    H, I = 2048, 8192
    g = gen(77, device)
    x = randn(rows, H, dtype=torch.float32, device=device, g=g)
    res = randn(rows, H, dtype=torch.float32, device=device, g=g)
    wn = randn(H, dtype=torch.float32, device=device, g=g)
    wgu = randn(2 * I, H, dtype=torch.float32, device=device, g=g, scale=H ** -0.5)
    wd = randn(H, I, dtype=torch.float32, device=device, g=g, scale=I ** -0.5)
    norm = build_op("add_rmsnorm", "triton", {"pdl": True})
    gate_up = build_op("gate_up_proj", "triton_gemv_splitk", {"pdl": True, "split_k": 2, "m1": m1})
    act = build_op("silu_and_mul", "triton", {"pdl": True})
    down = build_op("down_proj", "triton_gemv_splitk", {"pdl": True, "split_k": 4, "m1": m1,
                                                                  "reduce": "ticket"})

    def layer(h, r):
        for _ in range(8):  # several layers deep: each kernel reads what the previous one wrote
            n, r = norm(h, r, wn, 1e-5)
            h = down(act(gate_up(n, wgu)), wd)
        return h, r

    def ref_layer(h, r):
        for _ in range(8):
            n, r = ref.add_rmsnorm(h, r, wn, 1e-5)
            h = get_op("down_proj").reference(ref.silu_and_mul(get_op("gate_up_proj").reference(n, wgu)), wd)
        return h, r

    layer(x, res)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_r = layer(x, res)
    graph.replay()
    torch.cuda.synchronize()
    exp, exp_r = ref_layer(x, res)
    assert_close(out_r, exp_r, {torch.float32: (1e-3, 1e-3)})
    assert_close(out, exp, {torch.float32: (1e-3, 1e-3)})


@pytest.mark.gpu
@pytest.mark.parametrize("params", [{"split_k": 0}, {"split_k": 1, "block_n": 32}, {"split_k": 8, "merge": "ticket"}])
def test_prefetching_decode_attention_reads_the_token_stored_just_before_it(params):
    """Decode attention with ``prefetch`` requests its first K/V tile before the PDL wait; the
    step's own token, stored by the kernel just before it in the same graph, must still be read
    after the wait. Its key is made loud (scaled up) so a stale slot changes the output."""
    from paged import paged_cache

    H, Hkv, D, BS = 32, 8, 128, 16
    lens = [1, 300, 1025, 64, 16, 17]
    B = len(lens)
    g = gen(91, "cuda")
    kc, vc, bt, cl = paged_cache(lens, Hkv, D, BS, torch.bfloat16, "cuda", g)
    pos = (cl - 1).long()
    slots = bt[torch.arange(B, device="cuda"), pos // BS].long() * BS + pos % BS
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.arange(2048, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).cuda()
    qkv = torch.empty(B, (H + 2 * Hkv) * D, dtype=torch.bfloat16, device="cuda")
    rope = build_op("qk_rope_store", "triton", {"pdl": True})
    attn = build_op("attention_decode", "triton_splitk", {**params, "pdl": True, "prefetch": 8})

    def step():
        return attn(rope(qkv, pos, cos_sin, kc, vc, slots, H, Hkv, None, None, 1e-6), kc, vc, bt, cl, D ** -0.5)

    def fresh_inputs(seed):
        x = randn(B, (H + 2 * Hkv) * D, dtype=torch.bfloat16, device="cuda", g=gen(seed, "cuda"))
        x[:, H * D:(H + Hkv) * D] *= 8.0  # the new key dominates its row's scores
        qkv.copy_(x)
        flat_k, flat_v = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
        flat_k[slots] = -7.0  # what a read before the store would see
        flat_v[slots] = -7.0

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (5, 6):
        fresh_inputs(seed)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q_ref = ref.qk_rope_store(qkv, pos, cos_sin, kc_ref, vc_ref, slots, H, Hkv, None, None, 1e-6)
        expected = ref.attention_decode(q_ref, kc_ref, vc_ref, bt, cl, D ** -0.5)
        stale = ref.attention_decode(q_ref, kc, vc, bt, cl, D ** -0.5)  # the slots before the store
        assert (stale.float() - expected.float()).abs().max() > 1.0  # a stale read cannot pass as close
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected, TOL_ACC, what=f"prefetch {params} replay with inputs {seed}")
