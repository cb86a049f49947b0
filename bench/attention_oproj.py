#!/usr/bin/env python
"""Decode attention and o_proj in one persistent kernel, joined by per-tile flags (issue 5).

Sessions 28-30 left one lever unmeasured for the batch-12 decode step: its small kernels each read
30-50 MB and none of them gets past ~72% of copy bandwidth (session 30: even flat contiguous reads
of 39 MB take 12.85 µs), so the step loses at every kernel's ramp, not at the boundaries PDL can
hide. Session 18's persistent layer lost on its grid barriers (2.6-2.8 µs each); what it named as
the next try is dependencies per tile. This probe measures that on the pair with the largest gap:
decode attention (split 16.6 + merge 2.9 µs for 9.4 µs of K/V at 12 x 800) and o_proj (13.9 µs for
8.0 µs of W).

One launch of ``P`` programs (a few an SM) pulls tiles from a queue (an atomic ticket):
  * attention tiles (kv head g, sequence b, split s): the engine split kernel's loop
    (``_attend_tile``); the last split of (b, g) to finish merges (``_merge_head``, as the engine's
    ``merge="ticket"``), writes attention's bf16 output and counts one more sequence done for g
    (release);
  * o tiles (group g, column block r): the group's share of o_proj, ``attn[:, g] @ W[r, g].T``, its
    first W chunk requested before waiting for g's count (acquire); the last group of a column block
    to finish sums the eight shares in order (fp32) into the bf16 output.
The queue holds attention of kv heads 0 .. lag-1, then for each later head its attention followed by
the o tiles of the head ``lag`` before it, then the last o tiles (``lag`` = Hkv: every o tile after
all of attention). An o tile waits only for attention tiles earlier in the queue, which never wait:
no deadlock whatever the residency (with the ticket's order). The last program out zeroes the
counters, so a CUDA graph replays the launch as is. No atomics touch data: the output is deterministic.

Variants timed, every layer its own K/V cache and W_o (copies beyond L2), in one CUDA graph:
  ``separate_cublas`` / ``separate_gemv``   the engine's attention (auto split, merge kernel), then
                        F.linear / the Triton GEMV at session 29's best M=12 tiles (n32, split 4)
  ``engine_attention``, ``cublas_o``        the two halves of ``separate_cublas`` alone
  ``fused_<config>``    this kernel (``parse_config``: p programs an SM, o block_o, l lag, t stages,
                        x split, r maxnreg; A / O attention's or the o tiles alone, F first tile by
                        program id)

Prediction (session 32, before the first run): at 12 x 800 the pair reads 72.5 MB (17.1 µs at 4.23
TB/s); separately it takes ~33-36 µs; as one stream with the o tiles' W requested while attention's
tail runs, ~24-27 µs (-8 to -10 µs a layer, ~6% of chat's step). If the fused pair is not faster by
> 3 µs, per-tile flags do not pay in Triton here and the persistent-layer line closes with session 18's.

Measured (session 32, H200, ``bench/results/attention-oproj-s32-call{2..6}-*.json``; every fused
output within the separate pair's error of the fp32 reference), µs a layer:

| shape | separate (cuBLAS / GEMV) | engine attention + cuBLAS o alone | best fused | its attention alone / o alone |
|---|---|---|---|---|
| 1 x 800 | 21.0 / 19.9 | 7.1 + 13.4 | 26.3-27.7 | 12.2 / 16.7 |
| 4 x 800 | 25.9 / 24.3 | 11.7 + 13.5 | 30.3 | 17.4 / 17.1 |
| 12 x 800 | 34.9 / 33.1 | 20.9 + 14.0 | **37.8** (p2 o64 l8 t3 F) | 30.8 / 18.1 |
| 16 x 800 | 37.1 / 35.8 | 23.6 + 14.0 | 40.7 | 35.7 / 18.7 |
| 12 x 2048 | 47.9 / 47.1 | 34.7 + 14.0 | 55.6-57.8 | 50.2 / 18.4 |

The overlap works: all o tiles after all of attention (``l8``) runs 11 µs under the sum of its own
halves at 12 x 800 (37.8 against 30.8 + 18.1). But each half is slower in the persistent kernel than
as its own kernel, attention by ~10 µs (the ticket merge, the claims and releases, tiles done in
series by ~2 programs an SM: ~200 registers a thread against the split kernel's 95) and o_proj by
~4, more than the overlap returns. Tried against it: the first design (an o tile a column block over
all eight groups, W one group ahead; 48.9 µs), 1-5 programs an SM, ``maxnreg`` 96-128 (4-5 an SM, no
spills: no faster), static tile order, the queue's lag 0-8, block_o 16-128, splits 1-2x the auto
split, W before the wait, counters reset by stores: none comes within 3 µs of the separate pair.

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

from anneal.engine.kernels._common import cdiv, dot_precision, dot_upcast, mma, pow2, sm_count
from anneal.engine.kernels.attention_decode import (_attend_tile, _merge_head, _split_len, auto_split_k,
                                                    paged_decode_attention)
from anneal.engine.kernels.gemv import small_m_gemm
from anneal.engine.ops.reference import attention_decode as attention_decode_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (copy_bandwidth_gbps, premise_holds, print_variant_row, probe_dtype, probe_parser,  # noqa: E402
                    shape_pairs, time_graph, write_probe)

PAD = tl.constexpr(32)  # int32 counters 128 B apart: one L2 line each, so polls of one do not queue behind another's arrivals
# counter slots: [0] the tile ticket, [1] programs finished, [2 + g] sequences done for kv head g; then
# the merge tickets, one a (sequence, kv head), then the o sums' tickets, one a column block


@triton.jit
def _spin_until(ptr, target):
    """Poll the counter at ``ptr`` (acquire) until it reaches ``target``; later loads see what the
    arrivals released."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _attention_tile(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, attn_ptr, po_ptr, pm_ptr, pl_ptr, merge_ptr, done_ptr,
                    kvh, b, s, scale_log2, H, max_tokens, stride_qb, stride_qh, stride_bt,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ab,
                    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, BS: tl.constexpr, SPLIT_K: tl.constexpr, PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
    """(kv head, sequence, split): the engine split kernel's loop; the last split of (sequence, kv
    head) merges and counts the sequence done for the kv head (release)."""
    g_i = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gm = g_i < G
    ctx = tl.minimum(tl.load(lens_ptr + b), max_tokens)
    split_len = _split_len(ctx, SPLIT_K, BLOCK_N)
    start = s * split_len
    if (s == 0) | (start < ctx):  # an empty split reports nothing (split 0 always does)
        end = tl.minimum(start + split_len, ctx)
        heads = kvh * G + g_i
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
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
            tl.store(out_row + heads[:, None] * D + d[None, :], o.to(attn_ptr.dtype.element_ty), mask=gm[:, None])
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
                tl.store(cnt, 0)  # a plain store: nothing else touches it this launch
                tl.debug_barrier()
                tl.atomic_add(done_ptr + kvh * PAD, 1, sem="release", scope="gpu")


