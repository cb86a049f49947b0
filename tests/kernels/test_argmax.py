"""Greedy argmax (Triton) against ``torch.argmax`` on irregular vocabularies, with ties and -inf rows."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.ops import reference as ref
from anneal.engine.ops.registry import build_op
from kernel_testing import DEVICES, DTYPES, gen, poison_, randn


def _shapes(device):
    return [(1, 37), (3, 1000), (2, 4097)] if device == "cpu" else [(1, 128256), (7, 151936), (64, 32000), (3, 4097)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(device, dtype):
    block = 256 if device == "cpu" else 4096
    fn = build_op("argmax", "triton", {"block": block, "pdl": device == "cuda"})
    for i, (B, V) in enumerate(_shapes(device)):
        x = randn(B, V, dtype=dtype, device=device, g=gen(400 + i, device), scale=4.0)
        got = fn(x)
        assert got.dtype == torch.int64 and got.shape == (B,)
        assert torch.equal(got.cpu(), ref.argmax(x).cpu()), f"argmax {B}x{V}"


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_ties_and_edges(device):
    """Ties across tiles and within one go to the lowest index; an all -inf row gives 0."""
    V, block = (1000, 256) if device == "cpu" else (128256, 4096)
    fn = build_op("argmax", "triton", {"block": block})
    x = randn(4, V, dtype=torch.float32, device=device, g=gen(9, device))
    x[0, [V - 1, 3 * block + 5, 2 * block + 1]] = 100.0  # three tiles hold the max: lowest index wins
    x[1, [7, 8]] = 50.0  # a tie inside the first tile
    x[2] = float("-inf")
    x[3, V - 1] = 1e9  # the max in the partial last tile
    got = fn(x).cpu()
    assert got.tolist() == [2 * block + 1, 7, 0, V - 1]
    assert torch.equal(got, ref.argmax(x).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_output_written_each_call(device):
    """Every row's token comes from this call, not a stale buffer; a strided row is read by its stride."""
    fn = build_op("argmax", "triton", {"block": 1024})
    big = randn(3, 3000, dtype=torch.float32, device=device, g=gen(11, device))
    x = big[:, :2500]
    out = fn(x)
    poison_(out)
    assert torch.equal(fn(x).cpu(), ref.argmax(x).cpu())
    with pytest.raises(ValueError, match="logits"):
        fn(big[0])
