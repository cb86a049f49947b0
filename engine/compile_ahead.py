"""Compile the Triton kernels of plans the compiler will try next, while the engine runs the current one.

Why: most of a new candidate's apply is the JIT of the kernel variants its parameters name (on the
H200, 0.4-0.9 s for the slow candidates of a 0.64-0.83 s median, session 5), and the search knows its
next candidates before it measures the current one. A worker thread runs each queued plan's decode
body on a two-layer view of the model (``ModelRunner.ahead_passes``) with every Triton launch turned
compile-only (``parallel_jit.precompile``); when the engine later applies that plan, its warm-up
finds the kernels compiled.

It cannot change what the engine serves or what a graph replay's device time measures: the view has
its own buffers, KV cache and stream, its torch ops wait for captures (``ModelRunner.device_lock``),
and a failure is recorded against the plan, never raised.

Compiling on the worker thread cost the engine thread ~0.1-0.2 s of each candidate's apply and
benchmark call in GIL and CPU (session 5). So by default the worker only records what the passes
would compile, child processes compile it into Triton's disk cache (``compile_children``), and a
second compile-only pass loads the binaries into the engine process, plan by plan: each is
released as soon as its own kernels are in, and only then does an apply of it stop waiting
(``wait_for``). ``processes=0`` keeps the in-process compile, whose batch releases its plans
together and which an apply never waits for. The swarm, whose candidates mostly hit the JIT cache,
leaves compile-ahead off by default.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

from anneal.engine.plan import Plan

log = logging.getLogger(__name__)

_KEEP = 256  # plans' results remembered for GET /admin/state


class CompileAhead:
    def __init__(self, runner, processes: int | None = None) -> None:
        from anneal.engine.compile_children import default_processes

        self.runner = runner
        self.processes = default_processes() if processes is None else processes
        self._children = None  # CompileChildren: started by the first submit (or start_children)
        self._queue: queue.Queue[Plan] = queue.Queue()
        self._pending: set[str] = set()
        self._done: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._busy: set[str] = set()  # hashes of the batch compiling now
        self._in_children: set[str] = set()  # of those, compiling in the children, not yet loaded
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, plans: list[Plan]) -> int:
        """Queue plans not queued or compiled already; returns how many were queued."""
        if self.runner.device.type != "cuda":
            return 0  # no Triton compiles off the GPU (the interpreter runs kernels as Python)
        n = 0
        with self._lock:
            for plan in plans:
                h = plan.hash
                if h in self._pending or h in self._done or h in self._busy:
                    continue
                self._pending.add(h)
                self._queue.put(plan)
                n += 1
            if n:
                self.start_children()  # in the background: batches compile in-process until it is up
            if n and self._thread is None:
                self._thread = threading.Thread(target=self._work, name="anneal-compile-ahead", daemon=True)
                self._thread.start()
        return n

    def start_children(self, wait_s: float = 0.0) -> bool:
        """Start the compile child processes (once) and wait up to ``wait_s`` for them; returns
        whether they are ready. With ``processes=0`` there are none, and this returns False."""
        if self.processes <= 0:
            return False
        if self._children is None:
            from anneal.engine.compile_children import CompileChildren

            self._children = CompileChildren(self.processes)
        self._children.start()
        return self._children.wait_ready(wait_s) if wait_s > 0 else self._children.ready

    def status(self) -> dict[str, Any]:
        children = self._children
        with self._lock:
            return {"queued": len(self._pending), "compiling": sorted(self._busy),
                    "processes": {"configured": self.processes, "ready": bool(children and children.ready),
                                  **({"error": children.start_error} if children and children.start_error else {})},
                    "done": {h: dict(r) for h, r in self._done.items()}}

    def close(self) -> None:
        """Stop the child processes (the worker thread is a daemon and holds nothing)."""
        if self._children is not None:
            self._children.close()

    def wait(self, timeout_s: float = 600.0) -> bool:
        """Until nothing is queued or compiling (tests, benchmarks); False on time-out."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if not self._pending and not self._busy:
                    return True
            time.sleep(0.01)
        return False

    def wait_for(self, plan_hash: str, timeout_s: float = 10.0) -> float:
        """If ``plan_hash``'s kernels are compiling in the children now, wait (up to ``timeout_s``)
        until they are in; returns the seconds waited. Not for a plan still queued, nor for one
        compiling in-process: that batch releases its plans together, and the swarm's batches can
        hold dozens of kernels of other plans (the apply compiles its own beside it instead)."""
        t0, waited = time.perf_counter(), False
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if plan_hash not in self._in_children:
                    break
            waited = True
            time.sleep(0.005)
        return time.perf_counter() - t0 if waited else 0.0

    def _work(self) -> None:
        while True:
            batch = [self._queue.get()]  # then everything queued behind it: compiled together
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            with self._lock:
                for plan in batch:
                    self._pending.discard(plan.hash)
                self._busy = {p.hash for p in batch}
                if self._children is not None and self._children.ready:  # what an apply may wait for
                    self._in_children = set(self._busy)
            try:
                results = self._compile(batch)
            except Exception as e:  # noqa: BLE001 - the worker must outlive any batch
                log.warning("compile-ahead batch of %d plans failed: %s: %s", len(batch), type(e).__name__, e)
                results = {p.hash: {"kernels": 0, "s": 0.0, "error": f"{type(e).__name__}: {e}"} for p in batch}
            with self._lock:
                self._done.update(results)
                while len(self._done) > _KEEP:
                    self._done.popitem(last=False)
                self._busy, self._in_children = set(), set()

    def _compile(self, plans: list[Plan]) -> dict[str, dict[str, Any]]:
        """All queued plans at once (children, or one in-process pool): the compile time of a
        candidate's kernels (~0.5 s on the H200 host) is longer than a candidate's apply and
        benchmark, so plans compiled one after the other would only keep the queue behind."""
        from anneal.engine.parallel_jit import precompile

        t0 = time.perf_counter()
        results: dict[str, dict[str, Any]] = {p.hash: {} for p in plans}
        if self._children is not None and self._children.ready:
            futures = self._compile_in_children(plans, results)
            if futures is None:
                with self._lock:
                    self._in_children = set()
            else:
                self._load_each(plans, results, futures, t0)
                return results
        else:
            for r in results.values():
                r["in_process"] = True  # no children (processes=0), or not started yet
        report = precompile([functools.partial(self._collect, p, results[p.hash]) for p in plans])
        for r in results.values():
            r.setdefault("s", time.perf_counter() - t0)
            if "error" in report:
                r.setdefault("error", report["error"])
            r["batch"] = len(plans)
            r["batch_kernels"] = report["kernels"]
        return results

    def _compile_in_children(self, plans: list[Plan], results: dict[str, dict[str, Any]]) -> dict | None:
        """Record what each plan's passes would compile and hand it to the child processes (each
        plan's kernels as soon as its pass is recorded). Returns each plan's compile futures, or
        None when the children cannot be used (the in-process pass compiles everything then)."""
        from anneal.engine.compile_children import current_target, recording_launches

        t0 = time.perf_counter()
        try:
            target = current_target()
            submitted: dict = {}
            futures: dict[str, dict] = {}
            with recording_launches() as specs:
                for plan in plans:
                    before, recorded = len(specs), {}
                    self._run_passes(plan, recorded)  # a failure here is the loading pass's to judge
                    mine = specs[before:]
                    results[plan.hash]["child_kernels"] = len(mine)
                    if "error" in recorded:
                        results[plan.hash]["child_error"] = recorded["error"]
                    self._children.submit(mine, target, submitted)  # compiles while the next records
                    futures[plan.hash] = {spec: submitted[spec] for spec in mine}
        except Exception as e:  # noqa: BLE001 - the in-process pass compiles instead
            log.warning("compile-ahead in child processes failed, compiling in-process: %s: %s",
                        type(e).__name__, e)
            for r in results.values():
                r["child_error"] = f"{type(e).__name__}: {e}"
            return None
        for r in results.values():
            r["record_s"] = time.perf_counter() - t0
        return futures

    def _load_each(self, plans: list[Plan], results: dict[str, dict[str, Any]], futures: dict,
                   t0: float) -> None:
        """Plan by plan, in queue order: wait for its kernels, load them, and release it, so the
        next candidate's apply waits for its own kernels, not the whole batch's (the first
        candidate of a stream waited 0.8 s for a batch of four on the H200, session 6)."""
        from anneal.engine.compile_children import COMPILE_TIMEOUT_S
        from anneal.engine.parallel_jit import precompile

        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        broken = []
        for plan in plans:
            r = results[plan.hash]
            report = self._children.collect(futures[plan.hash], deadline - time.monotonic(), restart=False)
            r.update(child_s=time.perf_counter() - t0, child_cpu_s=report["cpu_s"])
            if report["errors"]:
                r["child_errors"] = report["errors"][:8]
            if report["broken"]:
                broken.append(report["errors"][0])
            load = precompile([functools.partial(self._collect, plan, r)])  # what the children missed compiles here
            if "error" in load:
                r.setdefault("error", load["error"])
            r.update(s=time.perf_counter() - t0, batch=len(plans))
            self._publish(plan.hash, r)
        if broken:
            self._children.restart(broken[0])

    def _publish(self, plan_hash: str, result: dict[str, Any]) -> None:
        with self._lock:
            self._done[plan_hash] = dict(result)
            self._busy.discard(plan_hash)
            self._in_children.discard(plan_hash)

    def _collect(self, plan: Plan, result: dict[str, Any]) -> None:
        """Launch (compile-only) every kernel of ``plan``'s decode buckets; a failure is recorded
        against the plan and ends its pass, not the batch's."""
        t0 = time.perf_counter()
        mode = _active_compile_mode()
        before = len(mode.future_kernels) if mode is not None else 0
        self._run_passes(plan, result)
        result["collect_s"] = time.perf_counter() - t0
        # kernels this plan handed to Triton here (compiled, or loaded from what the children
        # wrote); a kernel another plan of the batch handed over first is not counted
        result["kernels"] = len(mode.future_kernels) - before if mode is not None else 0

    def _run_passes(self, plan: Plan, result: dict[str, Any]) -> None:
        from anneal.engine.llm import graph_shapes, register_plan_kernels
        from anneal.engine.op_table import OpTable

        t0 = time.perf_counter()
        try:
            with self.runner.device_lock:  # its torch ops (and an agent kernel's registration) meet no capture
                register_plan_kernels(plan)
                ops = OpTable.from_plan(plan, self.runner.device.type)
                for run_pass in self.runner.ahead_passes(ops, *graph_shapes(plan)):
                    run_pass()
        except Exception as e:  # noqa: BLE001 - recorded against the plan, the engine serves on
            log.warning("compile-ahead of plan %s failed: %s: %s", plan.hash[:12], type(e).__name__, e)
            result["error"] = f"{type(e).__name__}: {e}"
            result["s"] = time.perf_counter() - t0


def _active_compile_mode():
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:
        return None
    return active_mode.get()