@triton.jit
def _o_tile(w_ptr, attn_ptr, out_ptr, op_ptr, osum_ptr, done_ptr, g, r, B, N, stride_wn, stride_ab, stride_ob,
            HKV: tl.constexpr, GD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
            BLOCK_K: tl.constexpr, WAIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """(kv head group g, column block r): the group's share of o_proj, ``attn[:, g] @ W[r, g].T``,
    once the group's B sequences are done; the last group of a column block to finish sums the
    groups' shares in order (fp32, deterministic) into the bf16 output."""
    on = r * BLOCK_O + tl.arange(0, BLOCK_O)
    om = on < N
    m = tl.arange(0, BLOCK_M)
    mm = m < B
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + on.to(tl.int64)[:, None] * stride_wn
    # the group's first W chunk is requested before the wait (W depends on nothing this launch writes)
    w = tl.load(w_rows + (g * GD + kk)[None, :], mask=om[:, None], other=0.0)
    if WAIT:
        _spin_until(done_ptr + g * PAD, B)
    x = tl.load(attn_ptr + m[:, None] * stride_ab + (g * GD + kk)[None, :], mask=mm[:, None], other=0.0,
                cache_modifier=".cg")
    acc = mma(x, tl.trans(w), PREC, UPCAST)
    for k0 in range(g * GD + BLOCK_K, g * GD + GD, BLOCK_K):
        w = tl.load(w_ptr + on.to(tl.int64)[:, None] * stride_wn + (k0 + kk)[None, :], mask=om[:, None], other=0.0)
        x = tl.load(attn_ptr + m[:, None] * stride_ab + (k0 + kk)[None, :], mask=mm[:, None], other=0.0,
                    cache_modifier=".cg")
        acc = acc + mma(x, tl.trans(w), PREC, UPCAST)
    share = op_ptr + (g * B + m)[:, None].to(tl.int64) * N + on[None, :]  # shares [HKV, B, N] fp32
    tl.store(share, acc, mask=mm[:, None] & om[None, :])
    tl.debug_barrier()
    arrived = tl.atomic_add(osum_ptr + r, 1, sem="acq_rel", scope="gpu")
    if arrived == HKV - 1:
        total = tl.zeros([BLOCK_M, BLOCK_O], tl.float32)
        for gg in range(HKV):
            total += tl.load(op_ptr + (gg * B + m)[:, None].to(tl.int64) * N + on[None, :],
                             mask=mm[:, None] & om[None, :], other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + m[:, None] * stride_ob + on[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=mm[:, None] & om[None, :])
        tl.store(osum_ptr + r, 0)  # a plain store: nothing else touches it this launch


@triton.jit
def _attn_o_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, w_ptr, attn_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, op_ptr, cnt_ptr,
    scale_log2, B, H, N, max_tokens,
    stride_qb, stride_qh, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_wn, stride_ab, stride_ob,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    BS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
    LAG: tl.constexpr, PARTS: tl.constexpr, ORDER: tl.constexpr, RESET: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # The queue, in segments: attention of kv heads 0 .. LAG-1; then for g = LAG .. HKV-1 attention of
    # g followed by the o tiles of group g - LAG; then the o tiles of the last LAG groups. An o tile
    # waits only for attention tiles earlier in the queue, which never wait: no deadlock.
    a_g = B * SPLIT_K
    o_g = tl.cdiv(N, BLOCK_O)
    head = LAG * a_g
    mid = (HKV - LAG) * (a_g + o_g)
    n_tiles = head + mid + LAG * o_g
    if PARTS == 1:  # attention's tiles alone (the probe's split of the time)
        n_tiles = HKV * a_g
    elif PARTS == 2:  # the o tiles alone, without waiting (on whatever attn holds)
        n_tiles = HKV * o_g
    ticket_ptr = cnt_ptr
    finished_ptr = cnt_ptr + PAD
    done_ptr = cnt_ptr + 2 * PAD  # + g * PAD
    merge_ptr = cnt_ptr + (2 + HKV) * PAD  # + b * HKV + g
    osum_ptr = merge_ptr + B * HKV  # + column block
    # ORDER 0: every tile from the ticket; 1: program i takes tiles i, i + P, ...; 2: its first tile i,
    # then P + the ticket's (1 and 2 skip the claim's round trip, but are only safe with every program
    # resident at once)
    if ORDER == 0:
        tile = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    else:
        tile = tl.program_id(0)
    while tile < n_tiles:
        attn_g = -1
        o_grp = -1
        r = tile
        if PARTS == 1:
            attn_g = tile // a_g
            r = tile % a_g
        elif PARTS == 2:
            o_grp = tile // o_g
            r = tile % o_g
        elif tile < head:
            attn_g = tile // a_g
            r = tile % a_g
        elif tile < head + mid:
            seg = (tile - head) // (a_g + o_g)
            r = (tile - head) % (a_g + o_g)
            if r < a_g:
                attn_g = LAG + seg
            else:
                o_grp = seg
                r = r - a_g
        else:
            o_grp = HKV - LAG + (tile - head - mid) // o_g
            r = (tile - head - mid) % o_g
        if attn_g >= 0:
            _attention_tile(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, attn_ptr, po_ptr, pm_ptr, pl_ptr, merge_ptr,
                            done_ptr, attn_g, r // SPLIT_K, r % SPLIT_K, scale_log2, H, max_tokens, stride_qb,
                            stride_qh, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_ab, HKV, G, BLOCK_G, D, BLOCK_N, BS, SPLIT_K, PREC, UPCAST)
        else:
            _o_tile(w_ptr, attn_ptr, out_ptr, op_ptr, osum_ptr, done_ptr, o_grp, r, B, N, stride_wn, stride_ab,
                    stride_ob, HKV, G * D, BLOCK_M, BLOCK_O, BLOCK_K, PARTS == 3, PREC, UPCAST)
        if ORDER == 1:
            tile += tl.num_programs(0)
        elif ORDER == 2:
            tile = tl.num_programs(0) + tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        else:
            tile = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    # the last program out leaves every counter at zero for the next launch
    out_order = tl.atomic_add(finished_ptr, 1, sem="acq_rel", scope="gpu")
    if out_order == tl.num_programs(0) - 1:  # ticket, finished and every kv head's count: one store
        slot = tl.arange(0, RESET)
        tl.store(cnt_ptr + slot * PAD, tl.zeros([RESET], tl.int32), mask=slot < 2 + HKV)


PARTS = {"attention": 1, "o": 2, "both": 3}
ORDERS = {"ticket": 0, "static": 1, "first": 2}


class Workspace:
    """One shape's scratch for the fused kernel: the attention output, the split partials, the o
    shares and the counters (zeros, and zeros again after every launch)."""

    def __init__(self, B: int, H: int, Hkv: int, D: int, split_k: int, N: int, device, dtype, *, block_o: int = 16):
        self.attn = torch.empty(B, H * D, device=device, dtype=dtype)
        n = max(split_k, 1)
        self.po = torch.empty(B, H, n, D, device=device, dtype=torch.float32)
        self.pm = torch.empty(B, H, n, device=device, dtype=torch.float32)
        self.pl = torch.empty(B, H, n, device=device, dtype=torch.float32)
        self.op = torch.empty(Hkv, B, N, device=device, dtype=torch.float32)
        self.counters = torch.zeros((2 + Hkv) * PAD.value + B * Hkv + cdiv(N, block_o), device=device,
                                    dtype=torch.int32)
        self.shape = (B, H, Hkv, D, n, N, block_o)


def attention_oproj(q, k_cache, v_cache, block_tables, lens, scale: float, w_o, *, split_k: int = 0,
                    block_n: int = 64, block_o: int = 64, block_k: int = 128, lag: int = 1, per_sm: int = 2,
                    programs: int = 0, num_warps: int = 4, num_stages: int = 2, maxnreg: int = 0, parts: str = "both",
                    order: str = "ticket", ws: Workspace | None = None) -> torch.Tensor:
    """``paged_decode_attention(q, ...).view(B, H * D) @ w_o.T`` in one persistent launch (module doc).
    ``q`` [B, H, D]; caches [blocks, BS, Hkv, D]; ``w_o`` [N, H * D]; ``split_k`` 0 = the engine's auto
    split; ``lag``: the o tiles of kv head g enter the queue behind attention of g + lag;
    ``programs`` 0 = ``per_sm`` an SM (on the CPU: 3); ``maxnreg`` caps the registers a thread (0: the
    compiler's choice, ~150-200 where the engine's split kernel takes 95: two or three programs an SM). For the probe's split of the time, ``parts``
    "attention" runs only attention's tiles and "o" only the o tiles (no waits, on whatever the
    workspace holds); ``order`` "static" hands program i the tiles i, i + P, ... instead of the ticket's
    order, "first" its first tile i and then the ticket's (both deadlock-free only when every program
    is resident at once: never on the interpreter)."""
    B, H, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = H // Hkv
    N = w_o.shape[0]
    assert w_o.shape[1] == H * D and w_o.stride(1) == 1 and D == pow2(D) and (G * D) % block_k == 0
    lag = min(max(lag, 0), Hkv)  # Hkv: every o tile after all of attention
    max_tokens = block_tables.shape[1] * BS
    if split_k == 0:
        split_k = auto_split_k(B, Hkv, max_tokens, block_n, q.device)
    ws = ws or Workspace(B, H, Hkv, D, split_k, N, q.device, q.dtype, block_o=block_o)
    if ws.shape[:4] != (B, H, Hkv, D) or ws.shape[4] < split_k or ws.shape[5] != N or ws.shape[6] > block_o:
        raise ValueError(f"attention_oproj: workspace for (B, H, Hkv, D, splits, N, block_o) {ws.shape}, launch "
                         f"needs {(B, H, Hkv, D, split_k, N, block_o)}")
    if parts not in PARTS or order not in ORDERS or (order != "ticket" and not q.is_cuda and parts == "both"):
        raise ValueError(f"attention_oproj: parts one of {tuple(PARTS)}, order one of {tuple(ORDERS)} (not the "
                         f"ticket's only on CUDA)")
    out = torch.empty(B, N, device=q.device, dtype=q.dtype)
    n_tiles = Hkv * (B * split_k + cdiv(N, block_o))
    if programs == 0:
        programs = 3 if q.device.type == "cpu" else per_sm * sm_count(q.device)
    programs = min(programs, n_tiles)
    LOG2E = 1.4426950408889634
    _attn_o_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, lens, w_o, ws.attn, out, ws.po, ws.pm, ws.pl, ws.op, ws.counters,
        float(scale) * LOG2E, B, H, N, max_tokens,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), w_o.stride(0), ws.attn.stride(0), out.stride(0),
        HKV=Hkv, G=G, BLOCK_G=pow2(G, 16), D=D, BLOCK_N=block_n, BS=BS, SPLIT_K=split_k, BLOCK_M=pow2(B, 16),
        BLOCK_O=block_o, BLOCK_K=block_k, LAG=lag, PARTS=PARTS[parts], ORDER=ORDERS[order],
        RESET=pow2(2 + Hkv), PREC=dot_precision(q.dtype), UPCAST=dot_upcast(),
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg and q.is_cuda else {}),
    )
    return out


