"""Shared benchmark plumbing: environment facts, rooflines, timing statistics, result files."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return env


def _cpu_model() -> str:
    """The host CPU's model name: a plan without overlap scheduling spends host time in every decode
    step, so a replay's ratio to it can move with the host (session 35: `triton.json`'s chat decode
    steps ran 4-8% faster than in session 31 on another lease of the same GPU; host or code, not told
    apart then)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def copy_bandwidth_gbps(nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Device-to-device copy, counting bytes read plus bytes written (the roofline we use)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def time_graph(fn, n_inputs: int, reps: int) -> float:
    """Median µs of one call: every input set called once inside a CUDA graph (as the engine runs
    its decode step), the graph replayed ``reps`` times behind a sleep kernel that holds its launch.
    Why not events around each eager call: a wrapper's host work (checks, allocations, launches)
    can outlast its kernels; session 12's first attention-layout probe timed the host (~150 µs)."""
    for i in range(n_inputs):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_inputs):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / n_inputs)
    return statistics.median(times)


def summarize(samples_s: list[float]) -> dict:
    xs = sorted(samples_s)
    q = lambda p: xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]  # noqa: E731
    return {
        "median_ms": statistics.median(xs) * 1e3,
        "p10_ms": q(0.1) * 1e3,
        "p90_ms": q(0.9) * 1e3,
        "n": len(xs),
    }


def print_variant_row(row: dict, width: int) -> None:
    """One probe variant's row as a line: its name, then every measured field (floats to 4 digits)."""
    print(f"{row['variant']:<{width}} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in row.items() if k != "variant"), flush=True)


def probe_parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The device probes' shared options (bench/attention_layout.py, blas_backend.py,
    prefill_attention.py): ``--device`` (cuda; cpu checks only the probe's premise), ``--reps``,
    ``--out``. Each probe adds its own shapes."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out", default=None)
    return ap


def premise_holds(says: str, ok: bool, otherwise: str) -> bool:
    """A device probe's premise, checked before any timing (on the CPU it is all the probe does):
    ``says`` is the line tests/kernels/test_bench_cpu.py looks for, ``otherwise`` why the timings
    would mean nothing when the premise fails."""
    print(says, file=sys.stderr)
    if not ok:
        print(otherwise, file=sys.stderr)
    return ok


def shape_pairs(spec: str) -> list[tuple[int, int]]:
    """``"4x800,12x800"`` as ``[(4, 800), (12, 800)]``: the probes' ``--shapes``."""
    return [tuple(int(x) for x in shape.split("x")) for shape in spec.split(",")]


def probe_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU (what the engine serves); fp32 on the CPU, where the interpreter's checks
    compare exactly."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def write_probe(name: str, out: str | None, device: torch.device, *, reps: int, rows: list[dict],
                copy_gbps: float | None = None, **extra) -> Path:
    """A device probe's result file (bench/attention_layout.py, blas_backend.py, prefill_attention.py):
    environment, GPU, the copy bandwidth its rooflines use (memory-bound probes), its repetitions and
    rows, and ``extra``; prints where it went."""
    bw = {} if copy_gbps is None else {"copy_gbps": copy_gbps}
    path = write_result(name, {"env": environment(), "gpu": torch.cuda.get_device_name(device), **bw,
                               "reps": reps, "rows": rows, **extra}, Path(out) if out else None)
    print(json.dumps({"wrote": str(path)}))
    return path


def write_result(name: str, data: dict, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    day = dt.date.today().isoformat()
    path = out_dir / f"{name}-{day}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return path
