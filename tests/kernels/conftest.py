"""Kernel tests: on the CPU through Triton's interpreter, on CUDA with `pytest -m gpu tests/kernels`.

TRITON_INTERPRET must be set before any ``triton.jit`` decorator runs, so it is set here, at
collection, when the machine has no GPU. Each test is parametrized over ``device``: ``cpu`` cases
(interpreter, small irregular shapes) and ``cuda`` cases marked ``gpu`` (compiled, larger shapes).
"""

from __future__ import annotations

import os
import sys

import torch

# Triton decides compiled vs interpreted when each @triton.jit runs, its own standard library
# included: the variable only works if it is set before triton is first imported.
_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from anneal.engine.ops.registry import interpreting  # noqa: E402


@pytest.fixture(autouse=True)
def _device_available(request):
    dev = request.node.callspec.params.get("device") if hasattr(request.node, "callspec") else None
    if dev == "cpu" and not interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set automatically when no GPU is present)")
    if dev == "cpu" and _TRITON_PREIMPORTED:
        pytest.fail("triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1, so "
                    "the kernels are compiled and cannot run on CPU tensors: export TRITON_INTERPRET=1 "
                    "(or set it in a top-level tests/conftest.py)")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if dev == "cuda" and interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: the cuda cases must run compiled")


@pytest.fixture(autouse=True)
def _poisoned_allocations(monkeypatch):
    """Every ``torch.empty``/``empty_like`` during a kernel test comes back filled with NaN (floats)
    or the dtype's max (ints): an output element a kernel forgets to write cannot pass as correct."""
    from kernel_testing import poison_

    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        return poison_(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poison_(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
