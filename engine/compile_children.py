"""Triton compiles in child processes that share the engine's on-disk kernel cache.

Why: compile-ahead on a thread of the serving process held the GIL for much of each compile
(Triton's code generator is Python), and that cost the engine thread ~0.1-0.2 s of each
candidate's apply and benchmark on the H200 (session 5). So the compile-ahead thread now only
*records* what each of its launches would compile (Triton's ``jit_cache_hook``, for that thread
alone), child processes compile those specializations into Triton's cache directory, and a second
compile-only pass in the engine process finds every binary on disk and keeps it in memory.

The children never touch the GPU (``CUDA_VISIBLE_DEVICES`` is empty for them): they compile for
the target the engine names, so they take no GPU memory and no time slice from the engine's
context. A kernel a child cannot build (a module it cannot import, a source that changed) comes
back as an error and is compiled in-process by the second pass instead; nothing is lost.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120.0  # for one batch's kernels in the children (a kernel compiles in ~0.5 s)


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one ``@triton.jit`` function: what the engine's ``_do_compile`` would
    have built its ``ASTSource`` from. The signature, constants and attributes travel as Triton's
    own objects (pickled): its preload JSON cannot tell a string constexpr from a dtype name
    ("bf16" came back as ``tl.bfloat16``), and a different constant is a different cache key, so
    the engine would compile the kernel again (the H200 GPU test caught it)."""

    module: str  # the function's module, imported by name in the child
    qualname: str
    module_file: str | None  # for a run-time (agent-written) kernel's module, which no import finds
    source_key: str  # JITFunction.cache_key: the child refuses a function whose source differs
    specialization: str  # Triton's serialize_specialization_data JSON: identity, and the options
    signature: dict = field(compare=False, hash=False, default_factory=dict)
    constants: dict = field(compare=False, hash=False, default_factory=dict)
    attrs: dict = field(compare=False, hash=False, default_factory=dict)


# --- recording, in the engine process ---------------------------------------------------------

_lock = threading.Lock()
_recording: dict[int, list[KernelSpec]] = {}  # thread id -> what its launches would compile
_previous_hook: Any = None


def _record_hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **extra):  # noqa: A002
    specs = _recording.get(threading.get_ident())
    if specs is None:  # another thread: Triton compiles as usual (or a hook installed before ours)
        if _previous_hook is None:
            return None
        return _previous_hook(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                              already_compiled=already_compiled, **extra)
    jf = fn.jit_function
    mod = sys.modules.get(jf.module)
    specs.append(KernelSpec(module=jf.module, qualname=jf.fn.__qualname__,
                            module_file=getattr(mod, "__file__", None), source_key=jf.cache_key,
                            specialization=compile["specialization_data"],
                            signature=dict(compile["signature"]), constants=dict(compile["constants"]),
                            attrs=dict(compile["configs"][0])))
    return True  # Triton skips the compile; the launch was compile-only already


@contextlib.contextmanager
def recording_launches() -> Iterator[list[KernelSpec]]:
    """In this thread, every Triton launch that would compile is recorded instead (and nothing
    launches); other threads compile and launch as usual. Yields the list the specs go into."""
    from triton import knobs

    from anneal.engine.parallel_jit import _launches_compile_only

    global _previous_hook
    tid = threading.get_ident()
    specs: list[KernelSpec] = []
    with _lock:
        if not _recording:
            _previous_hook = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _record_hook
        _recording[tid] = specs
    try:
        with _launches_compile_only():
            yield specs
    finally:
        with _lock:
            del _recording[tid]
            if not _recording:
                knobs.runtime.jit_cache_hook = _previous_hook
                _previous_hook = None


# --- compiling, in the children -----------------------------------------------------------------

def _child_init(cache_dir: str | None, modules: list[str], target: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # compile for the named target; never open a context
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    importlib.import_module("triton")  # paid once per child, not per kernel
    for name in modules:  # the engine's kernel modules, so a first compile does not import them
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if target is not None:
        # A process's first Triton compile costs ~1 s more than later ones (measured on the H200
        # host: 1.01 s for a kernel the engine process compiles in ~0.4 s); pay it at start.
        with contextlib.suppress(Exception):
            _warm_compiler(target)


def _warm_compiler(target: Any) -> None:
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    @triton.jit
    def fill(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.full((BLOCK,), 1.0, tl.float32), mask=i < n)

    triton.compile(ASTSource(fill, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {(2,): 64}),
                   target=target)


def _ready() -> int:
    return os.getpid()


def _jit_function(spec: KernelSpec):
    from triton.runtime.jit import JITFunction

    try:
        obj: Any = importlib.import_module(spec.module)
    except ModuleNotFoundError:
        if not spec.module_file or not os.path.exists(spec.module_file):
            raise
        obj = sys.modules.get(spec.module)
        if obj is None:  # a run-time kernel: its module is the file the engine wrote
            obj = types.ModuleType(spec.module)
            obj.__file__ = spec.module_file
            sys.modules[spec.module] = obj
            with open(spec.module_file) as f:
                exec(compile(f.read(), spec.module_file, "exec"), obj.__dict__)
    for part in spec.qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):  # under @triton.autotune / @triton.heuristics
        obj = obj.fn
    if obj.cache_key != spec.source_key:
        raise RuntimeError(f"{spec.module}.{spec.qualname}: the child's source differs from the engine's")
    return obj


