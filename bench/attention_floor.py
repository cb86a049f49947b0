#!/usr/bin/env python
"""Where does decode attention's fixed ~8 µs a call go? An experiment for issue 5 (the chat step's
largest per-kernel gap: at batch 12, context 800, the split kernel and its merge take 17.8-20 µs for
K/V bytes worth 9.4 µs at copy bandwidth; sessions 12, 25 and 26 fit every shape's time as ~8 µs
plus the bytes, whatever the config, pipeline depth or cache layout).

A ladder of kernels on the engine kernel's grid (``[B, Hkv, split]``, its auto split and one tile a
program (split 16), block_n 64, 4 warps, 2 stages), each rung one step further along the split kernel's chain of dependent loads,
each writing its program's ``[D]`` sum so nothing is optimised away:
  0 ``empty``       store only: the grid's launch and ramp inside a CUDA graph
  1 ``lens``        + the sequence's context length (a load every later address depends on)
  2 ``lens_bt``     + the block-table entries of the split's first tile (the indirection)
  3 ``first_tile``  + that tile's K and V rows (one DRAM round trip)
  4 ``stream``      + every tile of the split, K + V summed: the engine's loop without its math
  ``stream_contig`` rung 4 with the blocks addressed arithmetically (no table load): the indirection's share
then the engine's kernel itself (``paged_decode_attention``) with the merge as a second kernel
(``engine_merge_kernel``) and as the last split's ticket (``engine_ticket``). Every rung reads the
tokens and rows the engine kernel's split reads (checked against torch on the CPU).

Prediction (session 30, before the run): at 12 x 800, ``empty`` 2-3 µs, each dependent load up to
rung 3 +0.5-1 µs, ``stream`` 10-12 µs (the bytes, with four serial tiles), the engine 17-18 µs: the
online softmax in series with each tile's load and the merge (~2 µs) make the ~6 µs between the
stream and the engine, not the loads. If ``stream`` is already near the engine's time, the loss is
the chain of loads at this grid and only fusing attention with its neighbours (or a persistent
kernel) moves it. At one tile a program (split 16) the four serial tiles are gone: ``stream`` near
``first_tile``, the engine's cost then the merge over 13 splits.

Measured (session 30, H200, bench/results/attention-floor-s30-call7.json; calls 4-6 timed a first
version of the stream rungs that summed each tile across warps inside the loop, 19.0 µs at 12 x 800:
the reduction, not the reads). µs a call at the auto split:

| shape | empty | lens | lens_bt | first_tile | stream | stream_hnd | flat (best) | engine (merge kernel / ticket) |
|---|---|---|---|---|---|---|---|---|
| 4 x 800 | 1.11 | 1.24 | 1.63 | 5.34 | 7.31 | 7.36 | 6.14 (50%) | 11.31 / 13.75 |
| 12 x 800 | 1.75 | 1.88 | 2.30 | 6.06 | 14.41 (64%) | 14.22 | 12.85 (72%) | 20.50 (45%) / 23.41 |
| 16 x 800 | 2.06 | 2.21 | 2.65 | 9.71 | 18.54 | 18.51 | 16.07 (77%) | 23.27 / 25.67 |
| 12 x 2048 | 2.37 | 2.48 | 2.91 | 6.34 | 28.51 | 28.38 | 27.83 (85%) | 35.10 / 37.54 |
| 32 x 4096 | 2.26 | 2.37 | 2.78 | 9.64 | 142.58 | 141.74 | 123.74 (102%) | 132.08 / 132.47 |

The length and block-table loads cost 0.5 µs together, not the ~8; the HND layout and all kv heads of
a block in one program read no faster (session 12 again). At 12 x 800 even the bytes as flat
contiguous runs take 12.85 µs: no single kernel reading 39 MB gets past ~72% of copy bandwidth.
The engine is 6.1 µs over its own read pattern there and at 12 x 2048, ~0 at 32 x 4096: per call,
the merge kernel (~3 µs in session 28's profile) and the math in series with each tile's load
(~2 µs) are what a better decode attention could still win; the other ~6 µs over the bytes only
fusing attention with its neighbours moves. The ticket merge is slower than the merge kernel at
every shape here (+2.4-3 µs at the auto split, +7.6 at split 16).
At the deeper pipelines (call 8, `attention-floor-s30-call8-configs.json`, 12 x 800, auto split) the
engine at block_n 32 / 5 stages takes 17.81 µs against its stream rung's 15.48: the double buffer
hides the math, and what is left over the reads (~2.3 µs) is about the merge kernel.

    python bench/attention_floor.py                # CUDA; JSON to bench/results/
    python bench/attention_floor.py --device cpu   # Triton interpreter, tiny shapes: checks only
                                                   # that every rung reads the engine's tokens
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import cdiv
from anneal.engine.kernels.attention_decode import _split_len, auto_split_k, paged_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_layout import BLOCK, HEAD_DIM, KV_HEADS, make_caches, shape_inputs  # noqa: E402
from common import (copy_bandwidth_gbps, premise_holds, print_variant_row, probe_dtype, probe_parser,  # noqa: E402
                    shape_pairs, time_graph, write_probe)

BLOCK_N = 64  # the engine kernel's default tile
RUNGS = {"empty": (0, False), "lens": (1, False), "lens_bt": (2, False), "first_tile": (3, False),
         "stream": (4, False), "stream_contig": (4, True)}


@triton.jit
def _ladder_kernel(kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, stride_bt, stride_kb, stride_kt, stride_kh, per_seq,
                   RUNG: tl.constexpr, CONTIG: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                   D: tl.constexpr, SPLIT_K: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    row = (b * tl.num_programs(1) + kvh) * SPLIT_K + s
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    tile_acc = tl.zeros([BLOCK_N, D], tl.float32)
    if RUNG >= 1:
        ctx = tl.load(lens_ptr + b)
        acc += ctx.to(tl.float32)
        split_len = _split_len(ctx, SPLIT_K, BLOCK_N)
        start = s * split_len
        end = tl.minimum(start + split_len, ctx)
        stop = end
        if RUNG < 4:
            stop = tl.minimum(end, start + BLOCK_N)  # the first tile only
        if RUNG >= 2:
            for n0 in range(start, stop, BLOCK_N):
                t = n0 + tl.arange(0, BLOCK_N)
                tm = t < stop
                if CONTIG:
                    blk = (b * per_seq + t // BS).to(tl.int64)
                else:
                    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + t // BS, mask=tm, other=0).to(tl.int64)
                if RUNG == 2:
                    acc += tl.sum(tl.where(tm, blk, 0)).to(tl.float32)
                else:  # summed row by row, across the tile's rows once at the end: no reduction in the loop
                    off = (blk * stride_kb + (t % BS) * stride_kt + kvh * stride_kh)[:, None] + d[None, :]
                    k = tl.load(kc_ptr + off, mask=tm[:, None], other=0.0)
                    v = tl.load(vc_ptr + off, mask=tm[:, None], other=0.0)
                    tile_acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * D + d, acc + tl.sum(tile_acc, axis=0))


def ladder(rung: int, contig: bool, k, v, bt, lens, split_k: int, out: torch.Tensor, *, num_warps: int = 4,
           num_stages: int = 2, block_n: int = BLOCK_N) -> torch.Tensor:
    """One rung over every (sequence, kv head, split) of the engine kernel's grid, into ``out``
    (``[B * Hkv * split_k, D]`` fp32); K and V share strides, as the engine's caches do."""
    B = bt.shape[0]
    _ladder_kernel[(B, KV_HEADS, split_k)](
        k, v, bt, lens, out, bt.stride(0), k.stride(0), k.stride(1), k.stride(2), bt.shape[1],
        RUNG=rung, CONTIG=contig, BLOCK_N=block_n, BS=BLOCK, D=HEAD_DIM, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _all_heads_kernel(kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, stride_bt, stride_kb,
                      BS: tl.constexpr, ROW: tl.constexpr, SPLIT_K: tl.constexpr):
    """Rung 4 with every kv head of a token read by one program: a cache block ``[BS, Hkv, D]`` is
    one contiguous run (32 KB for the 8B), where a per-head program reads 256-B rows 2 KB apart."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, SPLIT_K), BS) * BS, BS)
    start = s * split_len
    end = tl.minimum(start + split_len, ctx)
    r = tl.arange(0, ROW)
    acc = tl.zeros([BS, ROW], tl.float32)
    for n0 in range(start, end, BS):
        t = n0 + tl.arange(0, BS)
        tm = t < end
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // BS).to(tl.int64)
        off = blk * stride_kb + (t % BS)[:, None] * ROW + r[None, :]
        k = tl.load(kc_ptr + off, mask=tm[:, None], other=0.0)
        v = tl.load(vc_ptr + off, mask=tm[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + (b * SPLIT_K + s).to(tl.int64) * ROW + r, tl.sum(acc, axis=0))


def all_heads(k, v, bt, lens, split_k: int, out: torch.Tensor, *, num_warps: int = 8, num_stages: int = 2):
    """The all-heads stream over ``[B, split_k]`` programs into ``out`` (``[B * split_k, Hkv * D]``);
    needs an NHD cache (``[blocks, BS, Hkv, D]`` contiguous)."""
    assert k.is_contiguous() and v.is_contiguous()
    _all_heads_kernel[(bt.shape[0], split_k)](
        k, v, bt, lens, out, bt.stride(0), k.stride(0), BS=BLOCK, ROW=KV_HEADS * HEAD_DIM, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages)
    return out


def all_heads_reference(k, v, bt, lens, split_k: int) -> torch.Tensor:
    B = bt.shape[0]
    out = torch.zeros(B, split_k, KV_HEADS * HEAD_DIM, dtype=torch.float32)
    for b in range(B):
        ctx = int(lens[b])
        split_len = max(cdiv(cdiv(ctx, split_k), BLOCK) * BLOCK, BLOCK)
        for s in range(split_k):
            for t in range(s * split_len, min(s * split_len + split_len, ctx)):
                blk = int(bt[b, t // BLOCK])
                out[b, s] += (k[blk, t % BLOCK].float() + v[blk, t % BLOCK].float()).reshape(-1)
    return out.view(-1, KV_HEADS * HEAD_DIM)


@triton.jit
def _flat_read_kernel(k_ptr, v_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """The same K and V bytes read as two flat arrays, each program one contiguous run of each: what
    reading this many bytes in one kernel costs with no paging, no heads and no tiles."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * per_program
    r = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, per_program, BLOCK):
        acc += tl.load(k_ptr + base + off + r).to(tl.float32) + tl.load(v_ptr + base + off + r).to(tl.float32)
    tl.store(out_ptr + pid.to(tl.int64) * BLOCK + r, acc)


