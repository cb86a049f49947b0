"""Paged decode attention, split-K (flash-decoding), GQA-aware (Triton).

Kernel 1 (grid ``[B, Hkv, split_k]``): the program for (sequence b, kv head, split s) reads its
share of the sequence's keys/values *once* and serves all ``G = H / Hkv`` query heads of that kv
head together (the query heads are the rows of a ``tl.dot``, padded to 16). Each sequence's context
is cut into ``split_k`` equal pieces (rounded up to ``block_n``) from its own ``context_lens``
value, read on the device, so short sequences in a batch of long ones waste nothing but an early
exit. The program keeps an online softmax and writes an unnormalised partial (acc, max, sum).

Kernel 2 (grid ``[B, H]``): merges the valid splits of each (sequence, head) with the usual
log-sum-exp rescaling. With ``split_k == 1`` kernel 1 normalises and writes the output itself;
with ``merge="ticket"`` the last split of each (sequence, kv head) to finish merges (an atomic
arrival counter), so the step has one kernel instead of two.

``prefetch`` (with ``pdl``): batches up to this size request each split's first K/V tile before
waiting for the previous kernel. Only the step's own token (position ``ctx - 1``) is written by
the kernels before attention, so it alone is loaded after the wait. At bs=1 this takes the tile's
DRAM latency off the critical path; at bs >= 8 the waiting programs cost more than it saves.

``pv_precision``: the probabilities enter the PV product as bf16 (``"bf16"``, as flash attention
does) or as fp32 through a tf32 MMA (``"tf32"``: closer to the fp32 reference, at no cost in a
memory-bound kernel).

``rope_decode_attention`` (the ``rope_attention`` fusion): the split kernel takes the raw qkv rows of
the step and does ``qk_rope_store``'s work itself, so a decode layer has one kernel less. Each program
first rotates (and, for Qwen3, q/k-normalises; under ``folded_norm`` scales by the stream's 1/rms)
its G query heads, with nothing else live; the program whose split holds the step's own token
(position ``ctx - 1``) rotates that token's k, stores k and v in the cache slot and, after a CTA
barrier, reads them back with the older tokens, so nothing but the plain kernel's loop runs over the
tiles. On the H200 its RoPE rounds exactly as the reference ops do (bf16): the caches and output are
the split kernel's on the reference's q and k, bit for bit (session 21; the ``qk_rope_store``
kernel was an ulp off in ~17% of k until it was compiled without FMA contraction; Qwen3's q/k norm
sums a head's squares in another order: equal to rounding). Session 20's two earlier versions kept the new token in
registers: a select in every tile (179-254 registers a thread, half the CTAs an SM, 2.1x slower at
bs 12), then one online-softmax column after the loop (as fast as needed, -1% a step, but its
other summation order moved one greedy argmax of 48 in the 8B's bf16 verification).

CUDA-graph safe: no host sync, grid and workspace depend only on shapes (``B``, ``H``,
``block_tables.shape[1]``), never on context-length values. Padding entries of ``block_tables``
past a sequence's length are never read. A sequence with ``context_len == 0`` gives zeros, as the
reference does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, cdiv, check_device, dot_precision, dot_upcast, fit_stages, launch_opts,
    mma, pdl_enabled, pdl_launch_dependents, pdl_mode, pdl_prologue, pdl_wait, pow2, pow2_split, rms_operand, row_rstd,
    sm_count, tile_counters, PDL_CHOICES, check_pdl,
)
from anneal.engine.kernels.rope import check_rope_operands, rope_heads
from anneal.engine.ops.registry import Param, variant

MAX_SPLIT_K = 64


@triton.jit
def _split_len(ctx, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split for a sequence of ``ctx`` tokens: a multiple of BLOCK_N, at least BLOCK_N."""
    per = tl.cdiv(tl.cdiv(ctx, SPLIT_K), BLOCK_N) * BLOCK_N
    return tl.maximum(per, BLOCK_N)


