#!/usr/bin/env python
"""Is decode attention at 50% of its roofline because of the KV cache's layout? An experiment for
issue 5 (the chat step's largest per-kernel gap).

Why it might: session 11's bs=12 profile (8B, context 800) put `_decode_split_kernel` at 16.0 µs
plus a 2.7 µs merge for 39 MB of K/V, ~51% of copy bandwidth, in every declared config. The cache
is ``[blocks, block_size, kv_heads, head_dim]`` (NHD): one kv head's 64-token tile is 64 rows of
256 B, 2 KB apart, each request a separate short burst. In ``[blocks, kv_heads, block_size,
head_dim]`` (HND) the same tile is four contiguous 4 KB runs. The kernel takes the cache's strides,
so the HND cache is passed as a permuted view: the same kernel, only the addresses differ.

Measured (the engine's own kernel, one call per cache copy captured in a CUDA graph, the graph's
replays timed by CUDA events behind a sleep kernel, median of --reps; the copies together exceed
L2; block tables a random permutation of each copy's blocks): µs per call and the share of copy bandwidth (measured here)
that the K/V bytes of the call make, for NHD and HND at each (batch, context, config).
Prediction: HND 20-35% faster at batch >= 8 for the same config; at batch 1 a wash. If HND is not
faster, the layout is not the cause and the cache stays as it is.
Measured (session 12, H200, bench/results/attention-layout-2026-11-30-s12-call3.json): HND x0.98-1.02
at every shape and config. The kernel reaches the roofline at 32 x 4096 and loses a fixed ~9 µs per
call at short contexts (51% at 12 x 800): the layout stays.

    python bench/attention_layout.py                # CUDA; JSON to bench/results/
    python bench/attention_layout.py --device cpu   # Triton interpreter, tiny shapes: checks only
                                                    # that both layouts give the same output
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

from anneal.engine.kernels.attention_decode import paged_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (copy_bandwidth_gbps, premise_holds, probe_dtype, probe_parser, shape_pairs,  # noqa: E402
                    time_graph, write_probe)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # llama-3.1-8b, the engine's block size
CONFIGS = [dict(split_k=0, block_n=64)] + [
    dict(split_k=s, block_n=n, num_warps=w) for s, n, w in itertools.product((4, 8, 16), (32, 64, 128), (4, 8))]


def make_caches(batch: int, ctx: int, copies: int, layout: str, device, dtype, gen):
    """``copies`` (k, v, block_tables) sets; k/v shaped [blocks, BLOCK, KV_HEADS, D] as the kernel
    wants them, stored NHD or HND underneath."""
    per_seq = -(-ctx // BLOCK)
    nb = batch * per_seq
    out = []
    for _ in range(copies):
        if layout == "nhd":
            k = torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
            v = torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
        else:
            k = torch.randn(nb, KV_HEADS, BLOCK, HEAD_DIM, device=device, dtype=dtype, generator=gen).transpose(1, 2)
            v = torch.randn(nb, KV_HEADS, BLOCK, HEAD_DIM, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(nb)).to(device)
        bt = perm.view(batch, per_seq).to(torch.int32)
        out.append((k, v, bt))
    return out


def shape_inputs(batch: int, ctx: int, layouts: tuple[str, ...], device, dtype):
    """One (batch, context) shape's timing inputs: its K/V bytes, the copy count that exceeds L2, a
    query set per copy, the context lengths and the cache copies per layout."""
    kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    copies = max(2, -(-120 * 2**20 // kv_bytes))  # more than twice the H200's 50 MB of L2
    gen = torch.Generator(device=device).manual_seed(batch * 100_000 + ctx)
    qs = [torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen) for _ in range(copies)]
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    caches = {lay: make_caches(batch, ctx, copies, lay, device, dtype, gen) for lay in layouts}
    return kv_bytes, copies, qs, lens, caches


def same_output(device, dtype) -> float:
    """Largest difference between the two layouts on the same values (they must agree exactly)."""
    gen = torch.Generator(device=device).manual_seed(0)
    batch, ctx = 3, 40
    (k, v, bt), = make_caches(batch, ctx, 1, "nhd", device, dtype, gen)
    k_hnd = k.permute(0, 2, 1, 3).contiguous().transpose(1, 2)
    v_hnd = v.permute(0, 2, 1, 3).contiguous().transpose(1, 2)
    assert k_hnd.stride(1) == HEAD_DIM and k_hnd.stride(2) == BLOCK * HEAD_DIM  # HND underneath
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    lens = torch.tensor([ctx, 17, 1], dtype=torch.int32, device=device)
    a = paged_decode_attention(q, k, v, bt, lens, 0.088, split_k=2, block_n=16)
    b = paged_decode_attention(q, k_hnd, v_hnd, bt, lens, 0.088, split_k=2, block_n=16)
    return (a.float() - b.float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=60)
    ap.add_argument("--shapes", default="1x800,12x800,12x4096,32x1024,32x4096")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = probe_dtype(device)
    diff = same_output(device, dtype)
    if not premise_holds(f"NHD vs HND, same values: max |diff| {diff:.3g}", diff == 0.0,
                         "the layouts disagree: the kernel does not honour the cache's strides"):
        return 1
    if device.type != "cuda":
        return 0
    bw = copy_bandwidth_gbps()
    rows = []
    for batch, ctx in shape_pairs(args.shapes):
        kv_bytes, copies, qs, lens, caches = shape_inputs(batch, ctx, ("nhd", "hnd"), device, dtype)
        floor_us = kv_bytes / (bw * 1e9) * 1e6
        for cfg in CONFIGS:
            row = {"batch": batch, "context": ctx, **cfg, "floor_us": round(floor_us, 2)}
            for lay, sets in caches.items():
                def call(i, sets=sets):
                    k, v, bt = sets[i]
                    paged_decode_attention(qs[i], k, v, bt, lens, 0.088, **cfg)
                us = time_graph(call, copies, args.reps)
                row[f"{lay}_us"] = round(us, 2)
                row[f"{lay}_of_roofline"] = round(floor_us / us, 3)
            row["hnd_speedup"] = round(row["nhd_us"] / row["hnd_us"], 3)
            rows.append(row)
            print(f"b={batch:3d} ctx={ctx:5d} {json.dumps(cfg):58s} NHD {row['nhd_us']:7.2f} µs "
                  f"({row['nhd_of_roofline']:.0%})  HND {row['hnd_us']:7.2f} µs ({row['hnd_of_roofline']:.0%})  "
                  f"x{row['hnd_speedup']:.3f}", file=sys.stderr, flush=True)
        del caches, qs
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = f"{r['batch']}x{r['context']}"
        for lay in ("nhd", "hnd"):
            cur = best.setdefault(key, {}).get(lay)
            if cur is None or r[f"{lay}_us"] < cur["us"]:
                best[key][lay] = {"us": r[f"{lay}_us"], "of_roofline": r[f"{lay}_of_roofline"],
                                  "config": {k: r[k] for k in ("split_k", "block_n", "num_warps") if k in r}}
    for key, b in best.items():
        print(f"best at {key}: NHD {b['nhd']['us']} µs ({b['nhd']['of_roofline']:.0%}) {b['nhd']['config']}; "
              f"HND {b['hnd']['us']} µs ({b['hnd']['of_roofline']:.0%}) {b['hnd']['config']}", file=sys.stderr)
    write_probe("attention-layout", args.out, device, copy_gbps=bw, reps=args.reps, rows=rows, best=best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
