"""Compile every Triton kernel a forward pass will launch, all at once, before it runs.

Why: a plan change JIT-compiles its new kernel variants one after the other as the warm-up forward
reaches them: 0.03-0.84 s of a candidate's ~0.8 s on the H200 (session 4, `bench/iteration.py`),
and 4.7 s of a cold start with an empty Triton cache. Triton's compiler releases the GIL for most
of its work (on a 2-core CPU, two threads compiled four GEMV variants in 1.70 s against 3.30 s one
after the other). So a first pass turns every Triton launch into a compile-only warm-up under
Triton's ``AsyncCompileMode``, which hands the compiles to a thread pool; the pool finishes them
together, and the real warm-up that follows finds every kernel compiled.

Best effort by design: the collecting pass runs torch ops on outputs the skipped Triton kernels
never wrote, so anything it raises only means the usual one-by-one compile happens instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


def _call_key(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """What decides a launch's specialization, or finer: pointers by dtype and 16-byte alignment,
    everything else by value. The same kernel launched by all 32 layers is one key, so it is handed
    to Triton once (Triton 3.6 hashes the kernel source for every compile-only launch it sees:
    3.4 ms each on the dev CPU). A key finer than Triton's costs a duplicate hash, never a kernel."""
    def part(v: Any) -> Any:
        if hasattr(v, "data_ptr") and hasattr(v, "dtype"):
            return ("ptr", str(v.dtype), v.data_ptr() % 16 == 0)
        if isinstance(v, float):
            return ("float",)
        return v if isinstance(v, (int, bool, str, type(None))) else repr(v)

    return (id(fn), tuple(part(a) for a in args), tuple(sorted((k, part(v)) for k, v in kwargs.items())))


_lock = threading.Lock()
_compile_only: dict[int, set[tuple]] = {}  # thread id -> launches it handed to Triton
_original_run: Any = None


@contextlib.contextmanager
def _launches_compile_only() -> Iterator[None]:
    """In this thread, every ``kernel[grid](...)`` compiles (or finds its binary) without
    launching; each distinct launch (``_call_key``) reaches Triton once. Other threads launch as
    usual, so a compile-ahead pass can run while the engine thread serves or benchmarks."""
    from triton.runtime.jit import JITFunction

    global _original_run
    tid = threading.get_ident()
    with _lock:
        if not _compile_only:
            run = _original_run = JITFunction.run

            def compile_only(self, *args, grid, warmup, **kwargs):
                seen = _compile_only.get(threading.get_ident())
                if seen is None:
                    return run(self, *args, grid=grid, warmup=warmup, **kwargs)
                key = _call_key(self, args, kwargs)
                if key in seen:
                    return None
                seen.add(key)
                return run(self, *args, grid=grid, warmup=True, **kwargs)

            JITFunction.run = compile_only
        _compile_only[tid] = set()
    try:
        yield
    finally:
        with _lock:
            del _compile_only[tid]
            if not _compile_only:
                JITFunction.run = _original_run


def precompile(passes: Iterable[Callable[[], Any]], workers: int | None = None) -> dict[str, Any]:
    """Run each callable with Triton launches compile-only and the compiles in a thread pool; wait
    for all of them. Returns ``{"kernels": how many were compiled, "s": seconds}``, plus ``"error"`` when the
    collecting pass failed (the later warm-up then compiles what is left as usual)."""
    t0 = time.perf_counter()
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError as e:  # a Triton without it: nothing to do ahead
        return {"kernels": 0, "s": 0.0, "error": f"no AsyncCompileMode in this Triton ({e})"}
    workers = workers or min(16, os.cpu_count() or 1)
    report: dict[str, Any] = {"kernels": 0}
    with ThreadPoolExecutor(workers, thread_name_prefix="anneal-jit") as pool:
        try:
            mode = AsyncCompileMode(pool)
            with mode:
                with _launches_compile_only():
                    for run_pass in passes:
                        run_pass()
                report["kernels"] = len(mode.future_kernels)
        except Exception as e:  # noqa: BLE001 - best effort, see the module docstring
            log.warning("parallel JIT pass failed, kernels compile one by one instead: %s: %s",
                        type(e).__name__, e)
            report["error"] = f"{type(e).__name__}: {e}"
    report["s"] = time.perf_counter() - t0
    return report
