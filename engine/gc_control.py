"""The cyclic garbage collector around the engine: paused where a collection would break or skew
something, and clocked in workload replays.

A collection runs inside whichever step crossed the allocation threshold; a full one walks every
tracked object (a serving process holds ~280k: 120 ms on the H200 host in session 4). Not frozen
after start-up as vLLM does: session 16 measured 1-2 young collections (2-4 ms) per 8B chat replay
of ~10 s, none full, with the start-up heap frozen or not (bench/NOTES.md).
"""

from __future__ import annotations

import contextlib
import gc
import time


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


class GcClock:
    """Time the cyclic garbage collector took inside, and how many collections ran (full ones
    apart). In a replay that time is part of some steps' walls."""

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

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._observe)

    def totals(self) -> dict[str, float | int]:
        return {"gc_ms": self.ms, "gc_full_collections": self.collections[2],
                "gc_collections": sum(self.collections)}
