#!/usr/bin/env python
"""Decode attention and o_proj in one persistent kernel, joined by per-tile flags (issue 5).

Sessions 28-30 left one lever unmeasured for the batch-12 decode step: its small kernels each read
30-50 MB and none of them gets past ~72% of copy bandwidth (session 30: even flat contiguous reads
of 39 MB take 12.85 µs), so the step loses at every kernel's ramp, not at the boundaries PDL can
hide. Session 18's persistent layer lost on its grid barriers (2.6-2.8 µs each); what it named as
the next try is dependencies per tile. This probe measures that on the pair with the largest gap:
decode attention (split 16.6 + merge 2.9 µs for 9.4 µs of K/V at 12 x 800) and o_proj (13.9 µs for
8.0 µs of W).

One launch of ``P`` programs (a few an SM) pulls tiles from a queue (an atomic ticket), in order:
  1. attention tiles, kv-head major: (kv head g, sequence b, split s), the engine split kernel's
     loop (``_attend_tile``); the last split of (b, g) to finish merges (``_merge_head``, as the
     engine's ``merge="ticket"``) and writes attention's bf16 output, then counts one more
     sequence done for kv head g (release);
  2. o_proj tiles, one a ``BLOCK_O`` slice of the output columns for every row: over the kv heads
     in order, each head group's W columns are requested *before* waiting for that group's count
     (acquire), then multiplied with the group's attention output (``tl.dot``, rows padded to 16).
A program holding an o tile waits only for tiles already taken by running programs (the queue hands
out every attention tile first), so nothing can deadlock whatever the residency. The last program
out resets the counters: a CUDA graph replays it as is. No atomics touch data: the output is
deterministic, and bit-equal to attention's bf16 output through a dot (the separate pair's
numerics up to the GEMM's summation order).

Variants timed, every layer its own K/V cache and W_o (copies beyond L2), in one CUDA graph:
  ``separate_cublas``   the engine's attention (auto split, merge kernel) then F.linear
  ``separate_gemv``     the same, o_proj as the Triton GEMV at session 29's best M=12 tiles (n32, split 4)
  ``fused_p{k}_o{n}_s{x}_w{w}``  this kernel: k programs an SM, BLOCK_O n, split x, w warps

Prediction (session 32, before the first run): at 12 x 800 the pair reads 72.5 MB (17.1 µs at 4.23
TB/s); separately it takes ~33-36 µs (attention 20.5, o 13.5); as one stream of 72.5 MB with the
o tiles' W requested while attention's tail runs, ~24-27 µs (-8 to -10 µs a layer, -0.3 ms a step,
~6% of chat's step). If the fused pair is not faster by > 3 µs, per-tile flags do not pay in Triton
here and the persistent-layer line closes with session 18's.

    python bench/attention_oproj.py                # CUDA; JSON to bench/results/
    python bench/attention_oproj.py --device cpu   # Triton interpreter, tiny shapes: checks only
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from anneal.engine.kernels._common import cdiv, dot_precision, dot_upcast, interpreting, mma, pow2, sm_count
from anneal.engine.kernels.attention_decode import (_attend_tile, _merge_head, _split_len, auto_split_k,
                                                    paged_decode_attention)
from anneal.engine.kernels.gemv import small_m_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (copy_bandwidth_gbps, premise_holds, print_variant_row, probe_dtype, probe_parser,  # noqa: E402
                    shape_pairs, time_graph, write_probe)

PAD = tl.constexpr(32)  # int32 counters 128 B apart: one L2 line each, so polls of one do not queue behind another's arrivals
# counter slots: [0] the tile ticket, [1] programs finished, [2 + g] sequences done for kv head g; then
# the merge tickets, one a (sequence, kv head)


@triton.jit
def _spin_until(ptr, target, SLEEP: tl.constexpr):
    """Poll the counter at ``ptr`` (acquire) until it reaches ``target``; later loads see what the
    arrivals released."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        if SLEEP:  # back off between polls (compiled only: the interpreter has no PTX)
            tl.inline_asm_elementwise("nanosleep.u32 200; mov.u32 $0, $1;", "=r,r", [seen], dtype=tl.int32,
                                      is_pure=False, pack=1)
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _attn_o_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, w_ptr, attn_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr,
    scale_log2, B, H, N, max_tokens,
    stride_qb, stride_qh, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_wn, stride_ab, stride_ob,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    BS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SLEEP: tl.constexpr,
):
    GD: tl.constexpr = G * D
    n_attn = HKV * B * SPLIT_K
    n_tiles = n_attn + tl.cdiv(N, BLOCK_O)
    ticket_ptr = cnt_ptr
    finished_ptr = cnt_ptr + PAD
    done_ptr = cnt_ptr + 2 * PAD  # + g * PAD
    merge_ptr = cnt_ptr + (2 + HKV) * PAD  # + b * HKV + g
    g_i = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gm = g_i < G
    tile = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    while tile < n_tiles:
        if tile < n_attn:
            # -- attention tile (kv head, sequence, split): the engine split kernel's loop
            kvh = tile // (B * SPLIT_K)
            b = (tile // SPLIT_K) % B
            s = tile % SPLIT_K
            ctx = tl.minimum(tl.load(lens_ptr + b), max_tokens)
            split_len = _split_len(ctx, SPLIT_K, BLOCK_N)
            start = s * split_len
            if (s == 0) | (start < ctx):  # an empty split reports nothing (split 0 always does)
                end = tl.minimum(start + split_len, ctx)
                heads = kvh * G + g_i
                q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None],
                            other=0.0)
                bt_row = bt_ptr + b.to(tl.int64) * stride_bt
                m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_G], tl.float32)
                acc = tl.zeros([BLOCK_G, D], tl.float32)
                for n0 in range(start, end, BLOCK_N):
                    t = n0 + tl.arange(0, BLOCK_N)
                    tm = t < end
                    blk = tl.load(bt_row + t // BS, mask=tm, other=0).to(tl.int64)
                    tok = t % BS
                    k = tl.load(kc_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                                mask=tm[:, None], other=0.0)
                    v = tl.load(vc_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                                mask=tm[:, None], other=0.0)
                    m_i, l_i, acc = _attend_tile(q, k, v, tm, m_i, l_i, acc, scale_log2, PREC, UPCAST, False)
                out_row = attn_ptr + b * stride_ab
                if SPLIT_K == 1:
                    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                    tl.store(out_row + heads[:, None] * D + d[None, :], o.to(attn_ptr.dtype.element_ty),
                             mask=gm[:, None])
                    tl.debug_barrier()  # every thread's stores before the release
                    tl.atomic_add(done_ptr + kvh * PAD, 1, sem="release", scope="gpu")
                else:
                    row = (b * H + heads) * SPLIT_K + s  # partials [B, H, SPLIT_K, (D)], as the engine's
                    tl.store(po_ptr + row.to(tl.int64)[:, None] * D + d[None, :], acc, mask=gm[:, None])
                    tl.store(pm_ptr + row, m_i, mask=gm)
                    tl.store(pl_ptr + row, l_i, mask=gm)
                    tl.debug_barrier()
                    n_valid = tl.maximum(tl.cdiv(ctx, split_len), 1)
                    cnt = merge_ptr + b * HKV + kvh
                    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
                    if arrived == n_valid - 1:  # the last split of (b, kv head): merge, then count it done
                        for gi in tl.static_range(G):
                            h = kvh * G + gi
                            _merge_head(out_row + h * D, po_ptr, pm_ptr, pl_ptr, (b * H + h) * SPLIT_K, n_valid,
                                        D, D, SPLIT_K, ".cg")
                        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
                        tl.debug_barrier()
                        tl.atomic_add(done_ptr + kvh * PAD, 1, sem="release", scope="gpu")
        else:
            # -- o_proj tile: output columns [n0, n0 + BLOCK_O) for every row, kv head group by group
            n0 = (tile - n_attn) * BLOCK_O
            on = n0 + tl.arange(0, BLOCK_O)
            om = on < N
            m = tl.arange(0, BLOCK_M)
            mm = m < B
            c = tl.arange(0, GD)
            w_rows = w_ptr + on.to(tl.int64)[:, None] * stride_wn + c[None, :]
            w = tl.load(w_rows, mask=om[:, None], other=0.0)  # group 0's W, before any wait
            acc_o = tl.zeros([BLOCK_M, BLOCK_O], tl.float32)
            for g in range(HKV):
                # the next group's W is requested before this group's count is polled
                w_next = tl.load(w_rows + (g + 1) * GD, mask=om[:, None] & (g + 1 < HKV), other=0.0)
                _spin_until(done_ptr + g * PAD, B, SLEEP)
                x = tl.load(attn_ptr + m[:, None] * stride_ab + g * GD + c[None, :], mask=mm[:, None], other=0.0,
                            cache_modifier=".cg")
                acc_o += mma(x, tl.trans(w), PREC, UPCAST)
                w = w_next
            tl.store(out_ptr + m[:, None] * stride_ob + on[None, :], acc_o.to(out_ptr.dtype.element_ty),
                     mask=mm[:, None] & om[None, :])
        tile = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    # the last program out leaves every counter at zero for the next launch
    out_order = tl.atomic_add(finished_ptr, 1, sem="acq_rel", scope="gpu")
    if out_order == tl.num_programs(0) - 1:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
        for g in range(HKV):
            tl.atomic_xchg(done_ptr + g * PAD, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(finished_ptr, 0, sem="relaxed", scope="gpu")


class Workspace:
    """One shape's scratch for the fused kernel: the attention output, the split partials and the
    counters (zeros, and zeros again after every launch)."""

    def __init__(self, B: int, H: int, Hkv: int, D: int, split_k: int, device, dtype):
        self.attn = torch.empty(B, H * D, device=device, dtype=dtype)
        n = max(split_k, 1)
        self.po = torch.empty(B, H, n, D, device=device, dtype=torch.float32)
        self.pm = torch.empty(B, H, n, device=device, dtype=torch.float32)
        self.pl = torch.empty(B, H, n, device=device, dtype=torch.float32)
        self.counters = torch.zeros((2 + Hkv) * PAD.value + B * Hkv, device=device, dtype=torch.int32)


def attention_oproj(q, k_cache, v_cache, block_tables, lens, scale: float, w_o, *, split_k: int = 0,
                    block_n: int = 64, block_o: int = 32, per_sm: int = 2, programs: int = 0, num_warps: int = 4,
                    num_stages: int = 2, sleep: int = 0, ws: Workspace | None = None) -> torch.Tensor:
    """``paged_decode_attention(q, ...).view(B, H * D) @ w_o.T`` in one persistent launch (module doc).
    ``q`` [B, H, D]; caches [blocks, BS, Hkv, D]; ``w_o`` [N, H * D]; ``split_k`` 0 = the engine's auto
    split; ``programs`` 0 = ``per_sm`` an SM (on the CPU: 3)."""
    B, H, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = H // Hkv
    N = w_o.shape[0]
    assert w_o.shape[1] == H * D and w_o.stride(1) == 1 and D == pow2(D) and (G * D) == pow2(G * D)
    max_tokens = block_tables.shape[1] * BS
    if split_k == 0:
        split_k = auto_split_k(B, Hkv, max_tokens, block_n, q.device)
    ws = ws or Workspace(B, H, Hkv, D, split_k, q.device, q.dtype)
    out = torch.empty(B, N, device=q.device, dtype=q.dtype)
    n_tiles = Hkv * B * split_k + cdiv(N, block_o)
    if programs == 0:
        programs = 3 if q.device.type == "cpu" else per_sm * sm_count(q.device)
    programs = min(programs, n_tiles)
    LOG2E = 1.4426950408889634
    _attn_o_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, lens, w_o, ws.attn, out, ws.po, ws.pm, ws.pl, ws.counters,
        float(scale) * LOG2E, B, H, N, max_tokens,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), w_o.stride(0), ws.attn.stride(0), out.stride(0),
        HKV=Hkv, G=G, BLOCK_G=pow2(G, 16), D=D, BLOCK_N=block_n, BS=BS, SPLIT_K=split_k, BLOCK_M=pow2(B, 16),
        BLOCK_O=block_o, PREC=dot_precision(q.dtype), UPCAST=dot_upcast(), SLEEP=0 if interpreting() else sleep,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def attention_oproj_reference(q, k_cache, v_cache, block_tables, lens, scale: float, w_o) -> torch.Tensor:
    """The pair in fp32 torch, one sequence at a time: softmax over the sequence's cached tokens."""
    B, H, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        t = torch.arange(n, device=q.device)
        blk = block_tables[b, t // BS].long()
        k = k_cache[blk, t % BS].float().repeat_interleave(G, dim=1)  # [n, H, D]
        v = v_cache[blk, t % BS].float().repeat_interleave(G, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out.view(B, H * D) @ w_o.float().T


def make_inputs(B: int, ctx: int | list[int], H: int, Hkv: int, D: int, N: int, device, dtype, gen, *, BS: int = 16,
                spare: int = 0):
    """q, caches (blocks shuffled), block tables, lengths and W_o for one layer; ``ctx`` one length or
    one per sequence; ``spare`` extra block-table columns past the longest sequence (never read)."""
    lens = [ctx] * B if isinstance(ctx, int) else list(ctx)
    per_seq = max(1, cdiv(max(lens), BS)) + spare
    nb = B * per_seq
    k = torch.randn(nb, BS, Hkv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(nb, BS, Hkv, D, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(nb)).to(device)
    bt = perm.view(B, per_seq).to(torch.int32)
    q = torch.randn(B, H, D, device=device, dtype=dtype, generator=gen)
    w = torch.randn(N, H * D, device=device, dtype=dtype, generator=gen) / (H * D) ** 0.5
    return q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=device), w


def separate(q, k, v, bt, lens, scale, w, *, o: str = "cublas", attn_params: dict | None = None):
    """The engine's pair as two ops: its decode attention, then o_proj by cuBLAS or the Triton GEMV."""
    a = paged_decode_attention(q, k, v, bt, lens, scale, **(attn_params or {})).view(q.shape[0], -1)
    if o == "cublas":
        return F.linear(a, w)
    return small_m_gemm(a, w, block_n=32, split_k=4)


def check_fused(device, dtype) -> float:
    """Largest error of the fused kernel against the fp32 reference, relative to the output's scale,
    over uneven lengths (one of 1 token), splits 1-4, tile sizes and program counts, each config
    launched twice on the same counters (the second launch relies on the first's reset)."""
    gen = torch.Generator(device=device).manual_seed(0)
    H, Hkv, D, N = 8, 2, 32, 48
    q, k, v, bt, lens, w = make_inputs(3, [150, 37, 1], H, Hkv, D, N, device, dtype, gen, spare=2)
    want = attention_oproj_reference(q, k, v, bt, lens, 0.2, w)
    worst = 0.0
    for split_k, block_o, programs in ((1, 16, 2), (2, 32, 3), (4, 16, 5), (0, 16, 1)):
        ws = Workspace(3, H, Hkv, D, split_k or 4, device, dtype)
        for _ in range(2):
            got = attention_oproj(q, k, v, bt, lens, 0.2, w, split_k=split_k, block_n=16, block_o=block_o,
                                  programs=programs, ws=ws)
            worst = max(worst, ((got.float() - want).abs().max() / want.abs().max()).item())
        if ws.counters.any():
            return float("inf")  # a launch left a counter set: the next one would be wrong
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=50)
    ap.add_argument("--shapes", default="1x800,4x800,12x800,16x800,12x2048")
    ap.add_argument("--configs", default="2/32/1/4/0;2/16/1/4/0;2/64/1/4/0;1/32/1/8/0;3/16/1/4/0;2/32/2/4/0;2/32/1/4/1",
                    help="fused configs, ';'-separated per_sm/block_o/split multiplier/num_warps/back-off "
                    "(1: 200 ns between polls)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = probe_dtype(device)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    worst = check_fused(device, dtype)
    if not premise_holds(f"the fused kernel computes attention then o_proj: max rel |diff| {worst:.3g}",
                         worst <= tol, "the fused kernel's output is wrong: its timing would mean nothing"):
        return 1
    if device.type != "cuda":
        return 0
    H, Hkv, D, N = 32, 8, 128, 4096  # llama-3.1-8b
    bw = copy_bandwidth_gbps()
    rows = []
    for batch, ctx in shape_pairs(args.shapes):
        gen = torch.Generator(device=device).manual_seed(batch * 100_000 + ctx)
        layer_bytes = batch * ctx * Hkv * D * 2 * 2 + N * H * D * 2
        copies = max(3, cdiv(150 * 2**20, layer_bytes))  # three times the H200's 50 MB of L2
        layers = [make_inputs(batch, ctx, H, Hkv, D, N, device, dtype, gen) for _ in range(copies)]
        scale = D ** -0.5
        want = attention_oproj_reference(*layers[0][:5], scale, layers[0][5])
        auto = auto_split_k(batch, Hkv, layers[0][3].shape[1] * 16, 64, device)
        calls = {"separate_cublas": lambda i: separate(*layers[i][:5], scale, layers[i][5]),
                 "separate_gemv": lambda i: separate(*layers[i][:5], scale, layers[i][5], o="gemv")}
        for cfg in filter(None, args.configs.split(";")):
            per_sm, block_o, mult, warps, sleep = (int(x) for x in cfg.split("/"))
            split_k = min(64, auto * mult)
            wss = [Workspace(batch, H, Hkv, D, split_k, device, dtype) for _ in range(copies)]
            name = f"fused_p{per_sm}_o{block_o}_s{split_k}_w{warps}" + ("_sleep" if sleep else "")
            calls[name] = (lambda i, p=per_sm, o=block_o, s=split_k, w=warps, z=sleep, ws=wss: attention_oproj(
                *layers[i][:5], scale, layers[i][5], split_k=s, block_o=o, per_sm=p, num_warps=w, sleep=z, ws=ws[i]))
        floor_us = layer_bytes / (bw * 1e9) * 1e6
        for name, call in calls.items():
            err = ((call(0).float() - want).abs().max() / want.abs().max()).item()
            us = time_graph(call, copies, args.reps)
            row = {"variant": f"{batch}x{ctx}-{name}", "batch": batch, "context": ctx, "us": round(us, 2),
                   "floor_us": round(floor_us, 2), "of_roofline": round(floor_us / us, 3), "rel_err": round(err, 5)}
            rows.append(row)
            print_variant_row(row, 40)
        del layers, calls
        torch.cuda.empty_cache()
    write_probe("attention-oproj", args.out, device, copy_gbps=bw, reps=args.reps, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
