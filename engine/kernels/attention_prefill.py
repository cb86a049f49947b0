"""Varlen causal prefill attention over the paged cache (Triton, flash-attention style).

Grid ``[cdiv(max_seqlen_q, block_m), B, H]``: the program for (query block, sequence b, head h)
takes ``block_m`` of sequence b's new tokens, whose positions are ``context_len - q_len + i``
(so chunked prefill and prefix-cache hits, where earlier tokens are already cached, work the same
way), and streams the cached keys/values ``0 .. last position`` of its block through an online
softmax with the causal mask. Key/value tiles are gathered through ``block_tables``; entries past
the sequence's length are never read. Whole tiles before the block's first query position are
visible to every row and run without masks; only the diagonal's tiles pay for the causal mask
(flash attention's two-stage loop: x1.25-1.38 on the H200 at 2k-8k contexts, session 14).

With ``pack_gqa`` the rows of a program are (token, query head) pairs of one kv head's G heads
(``block_m // G`` tokens each), so each K/V tile is loaded once for all G heads: what chunked
prefill over a long cached context (few new tokens, many keys) wants.

``max_seqlen_q`` must be at least the longest ``q_len`` (it sizes the grid without a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, cdiv, check_device, dot_precision, dot_upcast, fit_stages, launch_opts, mma, pdl_enabled,
    pdl_prologue, pow2,
)
from anneal.engine.ops.registry import Param, variant


@triton.jit
def _attend_keys(q, kc_ptr, vc_ptr, bt_row, n0, hi, qpos, d, dm, kvh, m_i, l_i, acc, scale_log2,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_N: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                 PV_F32: tl.constexpr, MASKED: tl.constexpr, FULL_D: tl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` into the online softmax. MASKED: the causal mask and the bounds
    ``< hi``; otherwise every key of the tile is valid and before every row's position."""
    t = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        blk = tl.load(bt_row + t // BS, mask=t < hi, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + t // BS).to(tl.int64)
    tok = t % BS
    k_ptrs = kc_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None] + d[None, :]
    v_ptrs = vc_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None] + d[None, :]
    if MASKED:
        kmask = (t < hi)[:, None] & dm[None, :]
        k = tl.load(k_ptrs, mask=kmask, other=0.0)
    elif FULL_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=dm[None, :], other=0.0)
    sc = mma(q, tl.trans(k), PREC, UPCAST) * scale_log2
    if MASKED:
        # Rows past q_len have qpos >= ctx: they see every valid key, stay finite, and are not stored.
        sc = tl.where((t < hi)[None, :] & (t[None, :] <= qpos[:, None]), sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptrs, mask=kmask, other=0.0)
    elif FULL_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=dm[None, :], other=0.0)
    if PV_F32:  # probabilities kept in fp32 (tf32 MMA): closer to the fp32 reference, slower
        pv = mma(p, v.to(tl.float32), PREC, UPCAST)
    else:
        pv = mma(p.to(v.dtype), v, PREC, UPCAST)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, scale_log2, max_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, PV_F32: tl.constexpr,
    PACK_GQA: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    mb = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    # PACK_GQA: rows are (token, head) pairs over one kv head's G query heads, so every K/V tile
    # is loaded once for all G heads; TOK tokens per program, rows past TOK * G are padding.
    # Otherwise rows are BLOCK_M tokens of one query head.
    TOK: tl.constexpr = BLOCK_M // G if PACK_GQA else BLOCK_M
    if mb * TOK >= q_len:
        return
    ctx = tl.minimum(tl.load(lens_ptr + b), max_tokens)  # never past the block table
    r = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kvh = tl.program_id(2)
        i = mb * TOK + r // G
        h = kvh * G + r % G
        rows_ok = r < TOK * G
    else:
        h = tl.program_id(2) + r * 0
        kvh = tl.program_id(2) // G
        i = mb * TOK + r
        rows_ok = r < TOK

    im = (i < q_len) & rows_ok
    qpos = ctx - q_len + i
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=im[:, None] & dm[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    hi = tl.minimum(ctx, ctx - q_len + (mb + 1) * TOK)  # last position in this block + 1
    # Keys up to the block's first query position are visible to every row (positions grow with
    # the row): whole tiles of them need no causal mask and no bounds checks. Only the tiles from
    # there to ``hi`` (the diagonal) are masked. Same tiles in the same order as one masked loop.
    full = (ctx - q_len + mb * TOK + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, kc_ptr, vc_ptr, bt_row, n0, hi, qpos, d, dm, kvh, m_i, l_i, acc, scale_log2,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     BLOCK_N, BS, PREC, UPCAST, PV_F32, False, D == BLOCK_D)
    for n0 in range(full, hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, kc_ptr, vc_ptr, bt_row, n0, hi, qpos, d, dm, kvh, m_i, l_i, acc, scale_log2,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     BLOCK_N, BS, PREC, UPCAST, PV_F32, True, D == BLOCK_D)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=im[:, None] & dm[None, :])


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale, *,
    block_m=64, block_n=64, num_warps=4, num_stages=2, pv_precision="bf16", pack_gqa=False, pdl=False,
):
    name = "attention_prefill"
    check_device(name, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelInputError(f"{name}: need q[T, H, D] and caches [NB, BS, Hkv, D], got {tuple(q.shape)}, "
                               f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    T, H, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != D or H % Hkv:
        raise KernelInputError(f"{name}: head_dim {k_cache.shape[3]} vs {D}, or H={H} not a multiple of Hkv={Hkv}")
    B = context_lens.shape[0]
    if cu_seqlens_q.shape != (B + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise KernelInputError(f"{name}: need cu_seqlens_q[B+1], block_tables[B, NB], context_lens[B] (B={B})")
    for t, n in ((block_tables, "block_tables"), (cu_seqlens_q, "cu_seqlens_q"), (context_lens, "context_lens")):
        if t.dtype != torch.int32:
            raise KernelInputError(f"{name}: {n} must be int32, got {t.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelInputError(f"{name}: q, k_cache and v_cache must share a dtype, got {q.dtype}, "
                               f"{k_cache.dtype}, {v_cache.dtype}")
    for t, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(-1) != 1:
            raise KernelInputError(f"{name}: {n} must be contiguous in head_dim")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    cu_seqlens_q, context_lens = cu_seqlens_q.contiguous(), context_lens.contiguous()  # flat arrays
    if pv_precision not in ("bf16", "tf32"):
        raise KernelInputError(f"{name}: pv_precision must be 'bf16' or 'tf32'")
    out = torch.empty_like(q)
    if T == 0 or B == 0 or max_seqlen_q <= 0:
        return out
    G = H // Hkv
    if pack_gqa:
        block_m = max(block_m, pow2(G, 16))  # room for at least one token's G heads
        grid = (cdiv(int(max_seqlen_q), block_m // G), B, Hkv)
    else:
        grid = (cdiv(int(max_seqlen_q), block_m), B, H)
    num_stages = fit_stages(num_stages, 2 * block_n * pow2(D, 16) * k_cache.element_size())
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        float(scale) * 1.4426950408889634, block_tables.shape[1] * BS,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        G=G, D=D, BLOCK_D=pow2(D, 16), BLOCK_M=block_m, BLOCK_N=block_n, BS=BS,
        PREC=dot_precision(q.dtype), UPCAST=dot_upcast(), PV_F32=pv_precision == "tf32", PACK_GQA=bool(pack_gqa),
        PDL=pdl_enabled(pdl), num_warps=num_warps, num_stages=num_stages,
        **launch_opts(pdl),
    )
    return out


@variant(
    "attention_prefill", "triton",
    params=(
        Param("block_m", (16, 32, 64, 128), 64),
        Param("block_n", (16, 32, 64, 128), 64),
        Param("num_warps", (2, 4, 8), 4),
        # 5 (three K/V buffers, the next tiles in flight) was tried and lost 24% at 64 rows: 113 KB of
        # shared memory leaves one CTA an SM (session 25, bench/prefill_attention.py)
        Param("num_stages", (1, 2, 3, 4), 2),
        Param("pv_precision", ("bf16", "tf32"), "bf16"),
        # rows = (token, query head) pairs of one kv head: K/V read once per kv head, not per head
        Param("pack_gqa", (False, True), False),
        Param("pdl", (False, True), False),
    ),
    devices=("cuda",),
    description="varlen causal flash attention over the paged cache, one program per (query block, seq, "
                "head), or per (query block, seq, kv head) with the GQA heads packed into the rows",
)
def build_attention_prefill(
    block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2, pv_precision: str = "bf16",
    pack_gqa: bool = False, pdl: bool = False,
):
    def attention_prefill(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_seqlen_q: int, scale: float,
    ) -> torch.Tensor:
        return paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale,
            block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
            pv_precision=pv_precision, pack_gqa=pack_gqa, pdl=pdl,
        )

    return attention_prefill