def attention_oproj_reference(q, k_cache, v_cache, block_tables, lens, scale: float, w_o) -> torch.Tensor:
    """The pair in fp32: the engine's reference decode attention, then the projection."""
    attn = attention_decode_reference(q.float(), k_cache.float(), v_cache.float(), block_tables, lens, scale)
    return attn.view(q.shape[0], -1) @ w_o.float().T


def make_inputs(B: int, ctx: int | list[int], H: int, Hkv: int, D: int, N: int, device, dtype, gen, *, BS: int = 16,
                spare: int = 0):
    """q, caches (blocks shuffled), block tables, lengths and W_o for one layer; ``ctx`` one length or
    one per sequence; ``spare`` extra block-table columns past the longest sequence (never read)."""
    lens = [ctx] * B if isinstance(ctx, int) else list(ctx)
    per_seq = max(1, cdiv(max(lens), BS)) + spare
    nb = B * per_seq
    rand = lambda *shape: torch.randn(*shape, device=gen.device, dtype=dtype, generator=gen).to(device)  # noqa: E731
    k, v = rand(nb, BS, Hkv, D), rand(nb, BS, Hkv, D)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(nb)).to(device)
    bt = perm.view(B, per_seq).to(torch.int32)
    q = rand(B, H, D)
    w = rand(N, H * D) / (H * D) ** 0.5
    return q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=device), w


