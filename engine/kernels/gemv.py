"""Small-M GEMM / GEMV for decode projections (Triton), split-K, and the GEMV-based fusions:
SiLU-mul + down-proj, (add +) RMSNorm + projection, lm_head + argmax.

``y[M, N] = x[M, K] @ W[N, K]^T`` with W row-major (the nn.Linear layout). Decode projections are
memory-bound on W, so the kernel is built to stream W once at full bandwidth:

* grid ``[cdiv(N, block_n), split_k, cdiv(M, BLOCK_M)]``; each program reads a ``block_n x K/split_k``
  slab of W in ``block_k`` steps. Split-K fills the SMs when N alone gives too few programs (o_proj,
  down_proj at bs 1); partial sums go to an fp32 workspace and are added in split order
  (deterministic): by a second kernel (``reduce="kernel"``) or by the last split of each tile to
  arrive, counted with an atomic ticket (``reduce="ticket"``: one launch instead of two).
* M rows go in one tile up to ``block_m`` (W streamed once for the whole batch) through ``tl.dot``
  with M padded to 16: the dot loop is software-pipelined (``num_stages`` tiles in flight through
  shared memory, lowered where needed to fit), which is what keeps enough loads in flight; the
  wasted MMA work is free in a memory-bound kernel. ``m1="fma"`` instead runs a single row as a
  register multiply-accumulate (not pipelined: ``block_k`` sets the bytes in flight).
* any M is correct (M is tiled); above ``max_m`` rows (prefill) the call goes to ``torch``'s GEMM,
  which is what large M wants (``max_m=0``: always Triton).

Fused entry points (their signatures are not one reference op's, so they are plain functions the
plan's fusions call, not registry variants):

* ``silu_mul_down_proj(gate_up[T, 2I], W[N, I])`` = ``down_proj(silu_and_mul(gate_up), W)``: the
  activation is applied while x is loaded, rounded as the reference rounds its intermediate, so the
  ``[T, I]`` tensor and one launch disappear. At decode that is one kernel launch and a tiny
  round trip per layer (it pays at small batch, where launches and gaps dominate); at large M the
  activation is recomputed once per N tile, which is why this is a separate choice for the plan.
* ``add_rmsnorm_linear(x, residual, norm_w, eps, W) -> (y, x + residual)`` and
  ``rmsnorm_linear(x, norm_w, eps, W) -> y``: the (residual add and) RMSNorm in front of qkv_proj /
  gate_up_proj done in the GEMV's prologue, so the norm kernel (and its launch) disappears; each
  program recomputes the row statistics (K values per row: cheap against its W slab at decode M).
* ``qkv_rope_store(...)`` = ``qk_rope_store(qkv_proj(x, W), ...)`` (Llama): the tile's rows are
  ordered as first halves then second halves of its heads, so the last split's epilogue pairs each
  row with its RoPE partner, rotates, and stores q out and k, v into their cache slots.
* ``linear_add_rmsnorm(x, W, residual, norm_w, eps) -> (normed, summed)``: the GEMV, then the
  last tile of the grid to finish (a grid-wide arrival ticket) does the add + RMSNorm of the rows.
* ``lm_head_argmax(x[B, K], W[V, K]) -> tokens[B] int64`` = ``argmax(lm_head(x, W), -1)``: each
  program reduces its logits tile to (max, index) and a second kernel picks the winner, so the
  ``[B, V]`` logits are never written. Logits are rounded to x's dtype before comparing and ties go
  to the lowest index, as ``torch.argmax`` on the reference's logits does.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, cdiv, check_device, dot_precision, dot_upcast, fit_stages, launch_opts, mma, pdl_enabled,
    pdl_launch_dependents, pdl_mode, pdl_prologue, pdl_wait, pow2, pow2_split, sm_count, tile_counters, check_pdl,
    PDL_CHOICES,
)
from anneal.engine.kernels.activation import silu_mul
from anneal.engine.kernels.argmax import argmax_merge_kernel
from anneal.engine.bf12_weights import bf12_of
from anneal.engine.fp8_weights import fp8_of
from anneal.engine.kernels.rope import rotate_half
from anneal.engine.ops.registry import Param, interpreting, variant
from anneal.engine.plan import BF12_WEIGHT_IMPL, COPY_PROJECTIONS, FP8_WEIGHT_IMPL, GEMV_BLOCK_N, GEMV_MAX_M, bf12_gemv_defaults, rope_fusable  # noqa: F401 (rope_fusable: the kernels' API)

MAX_SPLIT_K = 16
BF12_UNPACK = ("asm", "int")  # how the bf12 GEMV rebuilds bf16 weights: PTX (prmt / lop3) or Triton integer ops


@triton.jit
def _split_sums_paired(ws_ptr, m, na, nb, mask, M, N, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    """The split-K partial sums of rows ``na`` and of their partner rows ``nb`` (``[BLOCK_M, HALF_N]``
    each, fp32, in split order), read from the workspace by a tile's last arriving split."""
    base = ws_ptr + m.to(tl.int64)[:, None] * N
    a = tl.zeros([BLOCK_M, HALF_N], tl.float32)
    b = tl.zeros([BLOCK_M, HALF_N], tl.float32)
    for s2 in tl.static_range(SPLIT_K):
        a += tl.load(base + s2 * M * N + na[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        b += tl.load(base + s2 * M * N + nb[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return a, b


@triton.jit
def _rope_epilogue(ws_ptr, q_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, m, mm, pid_n, M, N, stride_qm,
                   stride_cs, QD, KD, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                   HEAD_D: tl.constexpr, DT: tl.constexpr):
    """qkv_proj + qk_rope_store: the tile's summed rows (heads of one of q | k | v), each half of a
    head loaded apart so rows pair with their rotation partners, rounded to the activation dtype as
    the projection's output is, rotated as the reference rotates (cos/sin in the activation dtype,
    every product and sum rounded), then q to ``q_ptr`` and k, v to their cache slots (slot -1:
    not stored)."""
    HALF: tl.constexpr = HEAD_D // 2
    j = tl.arange(0, BLOCK_N // 2)
    na = pid_n * BLOCK_N + (j // HALF) * HEAD_D + j % HALF
    nb = na + HALF
    mask = mm[:, None] & (na < N)[None, :]
    a, b = _split_sums_paired(ws_ptr, m, na, nb, mask, M, N, BLOCK_M, BLOCK_N // 2, SPLIT_K)
    a = a.to(DT).to(tl.float32)
    b = b.to(DT).to(tl.float32)
    # which of q | k | v the tile holds (tiles never straddle them: `rope_fusable`)
    is_q = (na < QD)[None, :]
    is_v = (na >= KD)[None, :]
    is_k = (na >= QD)[None, :] & (na < KD)[None, :]
    pos = tl.load(pos_ptr + m, mask=mm, other=0).to(tl.int64)
    d = (j % HALF)[None, :]
    cs = cs_ptr + pos[:, None] * stride_cs + d
    cos = tl.load(cs, mask=mask, other=0.0).to(DT).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask, other=0.0).to(DT).to(tl.float32)
    r1, r2 = rotate_half(a, b, cos, sin, DT)
    o1 = tl.where(is_v, a, r1)
    o2 = tl.where(is_v, b, r2)
    q_rows = q_ptr + m.to(tl.int64)[:, None] * stride_qm
    tl.store(q_rows + na[None, :], o1.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    tl.store(q_rows + nb[None, :], o2.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    slot = tl.load(slot_ptr + m, mask=mm, other=-1).to(tl.int64)
    kvd = KD - QD  # one token's k (or v) in the cache: num_kv_heads * head_dim
    stored = mask & (slot >= 0)[:, None]
    k_mask = stored & is_k
    k_rows = kc_ptr + slot[:, None] * kvd
    tl.store(k_rows + (na - QD)[None, :], o1.to(kc_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_rows + (nb - QD)[None, :], o2.to(kc_ptr.dtype.element_ty), mask=k_mask)
    v_rows = vc_ptr + slot[:, None] * kvd
    tl.store(v_rows + (na - KD)[None, :], o1.to(vc_ptr.dtype.element_ty), mask=stored & is_v)
    tl.store(v_rows + (nb - KD)[None, :], o2.to(vc_ptr.dtype.element_ty), mask=stored & is_v)


@triton.jit
def _silu_epilogue(ws_ptr, act_ptr, m, mm, pid_n, M, N, stride_am, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT_K: tl.constexpr, DT: tl.constexpr, rstd, ROW_SCALE: tl.constexpr = False):
    """gate_up_proj + silu_and_mul: the tile's summed gate rows and their up rows, each rounded to
    the activation dtype as the projection's output is, then ``silu(gate) * up`` rounded as the
    reference rounds it, stored to ``act[M, N/2]``. With ``ROW_SCALE`` (``folded_norm``: W holds the
    norm's weight) gate and up are first scaled by their row's ``rstd`` and rounded, as the folded
    SiLU kernel scales them (``activation.silu_and_mul(rms_of=)``)."""
    I = N // 2
    na = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = mm[:, None] & (na < I)[None, :]
    g, u = _split_sums_paired(ws_ptr, m, na, na + I, mask, M, N, BLOCK_M, BLOCK_N // 2, SPLIT_K)
    g, u = g.to(DT), u.to(DT)
    if ROW_SCALE:
        g = (g.to(tl.float32) * rstd[:, None]).to(DT)
        u = (u.to(tl.float32) * rstd[:, None]).to(DT)
    tl.store(act_ptr + m.to(tl.int64)[:, None] * stride_am + na[None, :], silu_mul(g, u, DT), mask=mask)


@triton.jit
def _last_tile_add_norm(y_ptr, r_ptr, nw_ptr, sum_ptr, h_ptr, cnt_ptr, M, N, stride_ym, stride_rm, stride_sm,
                        stride_hm, eps, BLOCK_NORM: tl.constexpr, DT: tl.constexpr):
    """o_proj / down_proj + the add_rmsnorm after it: called by each tile's finishing program once
    its tile of ``y`` is stored; the last tile of the grid to finish (a grid-wide ticket, kept past
    the per-tile counters) then has every row of ``y`` and does ``add_rmsnorm(y, residual)`` for
    all of them, rounding as the reference does. That removes the norm kernel (and its wait) from
    the layer; the cost is one program doing a [M, N] row pass at the end."""
    tiles = tl.num_programs(0) * tl.num_programs(2)
    tl.debug_barrier()  # every thread's part of the tile is stored before the ticket's release
    done = tl.atomic_add(cnt_ptr + tiles, 1, sem="acq_rel", scope="gpu")
    if done == tiles - 1:
        offs = tl.arange(0, BLOCK_NORM)
        nm = offs < N
        w = tl.load(nw_ptr + offs, mask=nm, other=0.0).to(tl.float32)
        for row in range(0, M):  # decode-sized M: row * stride stays well inside int32
            y = tl.load(y_ptr + row * stride_ym + offs, mask=nm, other=0.0, cache_modifier=".cg")
            r = tl.load(r_ptr + row * stride_rm + offs, mask=nm, other=0.0)
            summed = (y.to(tl.float32) + r.to(tl.float32)).to(DT)
            tl.store(sum_ptr + row * stride_sm + offs, summed, mask=nm)
            sf = summed.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
            h = ((sf * rstd).to(DT).to(tl.float32) * w).to(DT)
            tl.store(h_ptr + row * stride_hm + offs, h, mask=nm)
        tl.atomic_xchg(cnt_ptr + tiles, 0, sem="relaxed", scope="gpu")


@triton.jit
def _add_stats_epilogue(total, out_ptr, r_ptr, ss_ptr, m, mm, n, nm, pid_n, stride_om, stride_rm, ss_tiles,
                        DT: tl.constexpr, STATS: tl.constexpr = True):
    """o_proj / down_proj for the ``norm_stats`` fusion: the tile's finished rows, rounded as the
    projection's output is, plus the residual, rounded as ``add_rmsnorm`` rounds its sum, stored as
    the new residual stream; and the tile's share of each row's sum of squares (the RMSNorm
    statistic) to ``ss[row, tile]``, which the next GEMV adds up in tile order (deterministic).
    Without ``STATS`` only the sum (``folded_norm``'s residual add, in place: ``out`` may be the
    residual, each element read and written by this program alone)."""
    mask = mm[:, None] & nm[None, :]
    r = tl.load(r_ptr + m.to(tl.int64)[:, None] * stride_rm + n[None, :], mask=mask, other=0.0)
    summed = (total.to(DT).to(tl.float32) + r.to(tl.float32)).to(DT)
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :], summed, mask=mask)
    if STATS:
        sf = tl.where(mask, summed.to(tl.float32), 0.0)
        tl.store(ss_ptr + m * ss_tiles + pid_n, tl.sum(sf * sf, axis=1), mask=mm)


# bf12 -> bf16 for eight weights in twelve instructions (``unpack="asm"``), four pairs an instance.
# In: four pairs' low bytes as 16-bit values ($4, $5: weight 2j's low byte in the low half), their four
# code bytes ($6: weight 2j's code in byte j's low nibble, 2j+1's in its high one) and the row's base
# in every byte ($7). Per byte, the high byte of a weight is ``(code & 7) + base`` with the code's
# sign bit (3) moved to bit 7: for the even weights and, shifting the bytes down a nibble, for the
# odd ones (and, add, shl / shr, lop3; a byte's sum is at most 7 + 120, so no carry crosses bytes).
# Four prmt interleave low and high bytes into the even weights' bf16 pairs ($0, $1) and the odd
# ones' ($2, $3), which the tile joins back in order. Every output element depends on its own
# input elements only, so the result does not depend on how Triton lays the tile out. Session 45's
# first PTX unpack took its code bytes repeated (c0 c0 c1 c1, a prmt and two cvt a four weights to
# build) and 8 instructions a four weights; the Triton integer version (``unpack="int"``) ~9 a weight,
# more integer work than an H100 SM issues at the rate HBM delivers bf12 weights.
_BF12_ASM = tl.constexpr("""{
.reg .b32 y, he, ho;
and.b32 he, $6, 0x07070707;
add.u32 he, he, $7;
shl.b32 y, $6, 4;
lop3.b32 he, y, 0x80808080, he, 0xEA;
shr.u32 y, $6, 4;
and.b32 ho, y, 0x07070707;
add.u32 ho, ho, $7;
lop3.b32 ho, $6, 0x80808080, ho, 0xEA;
prmt.b32 $0, $4, he, 0x5240;
prmt.b32 $1, $5, he, 0x7260;
prmt.b32 $2, $4, ho, 0x5341;
prmt.b32 $3, $5, ho, 0x7361;
}""")


@triton.jit
def _bf12_tile(w_rows, e_rows, w_base, k0, k_hi, nm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               ASM: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_K]`` tile of W from its bf12 copy (engine/bf12_weights.py), as bf16: each
    weight's low byte and its 4-bit code (sign, top exponent bits less the row's base) made the
    high byte again; with ``ASM`` by ``_BF12_ASM``, four pairs at a time (``w_base``: the rows'
    bases as uint8 then), else in Triton's integer ops (the interpreter's way)."""
    kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    pm = nm[:, None] & (kh < k_hi // 2)[None, :]
    e = tl.load(e_rows + kh[None, :], mask=pm, other=0)
    if ASM:  # a pair's two low bytes as one 16-bit load
        lo2 = tl.load(w_rows.to(tl.pointer_type(tl.uint16)) + kh[None, :], mask=pm, other=0)
        b = tl.broadcast_to(w_base[:, None], [BLOCK_N, BLOCK_K // 2])
        even, odd = tl.inline_asm_elementwise(_BF12_ASM, "=r,=r,=r,=r,r,r,r,r", [lo2, e, b],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])
    k = k0 + tl.arange(0, BLOCK_K)
    lo = tl.load(w_rows + k[None, :], mask=nm[:, None] & (k < k_hi)[None, :], other=0)
    e = e.to(tl.int32)
    v = tl.reshape(tl.join(e & 15, e >> 4), [BLOCK_N, BLOCK_K])  # byte j: weights 2j (low), 2j + 1
    bits = (v + (v & 8) * 15 + w_base[:, None]) * 256 + lo.to(tl.int32)  # (sign << 7 | top7) << 8 | lo
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, val_ptr, idx_ptr, r_ptr, nw_ptr, sum_ptr, cnt_ptr,
    pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, h_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_sm, k_per_split, eps,
    stride_cs, QD, KD, stride_hm, ss_ptr, ss_tiles, wscale_ptr, wexp_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM: tl.constexpr, ARGMAX: tl.constexpr, TICKET: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr = False,
    HEAD_D: tl.constexpr = 1, ADD_NORM: tl.constexpr = False, BLOCK_NORM: tl.constexpr = 1,
    SILU_OUT: tl.constexpr = False, ADD_SS: tl.constexpr = False, BLOCK_SS: tl.constexpr = 1,
    SS_OUT: tl.constexpr = True,
    AHEAD: tl.constexpr = 1, W_SCALED: tl.constexpr = False, W_BF12: tl.constexpr = 0,
):
    pdl_launch_dependents(PDL == 1)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    DT = x_ptr.dtype.element_ty
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROPE:
        # Rows in rotation order: the first halves of the tile's heads, then their second halves,
        # so the epilogue can pair each row with its RoPE partner (see `_rope_epilogue`).
        HALF: tl.constexpr = HEAD_D // 2
        j = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        second = tl.arange(0, BLOCK_N) >= BLOCK_N // 2
        n = pid_n * BLOCK_N + (j // HALF) * HEAD_D + j % HALF + tl.where(second, HALF, 0)
    elif SILU_OUT:
        # gate_up's weight is [gate | up]: the tile takes BLOCK_N/2 gate rows and the up rows that
        # pair with them, so the epilogue can apply silu(gate) * up (see `_silu_epilogue`).
        j = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        second = tl.arange(0, BLOCK_N) >= BLOCK_N // 2
        gate_row = pid_n * (BLOCK_N // 2) + j
        n = gate_row + tl.where(second, N // 2, 0)
    else:
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = m < M
    if SILU_OUT:
        nm = gate_row < N // 2
    else:
        nm = n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if W_BF12:  # w_ptr is the low bytes; the 4-bit codes and each row's base beside them
        e_rows = wexp_ptr + n.to(tl.int64)[:, None] * (stride_wn // 2)
        w_base = tl.load(wscale_ptr + n, mask=nm, other=0)
        if W_BF12 == 2:  # the asm unpack takes the base as a byte
            w_base = w_base.to(tl.uint8)

    if BLOCK_M == 1:
        # W does not depend on the previous kernel: its first AHEAD tiles are requested before the
        # PDL wait (under PDL they stream while the predecessors finish, when the bus is otherwise
        # idle), and every later tile AHEAD steps ahead of its use (AHEAD + 1 tiles in flight per
        # program, in registers).
        k = k_lo + tl.arange(0, BLOCK_K)
        w_cur = tl.load(w_rows + k[None, :], mask=nm[:, None] & (k < k_hi)[None, :], other=0.0)
        if AHEAD >= 2:
            k = k + BLOCK_K
            w_nxt = tl.load(w_rows + k[None, :], mask=nm[:, None] & (k < k_hi)[None, :], other=0.0)
        if AHEAD >= 3:
            k = k + BLOCK_K
            w_far = tl.load(w_rows + k[None, :], mask=nm[:, None] & (k < k_hi)[None, :], other=0.0)
    pdl_wait(PDL)
    pdl_launch_dependents(PDL == 3)  # "after_wait": only the next kernel launches while this one runs

    # NORM 1: x -> rmsnorm(x); NORM 2: x -> rmsnorm(x + residual), and x + residual is written out
    # (by the programs of the first N tile, each for its K range). Every program first computes
    # the full-row statistics, rounding where the reference rounds. NORM 3: x -> rmsnorm(x) with
    # the statistics the previous GEMV left per tile in ``ss[row, tile]`` (the ``norm_stats``
    # fusion): no program rereads the row. NORM 4: x as it is (W holds the norm's weight: folded_norm),
    # the 1/rms from those statistics scales the product's rows in the SiLU epilogue.
    r_rows = r_ptr + m.to(tl.int64)[:, None] * stride_rm
    s_rows = sum_ptr + m.to(tl.int64)[:, None] * stride_sm
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM == 3 or NORM == 4:
        t = tl.arange(0, BLOCK_SS)
        parts = tl.load(ss_ptr + m[:, None] * ss_tiles + t[None, :], mask=mm[:, None] & (t < ss_tiles)[None, :],
                        other=0.0)
        rstd = tl.rsqrt(tl.sum(parts, axis=1) / K + eps)
    elif NORM > 0:
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xm0 = mm[:, None] & (kk < K)[None, :]
            xs = tl.load(x_rows + kk[None, :], mask=xm0, other=0.0)
            if NORM == 2:
                rs = tl.load(r_rows + kk[None, :], mask=xm0, other=0.0)
                xs = (xs.to(tl.float32) + rs.to(tl.float32)).to(DT)
            xs = xs.to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(ss / K + eps)

    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < k_hi
        if BLOCK_M == 1:
            w = w_cur
            kn = k + AHEAD * BLOCK_K
            w_new = tl.load(w_rows + kn[None, :], mask=nm[:, None] & (kn < k_hi)[None, :], other=0.0)
            if AHEAD == 1:
                w_cur = w_new
            if AHEAD == 2:
                w_cur = w_nxt
                w_nxt = w_new
            if AHEAD == 3:
                w_cur = w_nxt
                w_nxt = w_far
                w_far = w_new
        elif W_BF12:
            w = _bf12_tile(w_rows, e_rows, w_base, k0, k_hi, nm, BLOCK_N, BLOCK_K, W_BF12 == 2)
        else:
            w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        xm = mm[:, None] & km[None, :]
        if SILU_MUL:  # x is [M, 2K] gate|up; the activation is rounded as the reference rounds it
            g = tl.load(x_rows + k[None, :], mask=xm, other=0.0)
            u = tl.load(x_rows + K + k[None, :], mask=xm, other=0.0)
            xt = silu_mul(g, u, DT)
        else:
            xt = tl.load(x_rows + k[None, :], mask=xm, other=0.0)
            if NORM == 2:
                rt = tl.load(r_rows + k[None, :], mask=xm, other=0.0)
                xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(DT)
                if pid_n == 0:
                    tl.store(s_rows + k[None, :], xt, mask=xm)
            if NORM > 0 and NORM != 4:
                nw = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
                xt = ((xt.to(tl.float32) * rstd[:, None]).to(DT).to(tl.float32) * nw[None, :]).to(DT)
        if BLOCK_M == 1:
            acc2 += w.to(tl.float32) * xt.to(tl.float32)
        else:
            acc += mma(xt, tl.trans(w.to(DT)), PREC, UPCAST)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    if W_SCALED:  # fp8 weights: each row's scale, once per output (every split's partial is scaled alike)
        acc = acc * tl.load(wscale_ptr + n, mask=nm, other=0.0)[None, :]
    pdl_launch_dependents(PDL == 2)  # "late": the next kernel's prologue overlaps this epilogue

    if ARGMAX:
        logits = acc.to(DT).to(tl.float32)  # compare the values the reference's logits hold
        logits = tl.where(nm[None, :], logits, float("-inf"))
        best = tl.max(logits, axis=1)
        arg = tl.argmax(logits, axis=1) + pid_n * BLOCK_N
        tiles = tl.num_programs(0)
        tl.store(val_ptr + m * tiles + pid_n, best, mask=mm)
        tl.store(idx_ptr + m * tiles + pid_n, arg, mask=mm)
    elif SPLIT_K == 1 and ADD_SS:
        _add_stats_epilogue(acc, out_ptr, r_ptr, ss_ptr, m, mm, n, nm, pid_n, stride_om, stride_rm, ss_tiles, DT,
                            SS_OUT)
    elif SPLIT_K == 1 and not ROPE and not SILU_OUT:
        tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])
        if ADD_NORM:
            _last_tile_add_norm(out_ptr, r_ptr, nw_ptr, sum_ptr, h_ptr, cnt_ptr, M, N, stride_om, stride_rm,
                                stride_sm, stride_hm, eps, BLOCK_NORM, DT)
    else:
        omask = mm[:, None] & nm[None, :]
        ws_tile = ws_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(ws_tile + pid_s * M * N, acc, mask=omask)
        if TICKET:
            # The last split of this tile to finish adds all partials (in split order, like the
            # sum kernel) and resets the tile's counter: no second kernel. The barrier makes every
            # thread's partial part of the counter's release.
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(0) + pid_n
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                if ROPE:
                    _rope_epilogue(ws_ptr, out_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, m, mm, pid_n,
                                   M, N, stride_om, stride_cs, QD, KD, BLOCK_M, BLOCK_N, SPLIT_K, HEAD_D, DT)
                elif SILU_OUT:
                    _silu_epilogue(ws_ptr, out_ptr, m, mm, pid_n, M, N, stride_om, BLOCK_M, BLOCK_N, SPLIT_K, DT,
                                   rstd, NORM == 4)
                else:
                    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    for s2 in tl.static_range(SPLIT_K):
                        total += tl.load(ws_tile + s2 * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                    if ADD_SS:
                        _add_stats_epilogue(total, out_ptr, r_ptr, ss_ptr, m, mm, n, nm, pid_n, stride_om,
                                            stride_rm, ss_tiles, DT, SS_OUT)
                    else:
                        tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :],
                                 total.to(out_ptr.dtype.element_ty), mask=omask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
                if ADD_NORM:
                    _last_tile_add_norm(out_ptr, r_ptr, nw_ptr, sum_ptr, h_ptr, cnt_ptr, M, N, stride_om,
                                        stride_rm, stride_sm, stride_hm, eps, BLOCK_NORM, DT)


@triton.jit
def _splitk_sum_kernel(ws_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nm = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (s * M + row).to(tl.int64) * N + n, mask=nm, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


def auto_split_k(tiles: int, K: int, block_k: int, device: torch.device) -> int:
    """Splits so that about four programs per SM stream W (enough loads in flight to reach full
    bandwidth), from static shapes only."""
    want = max(1, (4 * sm_count(device)) // max(1, tiles))
    return pow2_split(want, max(1, cdiv(K, block_k)), MAX_SPLIT_K)


def _check(name, x, weight, k_in):
    check_device(name, x, weight)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k_in:
        raise KernelInputError(f"{name}: need x[M, K] and weight[N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise KernelInputError(f"{name}: x and weight must be contiguous in K")
    if x.dtype != weight.dtype:
        raise KernelInputError(f"{name}: x dtype {x.dtype} != weight dtype {weight.dtype}")


def _check_norm_weight(name: str, norm_w: torch.Tensor, K: int, dtype: torch.dtype) -> None:
    if norm_w.shape != (K,) or norm_w.dtype != dtype:
        raise KernelInputError(f"{name}: norm weight must be [{K}] of {dtype}, got {tuple(norm_w.shape)} {norm_w.dtype}")


def _check_norm(name: str, x: torch.Tensor, K: int, residual: torch.Tensor | None, norm_w: torch.Tensor) -> None:
    """The inputs of an (add_)rmsnorm done in a GEMV's prologue."""
    check_device(name, residual, norm_w)
    _check_norm_weight(name, norm_w, K, x.dtype)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise KernelInputError(f"{name}: residual must match x {tuple(x.shape)} {x.dtype}, contiguous in K")


def _block_m(M: int, block_m: int, m1: str) -> int:
    """Rows per program: all of M in one tile up to ``block_m`` (W is then read once); the register
    FMA path (``m1="fma"``) for a single row, else ``tl.dot`` with M padded to 16."""
    if M == 1 and m1 == "fma":
        return 1
    return min(block_m, pow2(M, 16))


def _weight_copy(name: str, weight: torch.Tensor, weights: str, unpack: str):
    """What the kernel streams for ``weight`` in format ``weights``: (the tensor, the fp8 row scales
    or the bf12 rows' bases, the bf12 codes, the kernel's ``W_BF12`` mode: 0 not bf12, 1 Triton's
    integer unpack, 2 the PTX one)."""
    if unpack not in BF12_UNPACK:
        raise KernelInputError(f"{name}: unpack must be one of {BF12_UNPACK}, got {unpack!r}")
    if weights == "bf16":
        return weight, None, None, 0
    if weights == "fp8":  # the e4m3 copy streams instead of W; its row scales are applied once per output
        data, scale = fp8_of(weight)
        return data, scale, None, 0
    if weights == "bf12":  # low bytes and 4-bit codes stream instead of W
        if weight.dtype != torch.bfloat16:
            raise KernelInputError(f"{name}: bf12 weights pack bf16 weights, got {weight.dtype}")
        lo, codes, base, _ = bf12_of(weight)
        return lo, base, codes, 2 if unpack == "asm" and not interpreting() else 1
    raise KernelInputError(f"{name}: weights must be 'bf16', 'fp8' or 'bf12', got {weights!r}")


def _check_stats(name: str, ss: torch.Tensor, M: int) -> None:
    """``ss``: a GEMV's per-tile sums of squares of M rows (``add_stats``), as norm_stats and
    folded_stats read them."""
    if ss.dim() != 2 or ss.shape[0] != M or ss.dtype != torch.float32 or not ss.is_contiguous():
        raise KernelInputError(f"{name}: statistics must be float32 [{M}, tiles], got {tuple(ss.shape)} {ss.dtype}")


def small_m_gemm(
    x: torch.Tensor, weight: torch.Tensor, *, silu_mul_input: bool = False,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None, block_m: int = 64,
    block_n: int = GEMV_BLOCK_N, block_k: int = 128, split_k: int = 0, num_warps: int = 4, num_stages: int = 3,
    m1: str = "dot", reduce: str = "kernel", pdl: bool = False, rope: tuple | None = None,
    add_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, silu_out: bool = False,
    norm_stats: tuple[torch.Tensor, torch.Tensor, float] | None = None, add_stats: torch.Tensor | None = None,
    ahead: int = 1, weights: str = "bf16", unpack: str = "asm", add_into: torch.Tensor | None = None,
    into_stats: bool = False, folded_stats: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` for small M, any M correct; with ``weights="fp8"`` W is read as its e4m3 copy
    (``fp8_weights.fp8_of``: ``(x @ data.T) * scale``, half the bytes), with ``"bf12"`` as its
    12-bit copy (``bf12_weights.bf12_of``: three quarters of the bytes; the dot path only; ``unpack``
    "asm" rebuilds its bf16 values in PTX, "int" in Triton's integer ops, which the interpreter
    always takes); with ``silu_mul_input`` x is ``[M, 2K]`` and
    ``silu_and_mul(x)`` is used; with ``norm=(residual | None, norm_weight, eps)`` the input is
    ``rmsnorm(x [+ residual])`` and the result is ``(y, x + residual)`` when residual is given.
    The ``norm_stats`` fusion: ``add_stats=residual`` returns ``(y + residual, ss)``
    with ``ss[M, tiles]`` each tile's share of the rows' sums of squares; ``norm_stats=(ss,
    norm_weight, eps)`` normalises x (such a sum) with them as it loads it. ``add_into=stream``
    (``folded_norm``'s o / down): ``stream += y``, the sum rounded as ``add_stats``' is, in place, and
    ``stream`` returned; with ``into_stats`` also ``ss`` as ``add_stats`` leaves it: ``(stream, ss)``.
    ``folded_stats=(ss, eps)`` with ``silu_out`` (``folded_norm`` + ``gate_up_silu``): x is the
    un-normalised stream and W holds the norm's weight; each row's gate and up are scaled by
    ``rsqrt(sum(ss[row]) / K + eps)`` before the activation."""
    name = ("silu_mul_down_proj" if silu_mul_input else "norm_linear" if norm is not None or norm_stats is not None
            else "linear_add_stats" if add_stats is not None else "linear_residual_" if add_into is not None
            else "linear")
    check_pdl(name, pdl)
    M = x.shape[0]
    K = weight.shape[1] if weight.dim() == 2 else -1
    if silu_mul_input and (x.dim() != 2 or x.shape[1] != 2 * K):
        raise KernelInputError(f"{name}: need gate_up[M, 2*K] for weight[N, K], got {tuple(x.shape)}, {tuple(weight.shape)}")
    _check(name, x, weight, x.shape[1] // 2 if silu_mul_input else x.shape[1] if x.dim() == 2 else -1)
    N = weight.shape[0]
    weight, wscale, wexp, w_mode = _weight_copy(name, weight, weights, unpack)
    if weights == "bf12":
        m1 = "dot"  # the register-FMA path prefetches raw W tiles ahead of the PDL wait: bf16 only
    residual, norm_w, eps = norm if norm is not None else (None, None, 0.0)
    norm_w = norm_w.contiguous() if norm_w is not None else None
    if norm is not None:
        _check_norm(name, x, K, residual, norm_w)
    ss = None
    if folded_stats is not None:  # (ss[M, tiles] of the stream x, eps): folded_norm's 1/rms in the SiLU epilogue
        if not silu_out or norm is not None or norm_stats is not None:
            raise KernelInputError(f"{name}: folded_stats scales gate_up_silu's rows (silu_out), without a norm")
        ss, eps = folded_stats
        check_device(name, ss)
        _check_stats(name, ss, M)
    if norm_stats is not None:  # (ss[M, tiles] from a GEMV with add_stats, norm weight, eps)
        if norm is not None or add_stats is not None:
            raise KernelInputError(f"{name}: norm_stats takes the place of norm (and not with add_stats)")
        ss, norm_w, eps = norm_stats
        norm_w = norm_w.contiguous()
        check_device(name, ss, norm_w)
        _check_norm_weight(name, norm_w, K, x.dtype)
        _check_stats(name, ss, M)
    # rope = (positions, cos_sin, k_cache, v_cache, slot_mapping, stride_cs, q_width, q+k width,
    # head_dim) from `qkv_rope_store`: only q is written out, k and v go to the cache.
    if silu_out and (N % 2 or block_n < 2):
        raise KernelInputError(f"gate_up_silu: need weight[2*I, K] and block_n >= 2, got N={N}, block_n={block_n}")
    out = torch.empty((M, rope[6] if rope else N // 2 if silu_out else N), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    if add_norm is not None:  # (residual, norm_weight, eps) of the add_rmsnorm after this GEMV
        residual, norm_w, eps = add_norm
        norm_w = norm_w.contiguous()
        check_device(name, residual, norm_w)
        if norm_w.shape != (N,) or residual.shape != (M, N) or residual.stride(-1) != 1:
            raise KernelInputError(f"linear_add_rmsnorm: need residual[{M}, {N}] and norm weight [{N}], got "
                                   f"{tuple(residual.shape)}, {tuple(norm_w.shape)}")
        summed, h = torch.empty_like(out), torch.empty_like(out)
        if M == 0 or N == 0:
            return h, summed
    if add_stats is not None or add_into is not None:  # the residual this GEMV's output is added to
        if silu_out or rope or silu_mul_input or add_norm is not None or (add_stats is not None and add_into is not None):
            raise KernelInputError(f"{name}: add_stats / add_into are for a plain projection (o_proj, down_proj), "
                                   "one of them")
        residual = add_stats if add_stats is not None else add_into
        check_device(name, residual)
        if residual.shape != (M, N) or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise KernelInputError(f"{name}: residual must be [{M}, {N}] of {x.dtype}, contiguous in N, got "
                                   f"{tuple(residual.shape)} {residual.dtype}")
        if add_into is not None:
            if add_into.data_ptr() == x.data_ptr() and M > 0:
                raise KernelInputError(f"{name}: the stream added into must not be the input x")
            out = add_into  # each element read, summed and written by one program: in place is safe
            if into_stats:
                ss = torch.empty((M, cdiv(N, block_n)), dtype=torch.float32, device=x.device)
            if M == 0 or N == 0:
                return (add_into, ss.zero_()) if into_stats else add_into
        else:
            ss = torch.empty((M, cdiv(N, block_n)), dtype=torch.float32, device=x.device)
            if M == 0 or N == 0:
                return residual.clone(), ss.zero_()
    if M == 0 or N == 0:
        if summed is not None and M > 0:
            summed.copy_(x + residual)  # no N tile writes it
        return out if residual is None else (out, summed)
    if reduce not in ("kernel", "ticket") or m1 not in ("dot", "fma") or ahead not in (1, 2, 3):
        raise KernelInputError(f"{name}: reduce must be 'kernel' or 'ticket', m1 'dot' or 'fma', ahead 1-3")
    BLOCK_M = _block_m(M, block_m, m1)
    n_tiles = cdiv(N // 2, block_n // 2) if silu_out else cdiv(N, block_n)
    tiles = n_tiles * cdiv(M, BLOCK_M)
    if split_k == 0:
        split_k = auto_split_k(tiles, K, block_k, x.device)
    k_per_split = cdiv(cdiv(K, split_k), block_k) * block_k
    split_k = cdiv(K, k_per_split)  # no empty splits
    # epilogues that pair rows: through the workspace, at the last arrival, at one split too (session
    # 50, H100, 8B bs 12: splitting the accumulator in registers instead made gate_up_silu's GEMV
    # 81.5 us against 68.7 through the workspace and 63 for the plain gate_up)
    paired = bool(rope) or silu_out
    ws = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 or paired else out
    # the paired epilogues run at a tile's last arrival; the add-norm one at the grid's
    adds = add_stats is not None or add_into is not None
    ticket = (split_k > 1 and (reduce == "ticket" or add_norm is not None or adds)) or paired
    counters = tile_counters(x.device, tiles + 1) if ticket or add_norm is not None else out
    if BLOCK_M > 1:  # the M == 1 path keeps its tiles in registers (no shared-memory pipeline)
        x_cols = 2 * block_k if silu_mul_input else block_k
        num_stages = fit_stages(num_stages, (BLOCK_M * x_cols + block_n * block_k) * x.element_size())
    grid = (n_tiles, split_k, cdiv(M, BLOCK_M))
    r = residual if residual is not None else x
    sm = summed if summed is not None else x
    hn = h if add_norm is not None else out
    _gemv_kernel[grid](
        x, weight, out, ws, out, out, r, norm_w if norm_w is not None else x, sm, counters,
        *(rope[:5] if rope else (x,) * 5), hn,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0), r.stride(0), sm.stride(0), k_per_split, float(eps),
        *(rope[5:8] if rope else (0, 0, 0)), hn.stride(0), ss if ss is not None else x,
        ss.shape[1] if ss is not None else 0, wscale if wscale is not None else x, wexp if wexp is not None else x,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, SILU_MUL=silu_mul_input,
        NORM=3 if norm_stats is not None else 4 if folded_stats is not None else 0 if norm is None else
        1 if residual is None else 2, ARGMAX=False,
        TICKET=ticket, PREC=dot_precision(x.dtype), UPCAST=dot_upcast(), PDL=pdl_mode(pdl),
        ROPE=bool(rope), HEAD_D=rope[8] if rope else 1, ADD_NORM=add_norm is not None,
        BLOCK_NORM=pow2(N) if add_norm is not None else 1, SILU_OUT=silu_out,
        ADD_SS=adds, SS_OUT=add_stats is not None or into_stats, BLOCK_SS=pow2(ss.shape[1]) if ss is not None else 1, AHEAD=ahead,
        W_SCALED=weights == "fp8", W_BF12=w_mode,
        num_warps=num_warps, num_stages=num_stages, **launch_opts(pdl),
    )
    if add_norm is not None:
        return h, summed
    if add_stats is not None:
        return out, ss
    if add_into is not None:
        return (add_into, ss) if into_stats else add_into
    if split_k > 1 and not ticket:
        BLOCK = min(1024, pow2(N))
        _splitk_sum_kernel[(M, cdiv(N, BLOCK))](ws, out, M, N, out.stride(0), SPLIT_K=split_k, BLOCK=BLOCK,
                                                         PDL=pdl_enabled(pdl), num_warps=4, **launch_opts(pdl))
    return out if summed is None else (out, summed)


# The tunable params of every GEMV-based kernel (the fused entry points take them as keywords).
KERNEL_PARAMS = (
    Param("block_m", (16, 32, 64, 128), 64),  # rows per program; M up to this is one tile (W read once)
    Param("block_n", (16, 32, 64, 128), GEMV_BLOCK_N),
    Param("block_k", (64, 128, 256, 512), 128),
    Param("split_k", (0, 1, 2, 4, 8, 16), 0),  # 0 = auto from shapes and SM count
    Param("num_warps", (2, 4, 8), 4),
    Param("num_stages", (1, 2, 3, 4), 3),
    Param("m1", ("dot", "fma"), "dot"),  # M == 1: pipelined tl.dot (M padded to 16) or register FMA
    Param("reduce", ("kernel", "ticket"), "kernel"),  # split-K sum: second kernel, or last split adds
    Param("pdl", PDL_CHOICES, False),  # "late" / "after_wait": the next kernel launches once every program is past its loop / its wait
    Param("ahead", (1, 2, 3), 1),  # M == 1 FMA path: W tiles requested before the PDL wait / in flight ahead
)
GEMV_PARAMS = KERNEL_PARAMS + (
    # Above this many rows torch's GEMM runs; 0 = never. Not searched: at a prompt step's thousands of
    # rows the GEMV streams W once per row tile, which the fast tier's decode-step objective cannot see
    # (session 56: a tuned gate_up at max_m 0 doubled the slow tier's prompt steps and TTFT p90 in all
    # seven promoted candidates, and the compile kept its baseline).
    Param("max_m", (0, 1, 8, 16, 32, 64, 128, 256), GEMV_MAX_M, searched=(1, 8, 16, 32, 64, 128, 256)),
)


def _make_linear(max_m: int = GEMV_MAX_M, **params):
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if max_m and x.dim() == 2 and x.shape[0] > max_m:
            return F.linear(x, weight)
        return small_m_gemm(x, weight, **params)

    return linear


for _op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
    variant(
        _op, "triton_gemv_splitk", params=GEMV_PARAMS, devices=("cuda",),
        description="small-M GEMM/GEMV streaming W once for the batch, pipelined tl.dot, deterministic "
                    "split-K (sum kernel or last-arrival ticket); torch GEMM above max_m rows",
    )(_make_linear)


def _copy_linear(weights: str):
    """The builder of a projection's GEMV over its ``weights`` copy."""

    def build(max_m: int = GEMV_MAX_M, **params):
        def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if max_m and x.dim() == 2 and x.shape[0] > max_m:
                # Prompt rows: compute-bound, so a smaller copy would save nothing; the bf16 weight
                # (still held, and exact) through torch's GEMM. Unpacking per step instead cost the
                # H100's 8B chat replay 57 ms a prompt step (session 43, fp8).
                return F.linear(x, weight)
            return small_m_gemm(x, weight, weights=weights, **params)

        return linear

    return build


for _op in COPY_PROJECTIONS:
    variant(
        _op, FP8_WEIGHT_IMPL, params=GEMV_PARAMS, devices=("cuda",),
        description="the small-M GEMV over W's e4m3 copy with a scale per row (half the bytes; lossy, "
                    "the quality check decides); above max_m rows (prompt steps) torch's GEMM on the bf16 W",
    )(_copy_linear("fp8"))
    variant(
        _op, BF12_WEIGHT_IMPL,
        params=tuple(dataclasses.replace(p, default=bf12_gemv_defaults(_op).get(p.name, p.default))
                     for p in GEMV_PARAMS if p.name not in ("m1", "ahead")) + (Param("unpack", BF12_UNPACK, "asm"),),
        devices=("cuda",),
        description="the small-M GEMV (dot path) over W's bf12 copy: bf16 with a 4-bit exponent code a "
                    "weight, three quarters of the bytes; above max_m rows torch's GEMM on the bf16 W",
    )(_copy_linear("bf12"))


def silu_mul_down_proj(gate_up: torch.Tensor, weight: torch.Tensor, **params) -> torch.Tensor:
    """``down_proj(silu_and_mul(gate_up), weight)`` in one GEMV (see the module doc); ``params``
    from ``KERNEL_PARAMS``."""
    return small_m_gemm(gate_up, weight, silu_mul_input=True, **params)


def qkv_rope_store(
    x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
    num_kv_heads: int, **params,
) -> torch.Tensor:
    """``qk_rope_store(qkv_proj(x, weight), positions, cos_sin, k_cache, v_cache, slot_mapping,
    num_heads, num_kv_heads, None, None, eps)`` in one GEMV: the rotation and the cache store run in
    the epilogue of the tile's last split, so the ``[T, (H + 2*Hkv) * D]`` qkv tensor and the rope
    kernel (one launch per layer) disappear. Llama only (no q/k norm). Returns q ``[T, H, D]``;
    ``params`` from ``KERNEL_PARAMS`` (``block_n`` a multiple of the head size, see ``rope_fusable``)."""
    M, D = x.shape[0], cos_sin.shape[-1]
    block_n = params.get("block_n", GEMV_BLOCK_N)
    if not rope_fusable(block_n, D, num_heads, num_kv_heads):
        raise KernelInputError(f"qkv_rope_store: block_n {block_n} cannot tile heads of {D} "
                               f"({num_heads} q heads, {num_kv_heads} kv heads)")
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * D:
        raise KernelInputError(f"qkv_rope_store: weight rows {weight.shape[0]} != (H + 2*Hkv) * D")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cos_sin", cos_sin)):
        if not t.is_contiguous():
            raise KernelInputError(f"qkv_rope_store: {name} must be contiguous")
    if k_cache.shape[-2:] != (num_kv_heads, D) or v_cache.shape != k_cache.shape:
        raise KernelInputError(f"qkv_rope_store: caches must be [blocks, block_size, {num_kv_heads}, {D}]")
    if positions.shape != (M,) or slot_mapping.shape != (M,):
        raise KernelInputError("qkv_rope_store: positions and slot_mapping need one entry per row of x")
    qd = num_heads * D
    rope = (positions, cos_sin, k_cache, v_cache, slot_mapping, cos_sin.stride(0), qd, qd + num_kv_heads * D, D)
    return small_m_gemm(x, weight, rope=rope, **params).view(M, num_heads, D)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, **params) -> torch.Tensor:
    """``silu_and_mul(gate_up_proj(x, weight))`` -> ``[T, I]`` in one GEMV: each tile computes gate
    rows with their up rows and the last split applies the activation, so the ``[T, 2I]`` tensor
    and the activation kernel disappear; ``params`` from ``KERNEL_PARAMS``."""
    return small_m_gemm(x, weight, silu_out=True, **params)


def linear_add_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    **params,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm(linear(x, weight), residual, norm_weight, eps)`` -> ``(normed, summed)`` in one
    launch: the last tile of the GEMV to finish normalises the rows (see ``_last_tile_add_norm``).
    For o_proj and down_proj at decode; ``params`` from ``KERNEL_PARAMS``."""
    return small_m_gemm(x, weight, add_norm=(residual, norm_weight, eps), **params)


def add_rmsnorm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    **params,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(normed, weight), summed)`` where ``normed, summed = add_rmsnorm(x, residual,
    norm_weight, eps)``: the residual add and the norm run in the GEMV's prologue (each program
    recomputes the row statistics; one N tile writes ``summed``), so the norm kernel disappears.
    Meant for decode-sized M (the statistics are recomputed per N tile); ``params`` from
    ``KERNEL_PARAMS``."""
    return small_m_gemm(x, weight, norm=(residual, norm_weight, eps), **params)


def rmsnorm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, **params,
) -> torch.Tensor:
    """``linear(rmsnorm(x, norm_weight, eps), weight)`` in one GEMV (see ``add_rmsnorm_linear``)."""
    return small_m_gemm(x, weight, norm=(None, norm_weight, eps), **params)


# Tunable params of the fused entry points, as data for the search (same meaning as GEMV_PARAMS).
SILU_MUL_DOWN_PROJ_PARAMS = KERNEL_PARAMS
NORM_LINEAR_PARAMS = KERNEL_PARAMS
LM_HEAD_ARGMAX_PARAMS = (
    Param("block_m", (16, 32, 64, 128), 64),
    Param("block_n", (32, 64, 128, 256), 128),
    Param("block_k", (64, 128, 256), 128),
    Param("num_warps", (2, 4, 8), 4),
    Param("num_stages", (1, 2, 3, 4), 3),
    Param("m1", ("dot", "fma"), "dot"),
    Param("pdl", (False, True), False),
)


def lm_head_argmax(
    x: torch.Tensor, weight: torch.Tensor, *, block_m: int = 64, block_n: int = 128,
    block_k: int = 128, num_warps: int = 4, num_stages: int = 3, m1: str = "dot", pdl: bool = False,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None, weights: str = "bf16",
    unpack: str = "asm",
) -> torch.Tensor:
    """Greedy tokens ``argmax(x @ weight.T, -1)`` as int64 ``[B]`` without writing the logits.

    With ``norm=(residual | None, norm_weight, eps)`` the input is first ``(add_)rmsnorm``-ed in
    the kernel's prologue (the model's final norm), as in ``add_rmsnorm_linear``. ``weights`` /
    ``unpack``: W read from a second copy, as in ``small_m_gemm`` (the lm_head op on that copy)."""
    name = "lm_head_argmax"
    _check(name, x, weight, x.shape[1] if x.dim() == 2 else -1)
    weight, wscale, wexp, w_mode = _weight_copy(name, weight, weights, unpack)
    if weights == "bf12":
        m1 = "dot"
    M, K = x.shape
    residual, norm_w, eps = norm if norm is not None else (None, None, 0.0)
    norm_w = norm_w.contiguous() if norm_w is not None else None
    if norm is not None:
        _check_norm(name, x, K, residual, norm_w)
    N = weight.shape[0]
    tokens = torch.empty((M,), dtype=torch.int64, device=x.device)
    if M == 0:
        return tokens
    if N == 0:
        raise KernelInputError("lm_head_argmax: empty vocabulary")
    BLOCK_M = _block_m(M, block_m, m1)
    tiles = cdiv(N, block_n)
    vals = torch.empty((M, tiles), dtype=torch.float32, device=x.device)
    if BLOCK_M > 1:
        num_stages = fit_stages(num_stages, (BLOCK_M + block_n) * block_k * x.element_size())
    idxs = torch.empty((M, tiles), dtype=torch.int32, device=x.device)
    r = residual if residual is not None else x
    summed = torch.empty_like(x) if residual is not None else x  # written by the kernel, not returned
    _gemv_kernel[(tiles, 1, cdiv(M, BLOCK_M))](
        x, weight, vals, vals, vals, idxs, r, norm_w if norm_w is not None else x, summed, x,
        x, x, x, x, x, x,
        M, N, K, x.stride(0), weight.stride(0), 0, r.stride(0), summed.stride(0),
        cdiv(K, block_k) * block_k, float(eps), 0, 0, 0, 0, x, 0, x if wscale is None else wscale,
        x if wexp is None else wexp,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, SILU_MUL=False,
        NORM=0 if norm is None else 1 if residual is None else 2, ARGMAX=True, TICKET=False,
        PREC=dot_precision(x.dtype), UPCAST=dot_upcast(), PDL=pdl_mode(pdl), W_SCALED=weights == "fp8", W_BF12=w_mode,
        num_warps=num_warps, num_stages=num_stages, **launch_opts(pdl),
    )
    argmax_merge_kernel[(M,)](vals, idxs, tokens, tiles, BLOCK_T=min(1024, pow2(tiles)),
                                  PDL=pdl_enabled(pdl), num_warps=4, **launch_opts(pdl))
    return tokens


def norm_lm_head_argmax(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, **params,
) -> torch.Tensor:
    """Greedy tokens of ``lm_head((add_)rmsnorm(x [+ residual]))``: the model's final norm, the
    lm_head GEMV and the argmax in one pass (plus the small argmax merge); ``params`` from
    ``LM_HEAD_ARGMAX_PARAMS``."""
    return lm_head_argmax(x, weight, norm=(residual, norm_weight, eps), **params)


def linear_add_stats(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, **params,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(x, weight) + residual, ss)``: o_proj / down_proj for the ``norm_stats`` fusion.
    Each tile's finishing program adds the residual to its tile (rounded as ``add_rmsnorm`` rounds
    the sum) and writes its share of each row's sum of squares to ``ss[M, tiles]`` (float32), so
    the next GEMV can normalise the row without a norm kernel and without rereading it
    (``norm_stats_linear``); ``params`` from ``KERNEL_PARAMS``."""
    return small_m_gemm(x, weight, add_stats=residual, **params)


def linear_residual_(x: torch.Tensor, weight: torch.Tensor, stream: torch.Tensor, stats: bool = False,
                     **params) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``stream += linear(x, weight)``, in place, in the GEMV's epilogue (each tile's finishing program
    adds its tile, rounded as ``add_rmsnorm`` rounds the sum): o_proj / down_proj under ``folded_norm``
    when they are the Triton GEMV, as ``stream.addmm_`` is for cuBLAS. With ``stats`` also each
    tile's share of the new stream's rows' sums of squares, ``(stream, ss)``, for the gate_up GEMV's
    folded SiLU (``gate_up_silu(folded_stats=)``); ``params`` from ``KERNEL_PARAMS``."""
    return small_m_gemm(x, weight, add_into=stream, into_stats=stats, **params)


def norm_stats_linear(
    x: torch.Tensor, ss: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, **params,
) -> torch.Tensor:
    """``linear(rmsnorm(x, norm_weight, eps), weight)`` with the row statistics from
    ``linear_add_stats`` (summed in tile order: deterministic): the normalisation is applied as the
    GEMV loads x, rounded as the reference rounds it; ``params`` from ``KERNEL_PARAMS``. Also takes
    ``rope=``/``silu_out=`` through ``qkv_rope_store`` and ``gate_up_silu``."""
    return small_m_gemm(x, weight, norm_stats=(ss, norm_weight, eps), **params)
