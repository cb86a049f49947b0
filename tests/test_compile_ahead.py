"""Compile-ahead: queued plans' decode kernels are compiled on a worker thread without touching
what the engine serves; failures are recorded against the plan, never raised."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from anneal.engine.compile_ahead import CompileAhead
from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.plan import Plan

triton_jit = pytest.importorskip("triton.runtime.jit")


def _plan(split_k: int) -> Plan:
    return Plan.model_validate({"ops": {"attention_decode": {"impl": "triton_splitk",
                                                             "params": {"split_k": split_k}}},
                                "cuda_graph_batch_sizes": [1, 2]})


class _Runner:
    """What CompileAhead needs of a ModelRunner, on a pretend GPU: the passes record their thread."""

    def __init__(self, fail_on: int | None = None):
        self.device = types.SimpleNamespace(type="cuda")
        self.device_lock = threading.Lock()
        self.ran: list[tuple[int, int]] = []
        self.fail_on = fail_on

    def ahead_passes(self, ops, batch_sizes, max_seqs=0, token_sizes=()):
        split_k = ops.choices["attention_decode"][1]["split_k"]

        def run(bs):
            if split_k == self.fail_on:
                raise RuntimeError(f"pass broke at split_k={split_k}")
            self.ran.append((split_k, bs))
            assert threading.current_thread().name == "anneal-compile-ahead"
        return [lambda bs=bs: run(bs) for bs in sorted(batch_sizes, reverse=True)]


def _hold_passes(runner: _Runner, split_k: int | None = None) -> tuple[threading.Event, threading.Event]:
    """Make the runner's passes (for plans of ``split_k``, or all) block until ``release`` is set;
    ``started`` is set when one is blocked."""
    started, release = threading.Event(), threading.Event()
    passes = runner.ahead_passes

    def held(ops, batch_sizes, max_seqs=0, token_sizes=()):
        if split_k is None or ops.choices["attention_decode"][1]["split_k"] == split_k:
            started.set()
            release.wait(30)
        return passes(ops, batch_sizes)

    runner.ahead_passes = held
    return started, release


def test_each_plan_is_compiled_once_on_the_worker_thread():
    runner = _Runner()
    ahead = CompileAhead(runner, processes=0)
    assert ahead.submit([_plan(2), _plan(4), _plan(2)]) == 2
    assert ahead.wait(60)
    assert ahead.submit([_plan(4)]) == 0  # compiled already
    assert sorted(runner.ran) == [(2, 1), (2, 2), (4, 1), (4, 2)]
    done = ahead.status()["done"]
    assert set(done) == {_plan(2).hash, _plan(4).hash}
    assert all("error" not in r and r["s"] >= 0 for r in done.values())


def test_a_failing_plan_is_recorded_and_the_next_one_still_compiles():
    runner = _Runner(fail_on=4)
    ahead = CompileAhead(runner, processes=0)
    ahead.submit([_plan(4), _plan(8)])
    assert ahead.wait(60)
    done = ahead.status()["done"]
    assert "split_k=4" in done[_plan(4).hash]["error"]
    assert "error" not in done[_plan(8).hash] and (8, 1) in runner.ran


def test_launches_from_other_threads_run_while_one_thread_only_compiles(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_jit.JITFunction, "run",
                        lambda self, *a, grid, warmup, **kw: calls.append((threading.current_thread().name, warmup)))
    from anneal.engine.parallel_jit import _launches_compile_only

    inside, other_done = threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        triton_jit.JITFunction.run(object(), 1, grid=(1,), warmup=False)
        other_done.set()

    t = threading.Thread(target=other, name="engine")
    t.start()
    with _launches_compile_only():
        inside.set()
        other_done.wait(10)
        triton_jit.JITFunction.run(object(), 1, grid=(1,), warmup=False)
    t.join()
    assert sorted(calls) == [("MainThread", True), ("engine", False)]


def test_the_ahead_view_leaves_the_engine_kv_cache_and_buffers_alone():
    """The two-layer view runs the decode body on buffers and a cache of its own (CPU, reference
    ops, which really write their KV store): the engine's cache is bit-identical afterwards."""
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=128, num_kv_blocks=64))
    before = eng.runner.kv.clone()
    static = eng.runner._static_buffers

    def storing_buffers(max_bs):  # slot 0 instead of -1 (no store), so a pass really writes a cache
        b = static(max_bs)
        b["slot_mapping"].zero_()
        return b

    eng.runner._static_buffers = storing_buffers
    passes = eng.runner.ahead_passes(eng.runner.ops, [1, 4])
    assert len(passes) == 2
    for p in passes:
        p()
    assert torch.equal(eng.runner.kv, before)
    assert eng.compile_ahead.submit([_plan(2)]) == 0  # nothing to compile off the GPU


