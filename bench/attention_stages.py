#!/usr/bin/env python
"""Does decode attention lose half its bandwidth at chat's batch to a pipeline one tile deep? An
experiment for issue 5 (the chat step's largest per-kernel gap: ~9 µs a layer, sessions 8-22).

Why it might: compiled for sm_90 by Triton 3.6 (`tests/kernels/compile_sm90.py`, session 25), the
split kernel's loop at ``num_stages`` 2-4 keeps *one* shared-memory buffer for K and one for V: each
iteration waits for its tile (``async_wait num=0``), computes, and only then requests the next, so a
program never has a tile in flight while it computes. The block-table load before the K/V loads is
an indirection, and Triton spends the stages on it first: K/V get two buffers from ``num_stages`` 5
(the in-loop wait then leaves the next tile in flight), three from 7. The declared configs stopped at
4, so no sweep or tuner ever ran the kernel double-buffered. At 12 x 800 a split holds four 64-token
tiles, so each program's time is about four serial DRAM round trips, whatever the config — which is
what the sweeps saw (47-54% at every config, session 8; 51% at best, session 12).

Measured: the engine's kernel, one call per cache copy captured in a CUDA graph (copies beyond L2),
replays timed by CUDA events behind a sleep kernel, median of --reps; µs per call and the share of
the copy roofline its K/V bytes make, per (batch, context, config). Every config's output is checked
against the first config's on the same inputs: a pipeline depth changes no arithmetic, so they must
agree exactly.
Prediction: at 12 x 800, ``num_stages`` 5 (block_n 64) or 7 (block_n 32) 16-19 µs → 11-13 µs; at
32 x 4096 (already at the roofline) no change.
Measured (session 25, H200, bench/results/attention-stages-s25-call2-2026-12-03.json): **missed**.
At 12 x 800 the default 20.4 µs, the best 17.8 (block_n 32, 5 stages: -13%, 52% of the roofline);
at 4 x 800 every auto-split config 10.7-11.7 µs. Depth pays where programs hold many tiles (12 x
2048 at split 2: 45.6 → 36.1 µs, block_n 32 61.9 → 41.0), not at chat's four tiles a program: the
~9 µs a call is not the pipeline. In the 8B decode step at bs 12 the deeper configs read -0.7% to
+0%, at bs 16 up to +4% (decode-batch-s25-call2).

    python bench/attention_stages.py                # CUDA; JSON to bench/results/
    python bench/attention_stages.py --device cpu   # Triton interpreter, tiny shapes: checks only
                                                    # that every config gives the same output
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from anneal.engine.kernels.attention_decode import paged_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_layout import HEAD_DIM, HEADS, make_caches, shape_inputs  # noqa: E402
from common import (copy_bandwidth_gbps, premise_holds, probe_dtype, probe_parser, shape_pairs,  # noqa: E402
                    time_graph, write_probe)

# (block_n, num_stages) pairs around the buffer counts Triton 3.6 gives the loop (1 up to 4, 2 at 5-6,
# 3 at 7-8), at the auto split and at two fixed ones
DEPTHS = [(64, 2), (64, 4), (64, 5), (32, 2), (32, 5), (32, 7), (16, 7)]


def configs(splits: tuple[int, ...]) -> list[dict]:
    """Every depth at each split count (0: the kernel's auto split; 1: no split, no merge kernel)."""
    return [dict(split_k=s, block_n=n, num_stages=st) for s in splits for n, st in DEPTHS]


def same_outputs(device, dtype, configs) -> float:
    """Largest difference of any config's output from the first config's, on one set of inputs."""
    gen = torch.Generator(device=device).manual_seed(0)
    batch, ctx = (3, 100) if device.type == "cpu" else (12, 800)
    (k, v, bt), = make_caches(batch, ctx, 1, "nhd", device, dtype, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    lens = torch.tensor([ctx] + [max(1, ctx - 37 * i) for i in range(1, batch)], dtype=torch.int32, device=device)
    outs = [paged_decode_attention(q, k, v, bt, lens, 0.088, **cfg) for cfg in configs]
    return max((o.float() - outs[0].float()).abs().max().item() for o in outs)


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=60)
    ap.add_argument("--shapes", default="4x800,12x800,16x800,12x2048,32x4096")
    ap.add_argument("--splits", default="0,2,8", help="split counts to time every depth at (0 = auto)")
    args = ap.parse_args(argv)
    cfgs = configs(tuple(int(x) for x in args.splits.split(",")))
    device = torch.device(args.device)
    dtype = probe_dtype(device)
    # a pipeline's depth changes only when tiles arrive, never the order of the arithmetic; the split
    # count and the tile size do change it, so outputs are compared within one (split, block_n)
    groups = {(c["split_k"], c["block_n"]) for c in cfgs}
    worst = max(same_outputs(device, dtype, [c for c in cfgs if (c["split_k"], c["block_n"]) == g])
                for g in sorted(groups))
    if not premise_holds(f"depths of one (split, block_n) against each other, same inputs: max |diff| {worst:.3g}",
                         worst == 0.0, "pipeline depths disagree: a config changed the arithmetic"):
        return 1
    if device.type != "cuda":
        return 0
    bw = copy_bandwidth_gbps()
    rows = []
    for batch, ctx in shape_pairs(args.shapes):
        kv_bytes, copies, qs, lens, caches = shape_inputs(batch, ctx, ("nhd",), device, dtype)
        sets = caches["nhd"]
        floor_us = kv_bytes / (bw * 1e9) * 1e6
        for cfg in cfgs:
            def call(i, cfg=cfg):
                k, v, bt = sets[i]
                paged_decode_attention(qs[i], k, v, bt, lens, 0.088, **cfg)
            us = time_graph(call, copies, args.reps)
            row = {"batch": batch, "context": ctx, **cfg, "floor_us": round(floor_us, 2), "us": round(us, 2),
                   "of_roofline": round(floor_us / us, 3)}
            rows.append(row)
            print(f"b={batch:3d} ctx={ctx:5d} {json.dumps(cfg):52s} {us:7.2f} µs ({floor_us / us:.0%})",
                  file=sys.stderr, flush=True)
        del sets, qs
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = f"{r['batch']}x{r['context']}"
        base = best.setdefault(key, {"default_us": None, "best": None})
        if r["split_k"] == 0 and (r["block_n"], r["num_stages"]) == DEPTHS[0]:  # the kernel's defaults
            base["default_us"] = r["us"]
        if base["best"] is None or r["us"] < base["best"]["us"]:
            base["best"] = {k: r[k] for k in ("us", "of_roofline", "split_k", "block_n", "num_stages")}
    for key, b in best.items():
        print(f"{key}: default {b['default_us']} µs, best {b['best']}", file=sys.stderr)
    write_probe("attention-stages", args.out, device, copy_gbps=bw, reps=args.reps, rows=rows, best=best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
