"""Compile the Triton kernels of plans the compiler will try next, while the engine runs the current one.

Why: a candidate's apply spends most of its time JIT-compiling the kernel variants its parameters
name (0.4-0.9 s of a 0.64-0.68 s candidate on the H200, session 5), and the search knows its next
candidates before it measures the current one. A worker thread runs each queued plan's decode body
on a two-layer view of the model (``ModelRunner.ahead_passes``) with every Triton launch turned
compile-only (``parallel_jit.precompile``); when the engine later applies that plan, its warm-up
finds the kernels compiled.

Nothing it does can change what the engine serves or measures: the view has its own buffers, KV
cache and stream, its torch ops wait for captures (``ModelRunner.device_lock``), and a failure is
recorded against the plan, never raised.
"""

from __future__ import annotations

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
    def __init__(self, runner) -> None:
        self.runner = runner
        self._queue: queue.Queue[Plan] = queue.Queue()
        self._pending: set[str] = set()
        self._done: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._busy: str | None = None
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
                if h in self._pending or h in self._done or h == self._busy:
                    continue
                self._pending.add(h)
                self._queue.put(plan)
                n += 1
            if n and self._thread is None:
                self._thread = threading.Thread(target=self._work, name="anneal-compile-ahead", daemon=True)
                self._thread.start()
        return n

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"queued": len(self._pending), "compiling": self._busy,
                    "done": {h: dict(r) for h, r in self._done.items()}}

    def wait(self, timeout_s: float = 600.0) -> bool:
        """Until nothing is queued or compiling (tests, benchmarks); False on time-out."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if not self._pending and self._busy is None:
                    return True
            time.sleep(0.01)
        return False

    def _work(self) -> None:
        while True:
            plan = self._queue.get()
            with self._lock:
                self._pending.discard(plan.hash)
                self._busy = plan.hash
            try:
                result = self._compile(plan)
            except Exception as e:  # noqa: BLE001 - recorded against the plan, the engine serves on
                log.warning("compile-ahead of plan %s failed: %s: %s", plan.hash[:12], type(e).__name__, e)
                result = {"kernels": 0, "s": 0.0, "error": f"{type(e).__name__}: {e}"}
            with self._lock:
                self._done[plan.hash] = result
                while len(self._done) > _KEEP:
                    self._done.popitem(last=False)
                self._busy = None

    def _compile(self, plan: Plan) -> dict[str, Any]:
        from anneal.engine.llm import graph_sizes, register_plan_kernels
        from anneal.engine.op_table import OpTable
        from anneal.engine.parallel_jit import precompile

        with self.runner.device_lock:  # an agent kernel's registration meets no plan being built
            register_plan_kernels(plan)
            ops = OpTable.from_plan(plan, self.runner.device.type)
            passes = self.runner.ahead_passes(ops, graph_sizes(plan))
        return precompile(passes, hold=self.runner.device_lock)