def _as_tuple(v: Any) -> Any:
    return tuple(_as_tuple(x) for x in v) if isinstance(v, list) else v


def compile_in_child(spec: KernelSpec, target: Any) -> float:
    """Compile one specialization into Triton's cache; returns seconds. What the engine's
    ``JITFunction._do_compile`` would run, for the target the engine names (the child has no GPU)."""
    import triton
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    fn = _jit_function(spec)
    # JSON turned the options' tuples into lists; Triton's preload turns them back the same way
    options = {k: _as_tuple(v) for k, v in json.loads(spec.specialization)["options"].items()}
    triton.compile(ASTSource(fn, spec.signature, spec.constants, spec.attrs), target=target, options=options)
    return time.perf_counter() - t0


# --- the pool ----------------------------------------------------------------------------------

def default_processes() -> int:
    """A quarter of the host's cores, at most 4: a candidate brings a few new kernels (1-6 per
    batch of 4 plans on the H200 runs), and each child costs its imports in memory."""
    return max(1, min(4, (os.cpu_count() or 4) // 4))


class CompileChildren:
    """A pool of compiler processes, started once in the background (their imports take seconds)
    and kept; until it is up, ``ready`` is False and the caller compiles in-process."""

    def __init__(self, processes: int, target: Any = None) -> None:
        self.processes = processes
        self.target = target  # what the children warm their compiler for; None: the engine's GPU
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._starting = False
        self.start_error: str | None = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start(self) -> None:
        """Spawn the children in a background thread; ``ready`` turns True once each has imported
        Triton and the engine's kernel modules."""
        with self._lock:
            if self._starting:
                return
            self._starting = True
        threading.Thread(target=self._spawn, name="anneal-compile-children", daemon=True).start()

    def _spawn(self) -> None:
        import multiprocessing

        from anneal.engine.kernel_cache import cache_dir

        modules = sorted(m for m in list(sys.modules) if m.startswith("anneal.engine.kernels."))
        target = self.target
        if target is None:
            with contextlib.suppress(Exception):  # no driver: the children start with a cold compiler
                target = current_target()
        try:
            pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_child_init, initargs=(cache_dir(), modules, target))
            for fut in [pool.submit(_ready) for _ in range(self.processes)]:
                fut.result()
        except Exception as e:  # noqa: BLE001 - compile-ahead goes on in-process
            log.warning("compile-ahead child processes did not start: %s: %s", type(e).__name__, e)
            self.start_error = f"{type(e).__name__}: {e}"
            return
        with self._lock:
            self._pool = pool
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def submit(self, specs: list[KernelSpec], target: Any, submitted: dict | None = None) -> dict:
        """Start compiling each spec not in ``submitted`` (spec -> future; updated and returned)."""
        submitted = {} if submitted is None else submitted
        for spec in specs:
            if spec not in submitted:
                if not self.ready:
                    raise RuntimeError("the compile children have not started")
                submitted[spec] = self._pool.submit(compile_in_child, spec, target)
        return submitted

    def collect(self, submitted: dict, timeout_s: float = COMPILE_TIMEOUT_S, restart: bool = True) -> dict[str, Any]:
        """Wait for every future of ``submit`` (or a subset), ``timeout_s`` at most. Returns
        ``{"kernels": compiled, "cpu_s": summed compile seconds, "errors": [...], "broken": a child
        died or hung}``. With ``restart`` a broken pool is replaced for later batches (else the
        caller calls ``restart()``): a compile-ahead batch never waits without bound."""
        report: dict[str, Any] = {"kernels": 0, "cpu_s": 0.0, "errors": []}
        _, late = wait(list(submitted.values()), timeout=max(0.0, timeout_s))
        broken = bool(late)
        for spec, fut in submitted.items():
            name = f"{spec.module}.{spec.qualname}"
            if fut in late:
                report["errors"].append(f"{name}: not compiled within {timeout_s:.0f} s")
                continue
            try:
                report["cpu_s"] += fut.result()
                report["kernels"] += 1
            except Exception as e:  # noqa: BLE001 - the in-process pass compiles it instead
                broken |= isinstance(e, BrokenProcessPool)
                report["errors"].append(f"{name}: {type(e).__name__}: {e}")
        report["broken"] = broken
        if broken and restart:
            self.restart("; ".join(report["errors"][:3]))
        return report

    def restart(self, why: str) -> None:
        log.warning("compile-ahead children restarted: %s", why)
        self.close()
        self.start()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._ready.clear()
            self._starting = False
        if pool is not None:
            # shutdown() leaves a child that is still compiling running; a hung one must go too
            # (ProcessPoolExecutor has no public way to end its workers before Python 3.14)
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                with contextlib.suppress(Exception):
                    proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)


def current_target() -> Any:
    """The GPU target the engine's kernels compile for (what the children must name)."""
    from triton.runtime import driver

    return driver.active.get_current_target()
