#!/usr/bin/env python
"""How fast does the decode GEMV stream a projection's weight-only fp8 copy, or its bf12 copy, against
the same GEMV on the bf16 weight and cuBLAS? An experiment for issues 4 and 5 (engine/fp8_weights.py,
engine/bf12_weights.py).

Why: a decode step at small batch is W's bytes over the copy bandwidth; e4m3 halves W. The step
can only gain what the kernel keeps of that: if it streams fp8 at the share of the copy roofline
it streams bf16 at, each projection takes ~half the time.

Measured: for each projection of llama-3.1-8b and llama-3.2-1b and each row count M, cuBLAS
(``F.linear``, bf16), the Triton GEMV on bf16 W and on its fp8 copy, each over a few kernel configs,
one call per weight copy captured in a CUDA graph (copies together beyond L2), replays timed by
CUDA events (``common.time_graph``), median of --reps. Reported: µs of the best config of each,
its share of the copy roofline for the bytes it must read (fp8: 1 byte an element + a float per
row), the fp8 GEMV's ratio to the best bf16 one, and its largest error against
``fp8_weights.reference_linear``.

Session 44 adds bf12 (1.5 bytes a weight, near-lossless; the dot path only) and num_stages 4.
Prediction for bf12: 0.78-0.85x the bf16 GEMV's time on the 8B's projections (its roofline is 0.75x;
the decode of the exponent codes is integer work hidden under the loads).

Session 45: the bf12 unpack in PTX (``unpack="asm"``, 8 instructions for 4 weights; ``bf12int`` is
Triton's integer version beside it). Its loop compiles to ~290 instructions a thread for 64 weights
against ~660 (bf16's: ~125). Prediction: bf12 at 0.76-0.80x bf16 on gate_up / down (near its own
roofline, as bf16 is near its), qkv / o 0.80-0.85x (their small grids); bf12int as in session 44.

Prediction: fp8 at 0.55-0.65x the bf16 GEMV's time for the large projections (gate_up, down of the
8B: more bytes in flight are needed per program, so the best fp8 configs take block_k 256-512),
worse (0.7-0.9x) for the 1B's small ones, where a launch's fixed cost is a larger share.

    python bench/fp8_gemv.py                  # CUDA; JSON to bench/results/
    python bench/fp8_gemv.py --device cpu     # checks only that the fp8 GEMV computes its reference
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blas_backend import PROJECTIONS  # noqa: E402  ((N, K) of each projection's weight)
from common import copy_bandwidth_gbps, premise_holds, probe_parser, time_graph, write_probe  # noqa: E402

# GEMV configs tried for both weight formats (max_m 0: the GEMV at every M)
CONFIGS = [
    {},
    {"reduce": "ticket"},
    {"block_k": 256, "reduce": "ticket"},
    {"block_n": 32, "block_k": 256, "reduce": "ticket"},
    {"block_n": 128, "block_k": 128, "reduce": "ticket"},
    {"block_k": 512, "reduce": "ticket", "num_warps": 8},
    {"num_stages": 4, "reduce": "ticket"},
    {"block_k": 256, "num_stages": 4, "reduce": "ticket"},
    {"block_n": 32, "block_k": 256, "num_stages": 4, "reduce": "ticket"},
]
BF12_CONFIGS = [  # session 45: the bf12 GEMV's tiles around session 44's best (block_n 32, block_k 256)
    {"block_n": 16, "block_k": 256, "reduce": "ticket"},
    {"block_n": 16, "block_k": 512, "reduce": "ticket"},
    {"block_n": 32, "block_k": 128, "reduce": "ticket"},
    {"block_n": 32, "block_k": 512, "reduce": "ticket"},
    {"block_n": 32, "block_k": 256, "reduce": "ticket", "num_warps": 2},
    {"block_n": 32, "block_k": 256, "reduce": "ticket", "num_warps": 8},
    {"block_n": 64, "block_k": 256, "reduce": "ticket", "num_warps": 8},
    {"block_n": 32, "block_k": 256, "reduce": "ticket", "split_k": 1},
    {"block_n": 32, "block_k": 256, "reduce": "ticket", "split_k": 2},
    {"block_n": 32, "block_k": 256, "reduce": "ticket", "split_k": 4},
]
M1_CONFIGS = [  # a single row: the register-FMA path too
    {"m1": "fma", "reduce": "ticket"},
    {"m1": "fma", "block_k": 256, "reduce": "ticket"},
    {"m1": "fma", "block_n": 128, "block_k": 128, "reduce": "ticket", "ahead": 2},
    {"m1": "fma", "block_n": 32, "block_k": 512, "reduce": "ticket"},
]


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=40)
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--formats", default="bf16,fp8,bf12",
                    help="the GEMV's weight formats to time (bf12int: bf12 unpacked by Triton's integer ops)")
    ap.add_argument("--bf12-tiles", action="store_true", help="bf12 over BF12_CONFIGS too (session 45)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from anneal.engine import bf12_weights as b12
    from anneal.engine import fp8_weights as f8
    from anneal.engine.ops.registry import build_op

    if device.type != "cuda":
        x, w = torch.randn(3, 96), torch.randn(40, 96)
        got = build_op("o_proj", "triton_gemv_fp8", {"max_m": 0, "block_k": 64})(x, w)
        ok = torch.allclose(got, f8.reference_linear(x, f8.fp8_of(w)), rtol=1e-4, atol=1e-4)
        xb, wb = x.bfloat16(), w.bfloat16()
        got = build_op("o_proj", "triton_gemv_bf12", {"max_m": 0, "block_k": 64})(xb, wb)
        ok = ok and torch.allclose(got.float(), b12.reference_linear(xb, b12.bf12_of(wb)).float(), rtol=2e-2, atol=2e-2)
        return 0 if premise_holds("the fp8 and bf12 GEMVs compute their references", ok, "a copy's GEMV is wrong") else 1
    bw = copy_bandwidth_gbps()
    rows = []
    for model in args.models.split(","):
        for op, (n, k) in PROJECTIONS[model].items():
            if op == "lm_head":  # stays bf16 in fp8 plans
                continue
            copies = max(2, -(-150 * 2**20 // (n * k)))  # fp8 copies together ~3x the H200's 50 MB of L2
            gen = torch.Generator(device=device).manual_seed(n * 7 + k)
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * k ** -0.5
                  for _ in range(copies)]
            for w in ws:
                f8.fp8_of(w)
                b12.bf12_of(w)
            for m in (int(r) for r in args.rows.split(",")):
                xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
                act = m * (n + k) * 2
                floor = {fmt: (b + act) / (bw * 1e9) * 1e6
                         for fmt, b in (("bf16", n * k * 2), ("fp8", n * k + 4 * n), ("bf12", n * k * 3 // 2 + 4 * n))}
                row = {"model": model, "op": op, "m": m, "n": n, "k": k,
                       **{f"floor_{fmt}_us": round(f, 2) for fmt, f in floor.items()}}
                row["cublas_us"] = round(time_graph(lambda i: F.linear(xs[i], ws[i]), copies, args.reps), 2)
                floor["bf12int"] = floor["bf12"]
                for fmt, impl in (("bf16", "triton_gemv_splitk"), ("fp8", "triton_gemv_fp8"),
                                  ("bf12", "triton_gemv_bf12"), ("bf12int", "triton_gemv_bf12")):
                    if fmt not in args.formats.split(","):
                        continue
                    best, every = None, []
                    extra = BF12_CONFIGS if fmt.startswith("bf12") and args.bf12_tiles else []
                    # bf12int: the same GEMV unpacking in Triton's integer ops (session 44's), beside the PTX
                    fixed = {"unpack": "int"} if fmt == "bf12int" else {}
                    for cfg in CONFIGS + extra + (M1_CONFIGS if m == 1 and not fmt.startswith("bf12") else []):
                        try:
                            fn = build_op(f"{op}_proj", impl, {"max_m": 0, **fixed, **cfg})
                            us = time_graph(lambda i: fn(xs[i], ws[i]), copies, args.reps)
                        except Exception as e:  # a config that does not fit is a result, not a crash
                            print(f"{model} {op} m={m} {fmt} {cfg}: {type(e).__name__}: {str(e)[:200]}",
                                  file=sys.stderr)
                            continue
                        every.append({"config": cfg, "us": round(us, 2)})  # what a plan's tiles cost (session 44)
                        if best is None or us < best[0]:
                            best = (us, cfg, fn)
                    if best is None:
                        continue
                    us, cfg, fn = best
                    row[f"{fmt}_us"] = round(us, 2)
                    row[f"{fmt}_of_roofline"] = round(floor[fmt] / us, 3)
                    row[f"{fmt}_config"] = cfg
                    row[f"{fmt}_configs"] = every
                    if fmt != "bf16":
                        ref = (f8.reference_linear(xs[0], f8.fp8_of(ws[0])) if fmt == "fp8"
                               else b12.reference_linear(xs[0], b12.bf12_of(ws[0]))).float()
                        row[f"{fmt}_max_rel_err"] = float(((fn(xs[0], ws[0]).float() - ref).abs().max()
                                                           / ref.abs().max()).item())
                    if fmt != "bf16" and "bf16_us" in row:
                        row[f"{fmt}_vs_bf16"] = round(row[f"{fmt}_us"] / row["bf16_us"], 3)
                row["bf12_flushed"] = b12.bf12_of(ws[0]).flushed
                print(row, flush=True)
                rows.append(row)
            del ws
            torch.cuda.empty_cache()
    write_probe("fp8-gemv", args.out, device, reps=args.reps, rows=rows, copy_gbps=bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
