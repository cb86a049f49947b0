#!/usr/bin/env python
"""Does cuBLASLt (or cuBLAS without reduced-precision split-K sums) run the decode projections
faster than the cuBLAS torch picks by default? An experiment for issue 5.

Why it might: at the chat replay's batches (6-16 rows) the 8B decode step is ~80% weight-streaming
GEMMs, and session 11's bs=12 profile put o_proj at 61% and qkv_proj at 75% of their bytes' time
(cuBLAS chose split-K + a separate reduce kernel for o and down). torch routes bf16 GEMMs through
cuBLAS's classic API unless ``torch.backends.cuda.preferred_blas_library("cublaslt")``; cuBLASLt
has its own heuristics (and a workspace) and may pick other kernels for small M. A second knob,
``allow_bf16_reduced_precision_reduction``, restricts the split-K kernels cuBLAS may choose.

Measured: for each projection of llama-3.1-8b and llama-3.2-1b and each row count M, ``F.linear``
under every (backend, reduced-precision) setting, one call per weight copy captured in a CUDA graph
(copies together beyond L2), replays timed by CUDA events (``common.time_graph``), median of
--reps. Reported: µs, share of the copy roofline for the weight bytes, the ratio to the default
setting, and whether the output is bit-identical to the default's (identical outputs suggest the
same kernel). At M=12 the kernels each setting launches are listed (torch.profiler).

Prediction: cuBLASLt within ±3% of cuBLAS at most shapes; if it wins, it is at o/down (split-K
shapes) by 10-30%, which would be ~3-5% of the chat step.

    python bench/blas_backend.py                 # CUDA; JSON to bench/results/
    python bench/blas_backend.py --device cpu    # checks only that every setting computes F.linear
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, probe_parser, time_graph, write_probe  # noqa: E402

# (N, K) of each projection's weight
PROJECTIONS = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "lm_head": (128256, 2048)},
}
SETTINGS = {  # name -> (preferred BLAS library, allow bf16 reduced-precision reduction)
    "cublas": ("cublas", True),  # torch's default
    "cublas-fp32-reduce": ("cublas", False),
    "cublaslt": ("cublaslt", True),
    "cublaslt-fp32-reduce": ("cublaslt", False),
}


@contextlib.contextmanager
def blas_setting(name: str):
    library, reduced = SETTINGS[name]
    old_lib = torch.backends.cuda.preferred_blas_library()
    old_reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.preferred_blas_library(library)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old_lib)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old_reduced


def kernels_launched(x, w, setting: str) -> list[str]:
    """Names of the CUDA kernels one ``F.linear`` launches under ``setting``."""
    from torch.profiler import ProfilerActivity, profile

    with blas_setting(setting):
        F.linear(x, w)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.linear(x, w)
            torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name]


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=40)
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--rows", default="1,4,6,8,10,12,14,16,24,32,64,128",
                    help="row counts M, comma-separated, or START:STOP:STEP (a prompt step's token buckets)")
    ap.add_argument("--ops", default=None, help="projections to time (default: all)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":  # every setting must still compute F.linear (the settings only pick kernels)
        x, w = torch.randn(5, 64), torch.randn(48, 64)
        for name in SETTINGS:
            with blas_setting(name):
                torch.testing.assert_close(F.linear(x, w), x @ w.T)
        print("every setting computes F.linear", file=sys.stderr)
        return 0
    bw = copy_bandwidth_gbps()
    rows_m = (list(range(*map(int, args.rows.split(":")))) if ":" in args.rows
              else [int(m) for m in args.rows.split(",")])
    rows, kernels = [], {}
    for model in args.models.split(","):
        for op, (n, k) in PROJECTIONS[model].items():
            if args.ops and op not in args.ops.split(","):
                continue
            w_bytes = n * k * 2
            copies = max(2, -(-120 * 2**20 // w_bytes))  # more than twice the H200's 50 MB of L2
            gen = torch.Generator(device=device).manual_seed(n * 7 + k)
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
            for m in rows_m:
                xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
                floor_us = (w_bytes + m * (n + k) * 2) / (bw * 1e9) * 1e6
                row = {"model": model, "op": op, "m": m, "n": n, "k": k, "floor_us": round(floor_us, 2)}
                outs = {}
                for name in SETTINGS:
                    with blas_setting(name):
                        us = time_graph(lambda i: F.linear(xs[i], ws[i]), copies, args.reps)
                        outs[name] = F.linear(xs[0], ws[0])
                    row[f"{name}_us"] = round(us, 2)
                    row[f"{name}_of_roofline"] = round(floor_us / us, 3)
                for name in SETTINGS:
                    row[f"{name}_vs_default"] = round(row["cublas_us"] / row[f"{name}_us"], 3)
                    row[f"{name}_bit_identical"] = bool(torch.equal(outs[name], outs["cublas"]))
                rows.append(row)
                best = max(SETTINGS, key=lambda s: row[f"{s}_vs_default"])
                print(f"{model:13s} {op:8s} M={m:4d} floor {floor_us:7.2f} µs  "
                      + "  ".join(f"{s} {row[f'{s}_us']:7.2f}" for s in SETTINGS)
                      + f"  best {best} x{row[f'{best}_vs_default']:.3f}", file=sys.stderr, flush=True)
                if m == 12:
                    kernels[f"{model}/{op}"] = {s: kernels_launched(xs[0], ws[0], s) for s in SETTINGS}
                del xs
            del ws
            torch.cuda.empty_cache()
    write_probe("blas-backend", args.out, device, copy_gbps=bw, reps=args.reps, rows=rows, kernels_m12=kernels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
