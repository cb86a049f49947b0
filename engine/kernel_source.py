"""Run-time kernels: source text (agent-written) -> a checked, registered op variant.

A kernel's source defines ``build(**params) -> fn`` with its op's reference signature. Before it
touches the serving process it is compiled and checked against the reference in a *separate
process* (``python -m anneal.engine.kernel_source``) with a time limit: a compile error, an
exception, a wrong result, a crash (even one that poisons the CUDA context) or a hang comes back
as a result, and the server keeps serving. Only a kernel that passed is executed in-process.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from anneal.engine.plan import KernelSource


class KernelCheck(BaseModel):
    ok: bool
    stage: str  # compile | check | timeout | crash | registered
    error: str = ""
    max_rel_err: float | None = None
    ms: float | None = None
    seconds: float = 0.0


_source_dir: Path | None = None
SOURCE_DIR_ENV = "ANNEAL_KERNEL_SOURCE_DIR"


def source_dir() -> Path:
    """One folder per process for the kernels' source files, removed when the process exits.

    A serving engine registers kernels for as long as it runs; a folder per kernel left hundreds
    behind in /tmp after a day of compiles.
    """
    global _source_dir
    if _source_dir is None or not _source_dir.is_dir():
        given = os.environ.get(SOURCE_DIR_ENV)
        if given:  # a checker child: its parent owns the folder (a killed child runs no atexit)
            _source_dir = Path(given)
            _source_dir.mkdir(parents=True, exist_ok=True)
        else:
            _source_dir = Path(tempfile.mkdtemp(prefix="anneal-kernel-"))
            atexit.register(shutil.rmtree, _source_dir, ignore_errors=True)
    return _source_dir


def load_module(ks: KernelSource) -> types.ModuleType:
    """Execute the source as a fresh module (written to a file so Triton can read its source).

    The file name carries the source's hash: a second source for the same op and impl gets its own
    file, so the first one's tracebacks still show its own lines.
    """
    digest = hashlib.sha256(ks.source.encode()).hexdigest()[:12]
    path = source_dir() / f"{ks.op}_{ks.impl}_{digest}.py".replace("-", "_")
    path.write_text(ks.source)
    mod = types.ModuleType(f"anneal_kernel_{ks.op}_{ks.impl}".replace("-", "_"))
    mod.__file__ = str(path)
    code = compile(ks.source, str(path), "exec")
    sys.modules[mod.__name__] = mod  # Triton's @jit looks its module up
    exec(code, mod.__dict__)
    if not callable(mod.__dict__.get("build")):
        raise ValueError("the kernel source defines no callable build(**params)")
    return mod


def to_variant(ks: KernelSource):
    from anneal.engine.ops.registry import Param, Variant

    mod = load_module(ks)
    params = tuple(
        Param(name, tuple(choices), choices[0]) for name, choices in ks.params.items() if choices
    )
    return Variant(op=ks.op, impl=ks.impl, build=mod.build, params=params,
                   devices=tuple(getattr(mod, "DEVICES", ("cpu", "cuda"))),
                   description=f"run-time kernel ({len(ks.source)} bytes)", source=ks.source)


def register(ks: KernelSource) -> None:
    from anneal.engine.ops.registry import register_variant

    register_variant(to_variant(ks), replace=True)


def check_in_subprocess(
    ks: KernelSource, model_config: dict, device: str, dtype: str, timeout_s: float = 60.0
) -> KernelCheck:
    """Compile and check ``ks`` against its reference in a child process, within ``timeout_s``."""
    payload = json.dumps({"kernel": ks.model_dump(), "config": model_config,
                          "device": device, "dtype": dtype})
    t0 = time.perf_counter()
    # The child writes the source under a folder of ours, removed here whatever became of the child
    # (a kernel that hangs is killed, one that calls os._exit skips the child's atexit).
    with tempfile.TemporaryDirectory(prefix="anneal-kernel-check-") as child_dir:
        env = {**os.environ, SOURCE_DIR_ENV: child_dir}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "anneal.engine.kernel_source"], input=payload,
                capture_output=True, text=True, timeout=timeout_s, env=env,
            )
        except subprocess.TimeoutExpired:
            return KernelCheck(ok=False, stage="timeout", seconds=time.perf_counter() - t0,
                               error=f"the check did not finish within {timeout_s:g} s")
    dt = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return KernelCheck(ok=False, stage="crash", seconds=dt,
                           error=f"the checker exited with {proc.returncode}: {tail}")
    result = KernelCheck.model_validate_json(lines[-1])
    result.seconds = dt
    return result


def _check_main() -> int:
    """Child process: read {kernel, config, device, dtype} on stdin, print a KernelCheck line."""
    import torch

    from anneal.engine.config import ModelConfig
    from anneal.engine.op_inputs import compare, make_inputs
    from anneal.engine.weights import DTYPES

    req = json.loads(sys.stdin.read())
    ks = KernelSource.model_validate(req["kernel"])
    cfg = ModelConfig.model_validate(req["config"])
    dtype = DTYPES[req["dtype"]]
    device = req["device"]

    def emit(**kw: Any) -> int:
        print(KernelCheck(**kw).model_dump_json(), flush=True)
        return 0

    try:
        variant = to_variant(ks)
        fn = variant.build(**variant.defaults())
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return emit(ok=False, stage="compile", error=f"{type(e).__name__}: {e}")
    worst = 0.0
    try:
        for seed, (tokens, context) in enumerate([(1, 37), (3, 100), (8, 257)]):
            args = make_inputs(ks.op, cfg, tokens=tokens, context=context, device=device,
                               dtype=dtype, seed=1000 + seed)
            res = compare(ks.op, fn, args, dtype)
            worst = max(worst, res["max_rel_err"])
            if not res["ok"]:
                return emit(ok=False, stage="check", max_rel_err=res["max_rel_err"],
                            error=f"tokens={tokens} context={context}: {res['detail']}")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            args = make_inputs(ks.op, cfg, tokens=8, context=257, device=device, dtype=dtype)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn(*args)
            end.record()
            torch.cuda.synchronize()  # device-wide: work left on side streams is counted
            ms = start.elapsed_time(end) / 10
        else:
            ms = None
    except Exception as e:  # noqa: BLE001
        return emit(ok=False, stage="check", error=f"{type(e).__name__}: {e}", max_rel_err=worst)
    return emit(ok=True, stage="check", max_rel_err=worst, ms=ms)


if __name__ == "__main__":
    sys.exit(_check_main())
