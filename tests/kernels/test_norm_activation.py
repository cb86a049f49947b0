"""RMSNorm, fused add + RMSNorm and SiLU-and-mul against the reference on irregular shapes."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op
from kernel_testing import DEVICES, DTYPES, assert_close, gen, randn


def _shapes(device):
    return [(1, 37), (5, 200), (3, 1000)] if device == "cpu" else [(1, 2048), (7, 4096), (130, 4096), (33, 8192)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(device, dtype):
    fn = build_op("rmsnorm", "triton", {"num_warps": 2, "pdl": device == "cuda"})
    for i, (T, H) in enumerate(_shapes(device)):
        g = gen(i, device)
        x = randn(T, H, dtype=dtype, device=device, g=g, scale=3.0)
        w = randn(H, dtype=dtype, device=device, g=g)
        assert_close(fn(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), what=f"rmsnorm {T}x{H}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm(device, dtype):
    fn = build_op("add_rmsnorm", "triton")
    for i, (T, H) in enumerate(_shapes(device)):
        g = gen(100 + i, device)
        x = randn(T, H, dtype=dtype, device=device, g=g)
        r = randn(T, H, dtype=dtype, device=device, g=g, scale=4.0)
        w = randn(H, dtype=dtype, device=device, g=g)
        x0, r0 = x.clone(), r.clone()
        out, summed = fn(x, r, w, 1e-5)
        eout, esummed = ref.add_rmsnorm(x, r, w, 1e-5)
        assert_close(summed, esummed, what="summed")
        assert_close(out, eout, what="normed")
        assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


@pytest.mark.parametrize("device", DEVICES)
def test_rmsnorm_strided_rows(device):
    """A row-strided view (e.g. a slice of a wider buffer) is read with its stride."""
    fn = build_op("rmsnorm", "triton")
    g = gen(7, device)
    big = randn(6, 300, dtype=torch.float32, device=device, g=g)
    x = big[:, 50:250]
    w = randn(200, dtype=torch.float32, device=device, g=g)
    assert_close(fn(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device, dtype):
    fn = build_op("silu_and_mul", "triton", {"block": 256, "pdl": device == "cuda"})
    shapes = [(1, 2 * 300), (6, 2 * 77)] if device == "cpu" else [(1, 2 * 8192), (37, 2 * 14336)]
    for i, (T, I2) in enumerate(shapes):
        x = randn(T, I2, dtype=dtype, device=device, g=gen(200 + i, device), scale=3.0)
        assert_close(fn(x), ref.silu_and_mul(x), what=f"silu_and_mul {T}x{I2}")


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_reference_rounding_bf16(device):
    """On the GPU (round-to-nearest casts) the elementwise kernels round exactly where the reference
    does, so nearly every bf16 element is bit-identical. The interpreter truncates fp32->bf16 casts,
    so this is checked only compiled."""
    g = gen(300, device)
    x = randn(64, 4096, dtype=torch.bfloat16, device=device, g=g)
    r = randn(64, 4096, dtype=torch.bfloat16, device=device, g=g)
    w = randn(4096, dtype=torch.bfloat16, device=device, g=g)
    out, summed = build_op("add_rmsnorm", "triton")(x, r, w, 1e-6)
    eout, esummed = ref.add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(summed, esummed)
    assert (out != eout).float().mean().item() < 1e-3
    y = randn(64, 2 * 4096, dtype=torch.bfloat16, device=device, g=g)
    assert (build_op("silu_and_mul", "triton")(y) != ref.silu_and_mul(y)).float().mean().item() < 1e-3
