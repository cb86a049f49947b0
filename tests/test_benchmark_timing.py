"""The fixed-shape benchmark times its steps pinned to one CPU with GC off, and restores both."""

from __future__ import annotations

import gc
import os

import pytest

from anneal.engine import benchmark
from anneal.engine.benchmark import BenchmarkRequest, run_benchmark
from anneal.engine.llm import Engine, EngineArgs


@pytest.fixture(scope="module")
def eng() -> Engine:
    return Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=128, num_kv_blocks=256))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_timed_steps_run_pinned_without_gc_then_both_are_restored(eng, monkeypatch):
    before = os.sched_getaffinity(0)
    seen = {}
    timed = benchmark._timed_steps

    def spying(*a, **kw):
        seen["cpus"] = os.sched_getaffinity(0)
        seen["gc"] = gc.isenabled()
        return timed(*a, **kw)

    monkeypatch.setattr(benchmark, "_timed_steps", spying)
    res = run_benchmark(eng, BenchmarkRequest(mode="decode", batch_size=2, context_len=16, steps=2, warmup=1))
    assert res.median_ms > 0
    assert len(seen["cpus"]) == 1 and seen["cpus"] <= before
    assert seen["gc"] is False
    assert os.sched_getaffinity(0) == before
    assert gc.isenabled()


def test_a_failing_step_still_restores_affinity(eng, monkeypatch):
    before = os.sched_getaffinity(0)

    def boom(*a, **kw):
        raise RuntimeError("kernel blew up")

    monkeypatch.setattr(benchmark, "_timed_steps", boom)
    with pytest.raises(RuntimeError, match="blew up"):
        run_benchmark(eng, BenchmarkRequest(mode="decode", batch_size=1, context_len=16, steps=1, warmup=0))
    assert os.sched_getaffinity(0) == before
    assert gc.isenabled()
