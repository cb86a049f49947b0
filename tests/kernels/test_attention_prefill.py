"""Varlen causal prefill attention over the paged cache against the reference."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op
from kernel_testing import DEVICES, DTYPES, TOL_ACC, assert_close, device_configs, gen, randn
from paged import paged_cache

CASES_CPU = [  # [(q_len, context_len)], H, Hkv, D, block_size
    # (4, 70): four whole key tiles before the diagonal, the unmasked loop's case
    ([(5, 5), (1, 30), (0, 7), (19, 40), (4, 70)], 4, 2, 16, 4),
    ([(33, 33)], 3, 1, 24, 16),
]
CASES_GPU = [
    ([(1000, 1000), (1, 77), (513, 2100), (0, 12), (64, 64)], 32, 8, 128, 16),
    ([(2048, 2048), (100, 4000)], 16, 16, 64, 32),
    ([(300, 300), (17, 1500)], 28, 4, 96, 16),
]
PARAMS_CPU = [{"block_m": 16, "block_n": 16}, {"block_m": 32, "block_n": 16, "pv_precision": "tf32"},
              {"block_m": 16, "block_n": 16, "pack_gqa": True}]
PARAMS_GPU = [{}, {"block_m": 128, "block_n": 64, "num_warps": 8}, {"block_m": 16, "block_n": 128, "num_stages": 3},
              {"pdl": True}, {"pv_precision": "tf32"}, {"pack_gqa": True},
              {"pack_gqa": True, "block_m": 128, "num_warps": 8}]


@pytest.mark.parametrize("device, pi, params", device_configs(PARAMS_CPU, PARAMS_GPU))
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill(device, pi, params, dtype):
    cases = CASES_CPU if device == "cpu" else CASES_GPU
    fn = build_op("attention_prefill", "triton", params)
    for i, (seqs, H, Hkv, D, BS) in enumerate(cases):
        g = gen(2000 + 10 * pi + i, device)
        q_lens = [a for a, _ in seqs]
        kc, vc, bt, cl = paged_cache([c for _, c in seqs], Hkv, D, BS, dtype, device, g)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
        q = randn(sum(q_lens), H, D, dtype=dtype, device=device, g=g)
        scale = D ** -0.5
        out = fn(q, kc, vc, bt, cu, cl, max(q_lens), scale)
        expected = ref.attention_prefill(q, kc, vc, bt, cu, cl, max(q_lens), scale)
        assert_close(out, expected, TOL_ACC, what=f"params {params} case {i} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_attention_prefill_rejects_bad_cu_seqlens(device):
    fn = build_op("attention_prefill", "triton")
    kc, vc, bt, cl = paged_cache([3], 1, 16, 4, torch.float32, device, gen(1, device))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fn(torch.ones(3, 1, 16, device=device), kc, vc, bt, torch.tensor([0, 3], device=device), cl, 3, 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_prefill_strided_metadata(device):
    """Metadata handed over as strided views (slices of larger buffers) is read correctly."""
    fn = build_op("attention_prefill", "triton", {"block_m": 16, "block_n": 16})
    g = gen(2100, device)
    kc, vc, bt, cl = paged_cache([12, 30], 2, 16, 4, torch.float32, device, g)
    q = randn(9, 4, 16, dtype=torch.float32, device=device, g=g)
    cu_big = torch.tensor([0, 99, 4, 99, 9, 99], dtype=torch.int32, device=device)
    cl_big = torch.stack([cl, torch.full_like(cl, 77)], dim=1).reshape(-1)
    cu, lens = cu_big[::2], cl_big[::2]
    assert not cu.is_contiguous() and torch.equal(lens, cl)
    assert_close(fn(q, kc, vc, bt, cu, lens, 5, 0.25),
                 ref.attention_prefill(q, kc, vc, bt, cu.contiguous(), cl, 5, 0.25), TOL_ACC)
