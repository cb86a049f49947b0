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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_scaled_by_the_stream_rms(device, dtype):
    """``folded_norm``'s SiLU: the gate/up rows scaled by their residual row's 1/rms first, as
    ``reference.rms_scaled`` then ``silu_and_mul`` do; rows of the stream other than the row's own
    must not leak in (each row has its own scale)."""
    from anneal.engine.kernels import activation

    # The last shapes are prompt steps: each program does several column tiles (tiles_per_program).
    shapes = ([(1, 2 * 300, 37), (6, 2 * 77, 200), (70, 2 * 600, 37)] if device == "cpu"
              else [(1, 2 * 8192, 4096), (37, 2 * 14336, 4096), (3072, 2 * 14336, 4096)])
    for i, (T, I2, hidden) in enumerate(shapes):
        assert (activation.tiles_per_program(T, -(-I2 // 2 // 256), torch.device(device)) > 1) == (i == 2)
        g = gen(250 + i, device)
        gu = randn(T, I2, dtype=dtype, device=device, g=g, scale=3.0)
        stream = randn(T, hidden, dtype=dtype, device=device, g=g, scale=5.0)
        stream[0] *= 40.0  # one row far from the others: a shared scale would show
        got = activation.silu_and_mul(gu, block=256, pdl=device == "cuda", rms_of=stream, rms_eps=1e-5)
        want = ref.silu_and_mul(ref.rms_scaled(gu, stream, 1e-5))
        assert_close(got, want, what=f"silu_and_mul(rms_of) {T}x{I2}, hidden {hidden}")


@pytest.mark.parametrize("device", ["cpu"])
def test_silu_and_mul_rejects_a_stream_of_other_rows(device):
    from anneal.engine.kernels import activation
    from anneal.engine.kernels._common import KernelInputError

    g = gen(260, device)
    with pytest.raises(KernelInputError, match="rms_of must be"):
        activation.silu_and_mul(randn(3, 8, dtype=torch.float32, device=device, g=g),
                                rms_of=randn(2, 16, dtype=torch.float32, device=device, g=g))