FLAT_BLOCK = 2048


def flat_programs(numel: int, target: int) -> int:
    """The largest program count <= ``target`` that splits ``numel`` into whole FLAT_BLOCK runs."""
    runs = numel // FLAT_BLOCK
    return max(p for p in range(1, min(target, runs) + 1) if runs % p == 0)


def flat_read(k, v, programs: int, out: torch.Tensor) -> torch.Tensor:
    """K and V summed as flat arrays over ``programs`` contiguous runs into ``out`` (``[programs, FLAT_BLOCK]``)."""
    assert k.numel() % (FLAT_BLOCK * programs) == 0
    _flat_read_kernel[(programs,)](k, v, out, k.numel() // programs, BLOCK=FLAT_BLOCK, num_warps=8)
    return out


def ladder_reference(rung: int, contig: bool, k, v, bt, lens, split_k: int) -> torch.Tensor:
    """What each rung's programs sum, in torch: the split ranges the engine kernel computes."""
    B, per_seq = bt.shape
    out = torch.zeros(B, KV_HEADS, split_k, HEAD_DIM, dtype=torch.float32)
    for b in range(B):
        ctx = int(lens[b])
        split_len = max(cdiv(cdiv(ctx, split_k), BLOCK_N) * BLOCK_N, BLOCK_N)  # the kernel's _split_len
        for h in range(KV_HEADS):
            for s in range(split_k):
                acc = torch.zeros(HEAD_DIM)
                if rung >= 1:
                    acc += ctx
                    start, end = s * split_len, min(s * split_len + split_len, ctx)
                    stop = end if rung >= 4 else min(end, start + BLOCK_N)
                    for t in range(start, stop):
                        blk = b * per_seq + t // BLOCK if contig else int(bt[b, t // BLOCK])
                        if rung == 2:
                            acc += blk
                        elif rung >= 3:
                            acc += k[blk, t % BLOCK, h].float() + v[blk, t % BLOCK, h].float()
                out[b, h, s] = acc
    return out.view(-1, HEAD_DIM)


def check_rungs(device, dtype) -> float:
    """Largest relative difference of any rung from its torch sums, on a batch of uneven lengths."""
    gen = torch.Generator(device=device).manual_seed(0)
    batch, ctx = 3, 150
    (k, v, bt), = make_caches(batch, ctx, 1, "nhd", device, dtype, gen)
    (kh, vh, bth), = make_caches(batch, ctx, 1, "hnd", device, dtype, gen)  # the stream rung on an HND cache
    lens = torch.tensor([ctx, 97, 1], dtype=torch.int32, device=device)
    split_k, p = 2, flat_programs(k.numel(), 8)
    per_head = lambda: torch.empty(batch * KV_HEADS * split_k, HEAD_DIM, dtype=torch.float32, device=device)  # noqa: E731
    pairs = [(ladder(rung, contig, k, v, bt, lens, split_k, per_head()),
              ladder_reference(rung, contig, k.cpu(), v.cpu(), bt.cpu(), lens.cpu(), split_k))
             for rung, contig in RUNGS.values()]
    pairs.append((ladder(4, False, kh, vh, bth, lens, split_k, per_head()),
                  ladder_reference(4, False, kh.cpu(), vh.cpu(), bth.cpu(), lens.cpu(), split_k)))
    pairs.append((all_heads(k, v, bt, lens, split_k * 4, torch.empty(batch * split_k * 4, KV_HEADS * HEAD_DIM,
                                                                     dtype=torch.float32, device=device)),
                  all_heads_reference(k.cpu(), v.cpu(), bt.cpu(), lens.cpu(), split_k * 4)))
    pairs.append((flat_read(k, v, p, torch.empty(p, FLAT_BLOCK, dtype=torch.float32, device=device)),
                  (k.float() + v.float()).reshape(p, -1, FLAT_BLOCK).sum(1).cpu()))
    return max(((got.cpu() - want).abs().max() / want.abs().max().clamp(min=1.0)).item() for got, want in pairs)


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=60)
    ap.add_argument("--shapes", default="1x800,4x800,12x800,16x800,12x2048")
    ap.add_argument("--configs", default="", help="extra engine configs, ';'-separated block_n/num_stages/num_warps "
                    "(e.g. 32/5/4): the engine (merge kernel) and the stream rung at each, beside the defaults")
    ap.add_argument("--splits", default="0,16", help="split counts (0: the engine's auto split; 16: one "
                    "64-token tile a program at context 800-1024)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = probe_dtype(device)
    worst = check_rungs(device, dtype)
    if not premise_holds(f"every rung sums the tokens the engine kernel's splits read: max rel |diff| {worst:.3g}",
                         worst <= 1e-4, "a rung reads other tokens than the engine kernel: its timing would mean nothing"):
        return 1
    if device.type != "cuda":
        return 0
    bw = copy_bandwidth_gbps()
    rows = []
    for batch, ctx in shape_pairs(args.shapes):
        kv_bytes, copies, qs, lens, caches = shape_inputs(batch, ctx, ("nhd", "hnd"), device, dtype)
        sets, hnd = caches["nhd"], caches["hnd"]
        floor_us = kv_bytes / (bw * 1e9) * 1e6
        for want in dict.fromkeys(int(x) for x in args.splits.split(",")):
            split_k = want or auto_split_k(batch, KV_HEADS, sets[0][2].shape[1] * BLOCK, BLOCK_N, device)
            outs = [torch.empty(batch * KV_HEADS * split_k, HEAD_DIM, dtype=torch.float32, device=device)
                    for _ in range(copies)]
            calls = {name: (lambda i, r=rung, c=contig: ladder(r, c, *sets[i], lens, split_k, outs[i]))
                     for name, (rung, contig) in RUNGS.items()}
            # what the stream rung needs to read at the copy roofline: a deeper / wider program, the
            # HND layout (each head's block one 4-KB run), every kv head of a block in one program
            calls["stream_w8_st4"] = lambda i: ladder(4, False, *sets[i], lens, split_k, outs[i], num_warps=8,
                                                      num_stages=4)
            calls["stream_n128_w8"] = lambda i: ladder(4, False, *sets[i], lens, split_k, outs[i], num_warps=8,
                                                       block_n=128)
            calls["stream_hnd"] = lambda i: ladder(4, False, *hnd[i], lens, split_k, outs[i])
            wide = [torch.empty(batch * split_k * KV_HEADS, KV_HEADS * HEAD_DIM, dtype=torch.float32, device=device)
                    for _ in range(copies)]
            for mult in (1, 2, KV_HEADS):  # all-heads splits: split_k x 1 / 2 / 8 (8: as many programs as per head)
                calls[f"all_heads_x{mult}"] = (lambda i, m=mult: all_heads(*sets[i], lens, split_k * m, wide[i]))
            if want == 0:  # once a shape: the bytes as flat runs over ~1, 4 and 16 programs an SM
                for per_sm in (1, 4, 16):
                    n = flat_programs(sets[0][0].numel(), per_sm * 132)
                    flat = [torch.empty(n, FLAT_BLOCK, dtype=torch.float32, device=device) for _ in range(copies)]
                    calls[f"flat_p{n}"] = lambda i, n=n, f=flat: flat_read(sets[i][0], sets[i][1], n, f[i])
            for cfg in filter(None, args.configs.split(";")):  # the engine's deeper pipelines beside its reads
                bn, st, w = (int(x) for x in cfg.split("/"))
                calls[f"stream_{cfg}"] = lambda i, bn=bn, st=st, w=w: ladder(4, False, *sets[i], lens, split_k, outs[i],
                                                                          num_warps=w, num_stages=st, block_n=bn)
                calls[f"engine_{cfg}"] = lambda i, bn=bn, st=st, w=w: paged_decode_attention(
                    qs[i], *sets[i], lens, 0.088, split_k=split_k, block_n=bn, num_stages=st, num_warps=w)
            for merge in ("kernel", "ticket"):
                calls[f"engine_{'merge_kernel' if merge == 'kernel' else 'ticket'}"] = (
                    lambda i, m=merge: paged_decode_attention(qs[i], *sets[i], lens, 0.088, split_k=split_k,
                                                              block_n=BLOCK_N, merge=m))
            for name, call in calls.items():
                us = time_graph(call, copies, args.reps)
                row = {"variant": f"{batch}x{ctx}-s{split_k}-{name}", "batch": batch, "context": ctx,
                       "split_k": split_k, "auto_split": want == 0,
                       "programs": (int(name[6:]) if name.startswith("flat_p") else
                                    batch * split_k * (int(name[11:]) if name.startswith("all_heads_x") else KV_HEADS)),
                       "us": round(us, 2), "floor_us": round(floor_us, 2), "of_roofline": round(floor_us / us, 3)}
                rows.append(row)
                print_variant_row(row, 36)
            del outs, wide, calls
        del sets, hnd, qs, caches
        torch.cuda.empty_cache()
    write_probe("attention-floor", args.out, device, copy_gbps=bw, reps=args.reps, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
