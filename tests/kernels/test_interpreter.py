"""The interpreter's language patch, once a launch (``engine/kernels/interpreter.py``): kernels that call
``@triton.jit`` helpers compute the same, without a walk of the language at every helper call."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from anneal.engine.kernels import _common  # noqa: F401 - installs the patch under the interpreter
from anneal.engine.kernels.interpreter import patch_language_once_a_launch
from anneal.engine.ops.registry import interpreting


@triton.jit
def _twice_plus_one(x):
    return x * 2.0 + 1.0


@triton.jit
def _helper_loop_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in range(CALLS):
        x = _twice_plus_one(x)
    tl.store(out_ptr + offs, tl.exp(x * 0.0) * x)


@pytest.mark.parametrize("device", ["cpu"])
def test_helper_calls_compute_the_same_without_walking_the_language_each_time(device, monkeypatch):
    if not interpreting():
        pytest.skip("the patch is the interpreter's")
    assert patch_language_once_a_launch(), "this Triton's interpreter changed: review engine/kernels/interpreter.py"
    from triton.runtime import interpreter

    walks = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, **k: walks.append(1) or real(*a, **k))
    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    counts = {}
    for calls in (1, 6):
        out = torch.full_like(x, float("nan"))
        walks.clear()
        _helper_loop_kernel[(1,)](x, out, N=16, CALLS=calls)
        want = x.clone()
        for _ in range(calls):
            want = want * 2.0 + 1.0
        torch.testing.assert_close(out, want)
        counts[calls] = len(walks)
    assert counts[1] == counts[6] > 0, counts  # the launch's walks only, whatever the helper calls
    # and the language is restored after the launch, as without the patch
    assert tl.core.is_builtin(tl.load)
