"""The cyclic garbage collector around serving: paused where a collection would break or skew
something, frozen after start-up, and clocked in replays.

A collection runs inside whichever step crossed the allocation threshold; a full one walks every
tracked object (a serving process holds ~280k: 120 ms on the H200 host in session 4). Start-up
objects (modules, weights, graphs) live as long as the process, so vLLM freezes them out of every
later collection; ``anneal serve`` does the same.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time

log = logging.getLogger("anneal.gc")


@contextlib.contextmanager
def collection_paused():
    """No cyclic garbage collection inside. In a graph capture, a collection can free an old
    engine's CUDA graphs, a call CUDA forbids while capturing: it invalidates the capture and leaves
    the device's RNG marked as capturing (seen on the H200: every later engine in the process
    failed). In timed steps, as timeit does: a collection lands in one step's host time at random.
    No full collection first: in a serving process (~280k objects) that alone took 120 ms, more than
    a candidate's 30-step benchmark (session 4)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive into the permanent generation, which later
    collections skip: for a process that holds one engine for its life (``anneal serve``). Not for
    a process that makes and drops engines (tests): a frozen engine's reference cycles are never
    collected. Thawed at exit, so that the interpreter's last collection still frees them (else
    nanobind reports Triton's objects as leaked). Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this runs
    atexit.register(gc.unfreeze)
    n = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector", n)
    return n


class GcClock:
    """Time the cyclic garbage collector took while started, and its collections by generation.
    In a replay it is part of some steps' walls."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.collections = [0, 0, 0]
        self._t = 0.0

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t) * 1e3
            self.collections[info["generation"]] += 1

    def start(self) -> "GcClock":
        gc.callbacks.append(self._observe)
        return self

    def stop(self) -> dict[str, float | int]:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        return {"gc_ms": self.ms, "gc_full_collections": self.collections[2],
                "gc_collections": sum(self.collections)}