def test_plans_queued_behind_a_compile_are_compiled_together():
    runner = _Runner()
    started, release = _hold_passes(runner, split_k=1)
    ahead = CompileAhead(runner, processes=0)
    ahead.submit([_plan(1)])
    assert started.wait(30)
    assert ahead.submit([_plan(2), _plan(4), _plan(8)]) == 3
    assert ahead.status()["queued"] == 3
    release.set()
    assert ahead.wait(60)
    done = ahead.status()["done"]
    assert done[_plan(1).hash]["batch"] == 1
    assert [done[_plan(k).hash]["batch"] for k in (2, 4, 8)] == [3, 3, 3]


def test_the_worker_outlives_a_batch_that_breaks_outside_the_passes(monkeypatch):
    ahead = CompileAhead(_Runner(), processes=0)
    calls = []

    def broken_once(plans):
        calls.append(len(plans))
        if len(calls) == 1:
            raise MemoryError("no room for the view")
        return {p.hash: {"kernels": 1, "s": 0.1} for p in plans}

    monkeypatch.setattr(ahead, "_compile", broken_once)
    ahead.submit([_plan(2)])
    assert ahead.wait(30)
    assert "no room" in ahead.status()["done"][_plan(2).hash]["error"]
    ahead.submit([_plan(4)])
    assert ahead.wait(30)
    assert ahead.status()["done"][_plan(4).hash] == {"kernels": 1, "s": 0.1}


def test_an_apply_does_not_wait_for_an_in_process_batch():
    """In-process, a batch releases its plans together, and the swarm's batches hold other plans'
    kernels too: the apply compiles its own beside it rather than wait for all of them."""
    runner = _Runner()
    started, release = _hold_passes(runner)
    ahead = CompileAhead(runner, processes=0)
    ahead.submit([_plan(2)])
    assert started.wait(30)
    assert ahead.wait_for(_plan(2).hash, timeout_s=5) == 0.0
    assert ahead.status()["compiling"] == [_plan(2).hash]
    release.set()
    assert ahead.wait(30)


def test_with_children_each_plan_is_released_as_soon_as_its_own_kernels_are_in(monkeypatch):
    """The children compile a batch; the first plan's apply must not wait for the last plan's
    kernels (stand-ins here for the children and Triton's recording hook)."""
    import contextlib
    from concurrent.futures import Future, wait

    from anneal.engine import compile_children

    recording: dict = {"specs": None}

    @contextlib.contextmanager
    def fake_recording():
        recording["specs"] = []
        try:
            yield recording["specs"]
        finally:
            recording["specs"] = None

    class Children:
        ready, start_error = True, None

        def __init__(self):
            self.futures: dict = {}

        def start(self):
            pass

        def submit(self, specs, target, submitted):
            for s in specs:
                submitted.setdefault(s, self.futures.setdefault(s, Future()))
            return submitted

        def collect(self, subset, timeout_s, restart=True):
            wait(list(subset.values()), timeout_s)
            return {"kernels": len(subset), "cpu_s": 0.0, "errors": [], "broken": False}

    monkeypatch.setattr(compile_children, "recording_launches", fake_recording)
    monkeypatch.setattr(compile_children, "current_target", lambda: "sm_90")
    runner = _Runner()
    passes = runner.ahead_passes

    def recorded_passes(ops, batch_sizes, max_seqs=0, token_sizes=()):
        split_k = ops.choices["attention_decode"][1]["split_k"]
        if recording["specs"] is not None:  # the record pass: one kernel per plan
            recording["specs"].append(("decode_split", split_k))
        return passes(ops, batch_sizes)

    runner.ahead_passes = recorded_passes
    ahead = CompileAhead(runner, processes=1)
    children = ahead._children = Children()
    ahead.submit([_plan(2), _plan(4)])
    end = time.monotonic() + 30
    while len(children.futures) < 2 and time.monotonic() < end:  # both recorded and submitted
        time.sleep(0.01)
    assert ahead.wait_for(_plan(4).hash + "0", timeout_s=5) == 0.0  # not compiling: no wait
    assert ahead.wait_for(_plan(2).hash, timeout_s=0.2) >= 0.1  # its kernel is not in yet
    children.futures[("decode_split", 2)].set_result(0.5)
    assert ahead.wait_for(_plan(2).hash, timeout_s=10) < 5
    status = ahead.status()
    assert _plan(2).hash in status["done"] and status["compiling"] == [_plan(4).hash]
    children.futures[("decode_split", 4)].set_result(0.5)
    assert ahead.wait(30)
    done = ahead.status()["done"]
    assert done[_plan(2).hash]["child_kernels"] == 1 and "error" not in done[_plan(4).hash]