def separate(q, k, v, bt, lens, scale, w, *, o: str = "cublas"):
    """The engine's pair as two ops: its decode attention, then o_proj by cuBLAS or the Triton GEMV."""
    a = paged_decode_attention(q, k, v, bt, lens, scale).view(q.shape[0], -1)
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
    for split_k, block_o, lag, programs in ((1, 16, 0, 2), (2, 32, 1, 3), (4, 16, 2, 5), (0, 16, 1, 1)):
        ws = Workspace(3, H, Hkv, D, split_k or 64, N, device, dtype)
        for _ in range(2):
            got = attention_oproj(q, k, v, bt, lens, 0.2, w, split_k=split_k, block_n=16, block_o=block_o,
                                  block_k=32, lag=lag, programs=programs, ws=ws)
            worst = max(worst, ((got.float() - want).abs().max() / want.abs().max()).item())
        if ws.counters.any():
            return float("inf")  # a launch left a counter set: the next one would be wrong
    return worst


CONFIGS = ["p2 o64 l8 t3", "p2 o64 l8 t3 F", "p2 o64 l8 t3 x1", "p2 o64 l8 t3 x1 F", "p2 o128 l8 t3 x1 F",
           "p2 o64 l8 t3 x2 F", "p2 o64 l2 t3 x1 F", "p2 o64 l8 t3 A", "p2 o64 l8 t3 F A", "p2 o64 l8 t3 x1 F A",
           "p2 o64 l8 t3 F O"]
