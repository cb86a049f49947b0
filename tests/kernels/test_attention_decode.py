"""Paged split-K decode attention against the reference: GQA groups, irregular lengths, params."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, device_configs, gen, randn
from paged import paged_cache

CASES_CPU = [  # context_lens, H, Hkv, D, block_size
    ([1, 37, 16, 70], 6, 2, 24, 5),
    ([9, 0, 64], 4, 4, 16, 16),
    ([130], 8, 1, 32, 16),
]
CASES_GPU = [
    ([1, 1000, 333, 4097, 2048, 17], 32, 8, 128, 16),
    ([8192] * 3 + [5], 32, 8, 64, 16),
    ([700, 1, 129], 28, 4, 128, 32),
    ([0, 12, 1025], 16, 16, 96, 16),
]
PARAMS_CPU = [
    {"split_k": 1, "block_n": 16},
    {"split_k": 4, "block_n": 16},
    {"split_k": 0, "block_n": 32, "pv_precision": "tf32"},
    {"split_k": 8, "block_n": 16, "merge": "ticket"},
    {"split_k": 4, "block_n": 16, "prefetch": 16},
    {"split_k": 1, "block_n": 16, "prefetch": 2},
]
PARAMS_GPU = [
    {"split_k": 1},
    {"split_k": 8, "block_n": 32},
    {"split_k": 0, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"split_k": 64, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"split_k": 4, "block_n": 64, "num_stages": 5},  # K/V double-buffered (Triton 3.6)
    {"split_k": 0, "block_n": 32, "num_stages": 7, "merge": "ticket"},  # triple-buffered
    {"split_k": 4, "pdl": True},
    {"split_k": 16, "merge": "ticket", "pv_precision": "tf32"},
    {"split_k": 0, "merge": "ticket", "pdl": True},
    {"split_k": 0, "pdl": True, "prefetch": 16},
    {"split_k": 1, "block_n": 32, "pdl": True, "prefetch": 4},
    {"split_k": 8, "merge": "ticket", "pdl": True, "prefetch": 16},
    {"split_k": 0, "pdl": "late"},  # the merge launched once the K/V loops are done
    {"split_k": 4, "merge": "ticket", "pdl": "late", "prefetch": 16},
    {"split_k": 0, "pdl": "after_wait"},  # only the merge launches while the split kernel runs
    {"split_k": 4, "merge": "ticket", "pdl": "after_wait", "prefetch": 16},
]


@pytest.mark.parametrize("device, pi, params", device_configs(PARAMS_CPU, PARAMS_GPU))
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode(device, pi, params, dtype):
    cases = CASES_CPU if device == "cpu" else CASES_GPU
    fn = build_op("attention_decode", "triton_splitk", params)
    for i, (lens, H, Hkv, D, BS) in enumerate(cases):
        g = gen(1000 + 10 * pi + i, device)
        kc, vc, bt, cl = paged_cache(lens, Hkv, D, BS, dtype, device, g)
        q = randn(len(lens), H, D, dtype=dtype, device=device, g=g)
        scale = D ** -0.5
        out = fn(q, kc, vc, bt, cl, scale)
        expected = ref.attention_decode(q, kc, vc, bt, cl, scale)
        assert_close(out, expected, TOL_ACC, what=f"params {params} case {i} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_attention_decode_rejects_int64_tables(device):
    fn = build_op("attention_decode", "triton_splitk")
    kc, vc, bt, cl = paged_cache([3], 1, 16, 4, torch.float32, device, gen(1, device))
    q = torch.ones(1, 1, 16, device=device)
    with pytest.raises(ValueError, match="int32"):
        fn(q, kc, vc, bt.long(), cl, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_decode_cuda_graph(device):
    """Captured once, replayed with new lengths and tables: the grid must not depend on their values."""
    fn = build_op("attention_decode", "triton_splitk", {"split_k": 8, "merge": "ticket"})
    g = gen(5, device)
    kc, vc, bt, cl = paged_cache([100, 3000, 1], 8, 128, 16, torch.bfloat16, device, g)
    q = randn(3, 32, 128, dtype=torch.bfloat16, device=device, g=g)
    fn(q, kc, vc, bt, cl, 0.088)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, kc, vc, bt, cl, 0.088)
    # other tables over the same cache (any blocks but the padding block 0) and other lengths
    bt_b = torch.randint(1, kc.shape[0], bt.shape, generator=g).to(torch.int32).to(device)
    cl_b = torch.tensor([bt.shape[1] * 16, 7, 1500], dtype=torch.int32, device=device)
    for tables, lens in ((bt.clone(), cl.clone()), (bt_b, cl_b)):
        bt.copy_(tables)
        cl.copy_(lens)
        graph.replay()
        assert_close(out, ref.attention_decode(q, kc, vc, tables, lens, 0.088), TOL_ACC)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_decode_clamps_lengths_to_block_table(device):
    """A context length past the block table's capacity reads no memory outside the table: like the
    reference, the kernel attends to the table's last slot and no further."""
    fn = build_op("attention_decode", "triton_splitk", {"split_k": 2, "block_n": 16})
    g = gen(9, device)
    kc, vc, bt, cl = paged_cache([20, 7], 2, 16, 8, torch.float32, device, g)
    cl = cl + torch.tensor([500, 0], dtype=torch.int32, device=device)
    q = randn(2, 4, 16, dtype=torch.float32, device=device, g=g, scale=0.05)
    assert_close(fn(q, kc, vc, bt, cl, 0.25), ref.attention_decode(q, kc, vc, bt, cl, 0.25), TOL_ACC)
