"""The parallel JIT pass is best effort: launches inside it only compile, a failing pass is
reported and never raised, and Triton's launch path is restored whatever happens."""

from __future__ import annotations

import pytest

triton_jit = pytest.importorskip("triton.runtime.jit")

from anneal.engine.parallel_jit import precompile  # noqa: E402


def test_launches_inside_the_pass_only_compile(monkeypatch):
    calls = []

    def recording_run(self, *args, grid, warmup, **kwargs):
        calls.append(warmup)

    monkeypatch.setattr(triton_jit.JITFunction, "run", recording_run)
    report = precompile([lambda: triton_jit.JITFunction.run(object(), 1, grid=(1,), warmup=False)])
    assert calls == [True]
    assert "error" not in report and report["kernels"] == 0
    assert triton_jit.JITFunction.run is recording_run  # put back


def test_a_failing_pass_is_reported_and_launches_are_restored():
    original = triton_jit.JITFunction.run

    def broken_pass():
        raise RuntimeError("index out of range in the collecting pass")

    ran_after = []
    report = precompile([broken_pass, lambda: ran_after.append(1)])
    assert "index out of range" in report["error"]
    assert ran_after == []  # the pass stops at the first failure; the warm-up does the rest
    assert triton_jit.JITFunction.run is original
    assert report["s"] >= 0


def test_nothing_to_compile():
    assert precompile([]) == {"kernels": 0, "s": pytest.approx(0, abs=1.0)}


def test_the_same_launch_reaches_triton_once(monkeypatch):
    """32 layers launching one kernel with the same shapes are one compile request; another
    alignment, dtype or integer is another."""
    torch = pytest.importorskip("torch")
    seen = []
    monkeypatch.setattr(triton_jit.JITFunction, "run",
                        lambda self, *a, grid, warmup, **kw: seen.append((a[1], kw["BLOCK"])))
    fn = object()
    x, y = torch.zeros(64), torch.zeros(64)
    odd = torch.zeros(65)[1:]  # 4-byte offset: another alignment

    def layers():
        for _ in range(32):
            triton_jit.JITFunction.run(fn, x, 64, grid=(1,), warmup=False, BLOCK=64)
            triton_jit.JITFunction.run(fn, y, 64, grid=(1,), warmup=False, BLOCK=64)
        triton_jit.JITFunction.run(fn, x, 48, grid=(1,), warmup=False, BLOCK=64)
        triton_jit.JITFunction.run(fn, x, 64, grid=(1,), warmup=False, BLOCK=128)
        triton_jit.JITFunction.run(fn, odd, 64, grid=(1,), warmup=False, BLOCK=64)
        triton_jit.JITFunction.run(fn, x.half(), 64, grid=(1,), warmup=False, BLOCK=64)

    precompile([layers])
    assert len(seen) == 5
