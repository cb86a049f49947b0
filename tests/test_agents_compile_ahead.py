"""The lab asks the fast engine to compile a candidate's kernels ahead only when told to, and stops
asking an engine that has no such endpoint."""

from __future__ import annotations

import pytest

from anneal.agents.engine_client import EngineError
from anneal.agents.lab import Lab
from anneal.agents.ledger import Ledger
from anneal.agents.types import BenchSpec, Candidate, Measurement
from anneal.engine.plan import Plan


class _Engine:
    def __init__(self, has_prepare: bool = True):
        self.calls: list[str] = []
        self.has_prepare = has_prepare

    def prepare(self, plans):
        self.calls.append("prepare")
        if not self.has_prepare:
            raise EngineError("fast: POST /admin/prepare -> 404: Not Found", 404)
        return {"queued": len(plans)}

    def benchmark(self, plan, spec, traffic=None):
        self.calls.append("benchmark")
        return Measurement(median_ms=1.0, p10_ms=0.9, p90_ms=1.1)


def _measure(tmp_path, engine, n=3, **lab_args):
    with Ledger(tmp_path / "l.sqlite") as led:
        lab = Lab(ledger=led, engines={"fast": engine}, **lab_args)
        for i in range(n):
            lab.measure(Candidate(plan=Plan(cuda_graph_batch_sizes=[i + 1]), agent="t"), BenchSpec())


@pytest.mark.parametrize("on", [False, True])
def test_prepare_before_benchmark_only_when_asked(tmp_path, on):
    engine = _Engine()
    _measure(tmp_path, engine, compile_ahead=on)
    assert engine.calls == (["prepare", "benchmark"] * 3 if on else ["benchmark"] * 3)


def test_an_engine_without_prepare_is_asked_once(tmp_path):
    engine = _Engine(has_prepare=False)
    _measure(tmp_path, engine, compile_ahead=True)
    assert engine.calls == ["prepare", "benchmark", "benchmark", "benchmark"]