@triton.jit
def _attend_tile(q, k, v, tm, m_i, l_i, acc, scale_log2, PREC: tl.constexpr, UPCAST: tl.constexpr,
                 PV_F32: tl.constexpr):
    """One K/V tile into the online softmax: returns the updated (max, sum, unnormalised output)."""
    sc = mma(q, tl.trans(k), PREC, UPCAST) * scale_log2
    sc = tl.where(tm[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if PV_F32:  # probabilities kept in fp32 (tf32 MMA): closer to the fp32 reference
        pv = mma(p, v.to(tl.float32), PREC, UPCAST)
    else:
        pv = mma(p.to(v.dtype), v, PREC, UPCAST)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr,
    pos_ptr, cs_ptr, slot_ptr, qn_ptr, kn_ptr, rms_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_cs, stride_rms, H, max_tokens, eps, hidden, rms_eps,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, SPLIT_K: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, PV_F32: tl.constexpr, TICKET: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr, RMS: tl.constexpr,
    BLOCK_HID: tl.constexpr,
):
    # ROPE: q_ptr is the step's qkv [B, (H + 2 Hkv) D] (stride_qb its row stride), rotated here;
    # the launch never sets PREFETCH with it.
    pdl_launch_dependents(PDL == 1)
    if not PREFETCH:
        pdl_wait(PDL)
        pdl_launch_dependents(PDL == 3)  # "after_wait": only the merge / next kernel launches while this runs
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    # Context lengths and block tables are copied in before the step; nothing in it writes them.
    ctx = tl.minimum(tl.load(lens_ptr + b), max_tokens)  # never past the block table
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    if ROPE:
        # qk_rope_store's work for this (sequence, kv head), first (its loads beside the length's):
        # its temporaries are dead before the K/V tiles are in registers (254 registers a thread
        # and half the occupancy when they overlapped, session 20).
        DT = kc_ptr.dtype.element_ty
        HALF: tl.constexpr = D // 2
        row = q_ptr + b.to(tl.int64) * stride_qb
        row_scale = 1.0
        if RMS:  # folded_norm: the input norm's 1/rms, from the residual row the projection read
            row_scale = row_rstd(rms_ptr + b.to(tl.int64) * stride_rms, hidden, rms_eps, BLOCK_HID)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        half_d = tl.where(d < HALF, d, d - HALF)[None, :]
        cos = tl.load(cs_ptr + pos * stride_cs + half_d, mask=dm[None, :], other=0.0).to(DT).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + half_d, mask=dm[None, :], other=0.0).to(DT).to(tl.float32)
        q = rope_heads(row, kvh * G, G, cos, sin, qn_ptr, eps, row_scale, d, D, BLOCK_G, HAS_NORM, RMS, DT).to(DT)
        k_new = rope_heads(row, H + kvh, 1, cos, sin, kn_ptr, eps, row_scale, d, D, 1, HAS_NORM, RMS, DT).to(DT)
        v_new = tl.load(row + (H + tl.num_programs(1) + kvh) * D + d[None, :], mask=dm[None, :], other=0.0)
        if RMS:
            v_new = v_new.to(tl.float32) * row_scale
        v_new = v_new.to(DT)
        slot = tl.load(slot_ptr + b).to(tl.int64)
    split_len = _split_len(ctx, SPLIT_K, BLOCK_N)
    start = s * split_len
    if SPLIT_K > 1:
        if (s > 0) & (start >= ctx):  # nothing to do; the merge ignores this split (split 0
            return                    # always reports, so an empty sequence still gets zeros)
    end = tl.minimum(start + split_len, ctx)
    if ROPE:
        # The split holding position ctx - 1 stores the step's own k / v, and after a barrier (which
        # makes a CTA's global stores visible to all its threads) reads them back with the older
        # tokens: the tiles are the unfused pair's, bit for bit, and nothing stays live across the
        # loop (a select of the new token in every tile took 179 registers a thread, 2 CTAs an SM).
        if (slot >= 0) & (s == tl.maximum(ctx - 1, 0) // split_len):
            sk = (slot // BS) * stride_kb + (slot % BS) * stride_kt + kvh * stride_kh
            sv = (slot // BS) * stride_vb + (slot % BS) * stride_vt + kvh * stride_vh
            tl.store(kc_ptr + sk + d[None, :], k_new, mask=dm[None, :])
            tl.store(vc_ptr + sv + d[None, :], v_new, mask=dm[None, :])
            tl.debug_barrier()

    heads = kvh * G + g
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    loop_start = start
    if PREFETCH:
        # The split's first tile is requested while the previous kernel still runs: of the keys and
        # values it reads, only the step's own token (position ctx - 1, stored by the kernel before
        # this one) is written in this step, so it alone is loaded after the wait.
        t = start + tl.arange(0, BLOCK_N)
        tm = t < end
        blk = tl.load(bt_row + t // BS, mask=tm, other=0).to(tl.int64)
        tok = t % BS
        k_ptrs = kc_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None] + d[None, :]
        v_ptrs = vc_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None] + d[None, :]
        old = (tm & (t < ctx - 1))[:, None] & dm[None, :]
        k = tl.load(k_ptrs, mask=old, other=0.0)
        v = tl.load(v_ptrs, mask=old, other=0.0)
        pdl_wait(PDL)
        pdl_launch_dependents(PDL == 3)
        new = (tm & (t == ctx - 1))[:, None] & dm[None, :]
        k = tl.load(k_ptrs, mask=new, other=k)
        v = tl.load(v_ptrs, mask=new, other=v)
    if not ROPE:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
    if PREFETCH:  # the prefetched tile first, then the loop from the next one
        if start < end:  # else an empty sequence (context 0): no keys, zeros out
            m_i, l_i, acc = _attend_tile(q, k, v, tm, m_i, l_i, acc, scale_log2, PREC, UPCAST, PV_F32)
        loop_start = start + BLOCK_N
    for n0 in range(loop_start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        tm = t < end
        blk = tl.load(bt_row + t // BS, mask=tm, other=0).to(tl.int64)
        tok = t % BS
        kmask = tm[:, None] & dm[None, :]
        k = tl.load(kc_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kmask, other=0.0)
        # V is requested together with K (not after the scores): both tiles in flight at once.
        v = tl.load(vc_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kmask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, tm, m_i, l_i, acc, scale_log2, PREC, UPCAST, PV_F32)
    pdl_launch_dependents(PDL == 2)  # "late": the merge / next kernel launches once the K/V loops are done

    if SPLIT_K == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    else:
        row = (b * H + heads) * SPLIT_K + s  # partials are [B, H, SPLIT_K, (D)]
        tl.store(po_ptr + row.to(tl.int64)[:, None] * BLOCK_D + d[None, :], acc, mask=gm[:, None])
        tl.store(pm_ptr + row, m_i, mask=gm)
        tl.store(pl_ptr + row, l_i, mask=gm)
        if TICKET:
            # The last split of (b, kv head) to arrive merges the partials of its G heads (the merge
            # kernel's arithmetic, each head's splits loaded at once) and resets the counter: no
            # second kernel.
            tl.debug_barrier()
            n_valid = tl.maximum(tl.cdiv(ctx, split_len), 1)
            cnt = cnt_ptr + b * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if ticket == n_valid - 1:
                for gi in tl.static_range(G):
                    h = kvh * G + gi
                    _merge_head(out_ptr + b * stride_ob + h * stride_oh, po_ptr, pm_ptr, pl_ptr, (b * H + h) * SPLIT_K,
                                n_valid, D, BLOCK_D, SPLIT_K, ".cg")
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_head(out_row, po_ptr, pm_ptr, pl_ptr, base, n_valid, D: tl.constexpr, BLOCK_D: tl.constexpr,
                SPLIT_K: tl.constexpr, CACHE: tl.constexpr):
    """One (sequence, head): its first ``n_valid`` split partials at rows ``base + s``, merged with
    log-sum-exp rescaling and normalised, to ``out_row``. All splits are loaded at once."""
    s = tl.arange(0, SPLIT_K)
    sm = s < n_valid
    row = base + s
    m = tl.load(pm_ptr + row, mask=sm, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(pl_ptr + row, mask=sm, other=0.0, cache_modifier=CACHE)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(po_ptr + row.to(tl.int64)[:, None] * BLOCK_D + d[None, :], mask=sm[:, None], other=0.0,
                  cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # 0 for invalid splits
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_row + d, out.to(out_row.dtype.element_ty), mask=d < D)


@triton.jit
def _decode_merge_kernel(
    lens_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, stride_ob, stride_oh, H, max_tokens,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.minimum(tl.load(lens_ptr + b), max_tokens)
    n_valid = tl.maximum(tl.cdiv(ctx, _split_len(ctx, SPLIT_K, BLOCK_N)), 1)
    _merge_head(out_ptr + b * stride_ob + h * stride_oh, po_ptr, pm_ptr, pl_ptr, (b * H + h) * SPLIT_K, n_valid,
                D, BLOCK_D, SPLIT_K, "")


def auto_split_k(batch: int, num_kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """A split count from static shapes only: about four programs per SM, never more splits than
    ``block_n`` tiles in the longest context the block table can hold."""
    want = max(1, (4 * sm_count(device)) // max(1, batch * num_kv_heads))
    return pow2_split(want, max(1, cdiv(max_tokens, block_n)), MAX_SPLIT_K)


def _check_cache(name: str, B: int, H: int, D: int, dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """The paged cache and its tables, for ``B`` sequences of ``H`` query heads of size ``D``."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelInputError(f"{name}: need caches [NB, BS, Hkv, D], got {tuple(k_cache.shape)}, "
                               f"{tuple(v_cache.shape)}")
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D or H % Hkv:
        raise KernelInputError(f"{name}: head_dim {k_cache.shape[3]} vs {D}, or H={H} not a multiple of Hkv={Hkv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise KernelInputError(f"{name}: block_tables must be [B={B}, NB] and context_lens [B]")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise KernelInputError(f"{name}: block_tables and context_lens must be int32")
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise KernelInputError(f"{name}: queries, k_cache and v_cache must share a dtype, got {dtype}, "
                               f"{k_cache.dtype}, {v_cache.dtype}")
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(-1) != 1:
            raise KernelInputError(f"{name}: {n} must be contiguous in head_dim")


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, split_k: int = 0, block_n: int = 64,
    num_warps: int = 4, num_stages: int = 2, pv_precision: str = "bf16", merge: str = "kernel",
    pdl: bool = False, prefetch: int = 0,
) -> torch.Tensor:
    name = "attention_decode"
    check_device(name, q, k_cache, v_cache, block_tables, context_lens)
    if q.dim() != 3:
        raise KernelInputError(f"{name}: need q[B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    _check_cache(name, B, H, D, q.dtype, k_cache, v_cache, block_tables, context_lens)
    if q.stride(-1) != 1:
        raise KernelInputError(f"{name}: q must be contiguous in head_dim")
    return _launch(q, None, k_cache, v_cache, block_tables, context_lens, scale, B, H, D,
                   split_k=split_k, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                   pv_precision=pv_precision, merge=merge, pdl=pdl, prefetch=prefetch)


class _Rope(NamedTuple):
    """``qk_rope_store``'s operands for the fused launch (already checked)."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    rms: torch.Tensor
    block_hid: int
    rms_on: bool
    rms_eps: float


def rope_decode_attention(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
    rms_of: torch.Tensor | None = None, rms_eps: float = 0.0, **params,
) -> torch.Tensor:
    """``attention_decode(qk_rope_store(qkv, ...), ...)`` for a decode step in one launch (plus the
    merge): the ``rope_attention`` fusion (module doc). Each row's own token is at position
    ``context_lens[b] - 1`` with its cache slot ``slot_mapping[b]`` (``-1``: not stored), as in every
    decode step; ``rms_of`` as for ``qk_rope_store`` (``folded_norm``); ``params`` the
    ``triton_splitk`` variant's."""
    name = "rope_attention"
    check_device(name, qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, block_tables,
                 context_lens, rms_of)
    H, Hkv = num_heads, num_kv_heads
    B, D = check_rope_operands(name, "B", qkv, positions, cos_sin, slot_mapping, H, Hkv, q_norm, k_norm)
    _check_cache(name, B, H, D, qkv.dtype, k_cache, v_cache, block_tables, context_lens)
    if k_cache.shape[2] != Hkv:
        raise KernelInputError(f"{name}: caches hold {k_cache.shape[2]} kv heads, not Hkv={Hkv}")
    rms, block_hid = rms_operand(name, rms_of, B, qkv)
    rope = _Rope(positions.contiguous(), cos_sin, slot_mapping.contiguous(),
                 None if q_norm is None else q_norm.contiguous(), None if k_norm is None else k_norm.contiguous(),
                 float(eps), rms, block_hid, rms_of is not None, float(rms_eps))
    return _launch(qkv, rope, k_cache, v_cache, block_tables, context_lens, scale, B, H, D, **params)


def _launch(
    q: torch.Tensor, rope: _Rope | None, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, B: int, H: int, D: int, *, split_k: int = 0, block_n: int = 64,
    num_warps: int = 4, num_stages: int = 2, pv_precision: str = "bf16", merge: str = "kernel",
    pdl: bool = False, prefetch: int = 0,
) -> torch.Tensor:
    """The split kernel (and the merge) on checked inputs: ``q`` is ``[B, H, D]``, or with ``rope``
    the step's qkv rows."""
    name = "attention_decode"
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()  # read as a flat array (no copy when it already is)
    if pv_precision not in ("bf16", "tf32") or merge not in ("kernel", "ticket"):
        raise KernelInputError(f"{name}: pv_precision must be 'bf16' or 'tf32', merge 'kernel' or 'ticket'")
    check_pdl(name, pdl)
    G = H // Hkv
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if split_k == 0:
        split_k = auto_split_k(B, Hkv, block_tables.shape[1] * BS, block_n, q.device)
    BLOCK_D = pow2(D, 16)
    if split_k > 1:
        po = torch.empty((B, H, split_k, BLOCK_D), dtype=torch.float32, device=q.device)
        pm = torch.empty((B, H, split_k), dtype=torch.float32, device=q.device)
        pl = torch.empty((B, H, split_k), dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = out  # unused
    ticket = split_k > 1 and merge == "ticket"
    counters = tile_counters(q.device, B * Hkv) if ticket else out
    LOG2E = 1.4426950408889634
    num_stages = fit_stages(num_stages, 2 * block_n * BLOCK_D * k_cache.element_size())
    if rope is None:
        rope_ptrs, rope_args = (q,) * 6, (0, 0, 0.0, 1, 0.0)
        stride_qh = q.stride(1)
    else:
        rope_ptrs = (rope.positions, rope.cos_sin, rope.slot_mapping,
                     q if rope.q_norm is None else rope.q_norm, q if rope.k_norm is None else rope.k_norm, rope.rms)
        rope_args = (rope.cos_sin.stride(0), rope.rms.stride(0), rope.eps, rope.rms.shape[1], rope.rms_eps)
        stride_qh = D
    _decode_split_kernel[(B, Hkv, split_k)](
        q, k_cache, v_cache, block_tables, context_lens, out, po, pm, pl, counters, *rope_ptrs,
        float(scale) * LOG2E,
        q.stride(0), stride_qh, block_tables.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        rope_args[0], rope_args[1], H, block_tables.shape[1] * BS, rope_args[2], rope_args[3], rope_args[4],
        G=G, BLOCK_G=pow2(G, 16), D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, BS=BS, SPLIT_K=split_k,
        PREC=dot_precision(q.dtype), UPCAST=dot_upcast(), PV_F32=pv_precision == "tf32", TICKET=ticket,
        PDL=pdl_mode(pdl), PREFETCH=rope is None and B <= prefetch, ROPE=rope is not None,
        HAS_NORM=rope is not None and rope.q_norm is not None, RMS=rope is not None and rope.rms_on,
        BLOCK_HID=16 if rope is None else rope.block_hid, num_warps=num_warps, num_stages=num_stages,
        **launch_opts(pdl),
    )
    if split_k > 1 and not ticket:
        _decode_merge_kernel[(B, H)](
            context_lens, out, po, pm, pl, out.stride(0), out.stride(1), H, block_tables.shape[1] * BS,
            D=D, BLOCK_D=BLOCK_D, BLOCK_N=block_n, SPLIT_K=split_k, PDL=pdl_enabled(pdl), num_warps=4,
            **launch_opts(pdl),
        )
    return out


@variant(
    "attention_decode", "triton_splitk",
    params=(
        Param("split_k", (0, 1, 2, 4, 8, 16, 32, 64), 0),  # 0 = auto from shapes and SM count
        Param("block_n", (16, 32, 64, 128), 64),
        Param("num_warps", (2, 4, 8), 4),
        # Triton 3.6 spends stages on the block-table indirection first: the loop's K/V tiles get one
        # shared buffer up to 4 (nothing in flight while a tile is computed), two from 5, three from 7
        Param("num_stages", (1, 2, 3, 4, 5, 7), 2),
        Param("pv_precision", ("bf16", "tf32"), "bf16"),  # softmax probabilities in the PV MMA
        Param("merge", ("kernel", "ticket"), "kernel"),  # split merge: second kernel, or last split
        Param("pdl", PDL_CHOICES, False),  # "late" / "after_wait": the next kernel launches once the K/V loops / the wait are done
        # batches up to this size request each split's first K/V tile before the PDL wait (all but
        # the step's own token); 0 = never. It pays at bs=1 and costs from bs 8 (H200, session 9)
        Param("prefetch", (0, 1, 2, 4, 8, 16), 0),
    ),
    devices=("cuda",),
    description="flash-decoding over the paged cache: GQA heads share one K/V read, split-K + merge kernel",
)
def build_attention_decode(
    split_k: int = 0, block_n: int = 64, num_warps: int = 4, num_stages: int = 2, pv_precision: str = "bf16",
    merge: str = "kernel", pdl: bool = False, prefetch: int = 0,
):
    def attention_decode(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale,
            split_k=split_k, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
            pv_precision=pv_precision, merge=merge, pdl=pdl, prefetch=prefetch,
        )

    return attention_decode