CONFIG_KEYS = {"p": "per_sm", "o": "block_o", "s": "split_mult", "w": "num_warps", "l": "lag", "k": "block_k",
               "t": "num_stages", "r": "maxnreg", "x": "split_k"}
CONFIG_FLAGS = {"A": ("parts", "attention"), "O": ("parts", "o"), "S": ("order", "static"), "F": ("order", "first")}


def parse_config(cfg: str) -> dict:
    """``"p2 o64 l1 A"`` as attention_oproj's keywords (``CONFIG_KEYS``; ``s``, the split multiplier, as
    ``split_mult``) and flags (``CONFIG_FLAGS``: A / O attention's or the o tiles alone, S static tile
    order, F the first tile by program id)."""
    return dict(CONFIG_FLAGS[tok] if tok in CONFIG_FLAGS else (CONFIG_KEYS[tok[0]], int(tok[1:])) for tok in cfg.split())


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=50)
    ap.add_argument("--shapes", default="1x800,4x800,12x800,16x800,12x2048")
    ap.add_argument("--configs", default=";".join(CONFIGS),
                    help="fused configs, ';'-separated, each space-separated keys: p programs an SM, o block_o, "
                    "s split x the auto split, x split, w num_warps, l lag, k block_k, t num_stages, r maxnreg; flags A "
                    "attention alone, O o tiles alone, S static order, F first tile static (e.g. 'p2 o64 l1 A')")
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
        attn_out = paged_decode_attention(*layers[0][:5], scale).view(batch, -1)
        calls = {"separate_cublas": lambda i: separate(*layers[i][:5], scale, layers[i][5]),
                 "separate_gemv": lambda i: separate(*layers[i][:5], scale, layers[i][5], o="gemv"),
                 # the two halves of separate_cublas, each alone (no output to check)
                 "engine_attention": lambda i: paged_decode_attention(*layers[i][:5], scale),
                 "cublas_o": lambda i: F.linear(attn_out, layers[i][5])}
        partial = {"engine_attention", "cublas_o"}
        for cfg in filter(None, args.configs.split(";")):
            kw = parse_config(cfg)
            mult = kw.pop("split_mult", 1)
            kw["split_k"] = kw.get("split_k") or min(64, auto * mult)
            wss = [Workspace(batch, H, Hkv, D, kw["split_k"], N, device, dtype) for _ in range(copies)]
            calls["fused_" + cfg.replace(" ", "_")] = (lambda i, kw=kw, ws=wss: attention_oproj(
                *layers[i][:5], scale, layers[i][5], ws=ws[i], **kw))
            if kw.get("parts", "both") != "both":
                partial.add("fused_" + cfg.replace(" ", "_"))
        floor_us = layer_bytes / (bw * 1e9) * 1e6
        for name, call in calls.items():
            got = call(0)
            err = None if name in partial else round(((got.float() - want).abs().max() / want.abs().max()).item(), 5)
            us = time_graph(call, copies, args.reps)
            row = {"variant": f"{batch}x{ctx}-{name}", "batch": batch, "context": ctx, "us": round(us, 2),
                   "floor_us": round(floor_us, 2), "of_roofline": round(floor_us / us, 3), "rel_err": err}
            rows.append(row)
            print_variant_row(row, 40)
        del layers, calls
        torch.cuda.empty_cache()
    write_probe("attention-oproj", args.out, device, copy_gbps=bw, reps=args.reps, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
