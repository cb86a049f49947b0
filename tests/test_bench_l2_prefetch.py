"""bench/l2_prefetch.py: the kernel that streams a weight matrix into L2 reads every element once
(checked against its plain-PyTorch reference under the Triton interpreter on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import l2_prefetch as bench  # noqa: E402


@pytest.mark.parametrize("shape, programs, block", [((1000, 37), 3, 64), ((64, 64), 4, 128), ((5,), 2, 16)])
def test_every_element_is_read_once(shape, programs, block):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(*shape, device=device)
    sink = torch.empty(programs, device=device)
    bench.prefetch(w, sink, programs=programs, block=block)
    torch.testing.assert_close(sink, bench.prefetch_reference(w, programs, block), rtol=1e-4, atol=1e-3)
