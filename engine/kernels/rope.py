"""Split qkv + optional per-head q/k RMSNorm (Qwen3) + rotate-half RoPE + paged KV-cache store.

One program per token does all of it: q is written to a fresh ``[T, H, D]`` tensor, k (rotated) and
v go straight into the cache slot ``slot_mapping[t]`` (skipped when ``-1``), so the rotated k never
round-trips through memory. With ``rms_of`` (the ``folded_norm`` fusion) the program first scales its
qkv row by ``rsqrt(mean(rms_of[t]**2) + eps)``: the qkv projection then ran on the un-normalised
residual stream through weights with the input norm's weight folded in, and this is the norm's
other half (reference: ``reference.rms_scaled``). Rounding follows the reference: the normalised head is rounded to the
activation dtype before its weight multiplies it, cos/sin are rounded to the activation dtype, and
each product and sum of the rotation is rounded as the reference's elementwise ops round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, check_contiguous_last, check_device, launch_opts, pdl_enabled, pdl_prologue, pow2, rms_operand,
    row_rstd,
)
from anneal.engine.ops.registry import Param, variant


# The RoPE store kernel compiles without FMA contraction: with it, sm_90's backend turns
# ``_rnd(_rnd(x1 * cos) - _rnd(x2 * sin))`` into ``fma.rn.bf16(x1, cos, -rnd(x2 * sin))``, skipping the
# product's rounding, and k came out an ulp off the reference in ~17% of its elements on the H200
# (session 21, bench/rope_store_rounding.py). Without it every product and sum rounds as the
# reference's elementwise ops round them; the kernel is memory-bound, the extra instructions free.
QK_ROPE_STORE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rnd(x, DT: tl.constexpr):
    return x.to(DT).to(tl.float32)


@triton.jit
def _norm_rope(
    src, n_heads, w_ptr, cos, sin, eps, row_scale,
    HAS_NORM: tl.constexpr, D: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    DT: tl.constexpr, SCALED: tl.constexpr,
):
    """Load ``n_heads`` heads at ``src`` (head h at ``src + h*D``), scale (``SCALED``: by
    ``row_scale``, rounded as ``reference.rms_scaled`` rounds), norm + rotate them; fp32 halves."""
    HALF: tl.constexpr = D // 2
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < HALF)
    x1 = tl.load(src + h * D + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * D + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x1 = _rnd(x1 * row_scale, DT)
        x2 = _rnd(x2 * row_scale, DT)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        dm = d < HALF
        w1 = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)
        x1 = _rnd(_rnd(x1 * rstd, DT) * w1, DT)
        x2 = _rnd(_rnd(x2 * rstd, DT) * w2, DT)
    o1, o2 = rotate_half(x1, x2, cos, sin, DT)
    return o1, o2, h, d, mask


@triton.jit
def rotate_half(x1, x2, cos, sin, DT: tl.constexpr):
    """Rotate-half RoPE of a head's halves (fp32 in, fp32 out), every product and sum rounded to
    the activation dtype as the reference's elementwise ops round them."""
    o1 = _rnd(_rnd(x1 * cos, DT) - _rnd(x2 * sin, DT), DT)
    o2 = _rnd(_rnd(x2 * cos, DT) + _rnd(x1 * sin, DT), DT)
    return o1, o2


@triton.jit
def rope_heads(row, head0, n_heads, cos, sin, nw_ptr, eps, row_scale, d, D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               HAS_NORM: tl.constexpr, SCALED: tl.constexpr, DT: tl.constexpr):
    """``_norm_rope`` on whole heads (the decode attention's ``rope_attention`` prologue): heads
    ``head0 ..`` (``n_heads`` of ``BLOCK_ROWS`` rows) of a qkv row, ``[BLOCK_ROWS, BLOCK_D]`` fp32
    holding activation-dtype values, rounded as ``_norm_rope`` rounds. Each element's rotate-half
    partner (``d +- D/2``) is loaded beside it; ``cos``/``sin`` are laid out per column."""
    HALF: tl.constexpr = D // 2
    h = (head0 + tl.arange(0, BLOCK_ROWS))[:, None]
    hm = (tl.arange(0, BLOCK_ROWS) < n_heads)[:, None] & (d < D)[None, :]
    dd = d[None, :]
    partner = tl.where(dd < HALF, dd + HALF, dd - HALF)
    x = tl.load(row + h * D + dd, mask=hm, other=0.0).to(tl.float32)
    xp = tl.load(row + h * D + partner, mask=hm, other=0.0).to(tl.float32)
    if SCALED:
        x = _rnd(x * row_scale, DT)
        xp = _rnd(xp * row_scale, DT)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        w = tl.load(nw_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
        wp = tl.load(nw_ptr + partner, mask=dd < D, other=0.0).to(tl.float32)
        x = _rnd(_rnd(x * rstd, DT) * w, DT)
        xp = _rnd(_rnd(xp * rstd, DT) * wp, DT)
    # rotate_half: first half x*cos - x'*sin, second half x*cos + x'*sin, each product rounded
    xs = _rnd(xp * sin, DT)
    xc = _rnd(x * cos, DT)
    return _rnd(tl.where(dd < HALF, xc - xs, xc + xs), DT)


@triton.jit
def _qk_rope_store_kernel(
    qkv_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr, qn_ptr, kn_ptr, rms_ptr,
    stride_qkv, stride_cs, stride_rms, H, HKV, eps, hidden, rms_eps,
    HAS_NORM: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, RMS: tl.constexpr, BLOCK_HID: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    DT = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    row = qkv_ptr + t * stride_qkv
    scale = 1.0
    if RMS:  # folded_norm: the input norm's 1/rms, from the residual row the projection read
        scale = row_rstd(rms_ptr + t * stride_rms, hidden, rms_eps, BLOCK_HID)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dd = tl.arange(0, BLOCK_HALF)[None, :]
    cos = _rnd(tl.load(cs_ptr + pos * stride_cs + dd, mask=dd < HALF, other=0.0), DT)
    sin = _rnd(tl.load(cs_ptr + pos * stride_cs + HALF + dd, mask=dd < HALF, other=0.0), DT)

    q1, q2, h, d, mask = _norm_rope(row, H, qn_ptr, cos, sin, eps, scale, HAS_NORM, D, BLOCK_H, BLOCK_HALF, DT, RMS)
    qo = q_ptr + t * H * D + h * D + d
    tl.store(qo, q1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(qo + HALF, q2.to(q_ptr.dtype.element_ty), mask=mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        k1, k2, hk, dk, mk = _norm_rope(row + H * D, HKV, kn_ptr, cos, sin, eps, scale, HAS_NORM, D, BLOCK_HKV,
                                        BLOCK_HALF, DT, RMS)
        ko = kc_ptr + slot * HKV * D + hk * D + dk
        tl.store(ko, k1.to(kc_ptr.dtype.element_ty), mask=mk)
        tl.store(ko + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mk)
        v = row + (H + HKV) * D + hk * D + dk
        vo = vc_ptr + slot * HKV * D + hk * D + dk
        v1 = tl.load(v, mask=mk).to(tl.float32)
        v2 = tl.load(v + HALF, mask=mk).to(tl.float32)
        if RMS:
            v1 = v1 * scale
            v2 = v2 * scale
        tl.store(vo, v1.to(vc_ptr.dtype.element_ty), mask=mk)
        tl.store(vo + HALF, v2.to(vc_ptr.dtype.element_ty), mask=mk)


def check_rope_operands(
    name: str, rows: str, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
) -> tuple[int, int]:
    """``(rows, head_dim)`` of ``qk_rope_store``'s operands (its own kernel's, or the decode attention
    that does its work under ``rope_attention``), checked; ``rows`` names the first dim in errors."""
    T = qkv.shape[0]
    D = cos_sin.shape[-1]
    if D % 2 or qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * D:
        raise KernelInputError(
            f"{name}: qkv {tuple(qkv.shape)} is not [{rows}, (H + 2*Hkv) * D] for H={num_heads}, "
            f"Hkv={num_kv_heads}, D={D} (D from cos_sin, must be even)"
        )
    if positions.shape != (T,) or slot_mapping.shape != (T,):
        raise KernelInputError(f"{name}: positions and slot_mapping must be [{rows}={T}]")
    if (q_norm is None) != (k_norm is None):
        raise KernelInputError(f"{name}: pass both q_norm and k_norm or neither")
    if q_norm is not None:
        if q_norm.shape != (D,) or k_norm.shape != (D,):
            raise KernelInputError(f"{name}: q_norm/k_norm must be [D={D}]")
        if q_norm.dtype != qkv.dtype or k_norm.dtype != qkv.dtype:
            raise KernelInputError(f"{name}: q_norm/k_norm dtype must be the activation dtype {qkv.dtype}")
    check_contiguous_last(name, qkv=qkv, cos_sin=cos_sin)
    return T, D


def qk_rope_store(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_heads: int, num_kv_heads: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
    *, num_warps: int = 4, pdl: bool = False, rms_of: torch.Tensor | None = None, rms_eps: float = 0.0,
) -> torch.Tensor:
    """The op (see the module doc); ``rms_of`` ``[T, hidden]``: scale each qkv row by that row's
    ``rsqrt(mean(x**2) + rms_eps)`` first (the ``folded_norm`` fusion)."""
    name = "qk_rope_store"
    check_device(name, qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, rms_of)
    T, D = check_rope_operands(name, "T", qkv, positions, cos_sin, slot_mapping, num_heads, num_kv_heads,
                               q_norm, k_norm)
    want = (num_kv_heads, D)
    if tuple(k_cache.shape[2:]) != want or k_cache.shape != v_cache.shape:
        raise KernelInputError(f"{name}: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} are not [NB, BS, {num_kv_heads}, {D}]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError(f"{name}: k_cache and v_cache must be contiguous")
    rms, block_hid = rms_operand(name, rms_of, T, qkv)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()  # flat arrays
    q = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    has_norm = q_norm is not None
    if has_norm:
        q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()
    _qk_rope_store_kernel[(T,)](
        qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, q,
        q_norm if has_norm else qkv, k_norm if has_norm else qkv, rms,
        qkv.stride(0), cos_sin.stride(0), rms.stride(0), num_heads, num_kv_heads, float(eps),
        rms.shape[1], float(rms_eps),
        HAS_NORM=has_norm, D=D, BLOCK_H=pow2(num_heads), BLOCK_HKV=pow2(num_kv_heads),
        BLOCK_HALF=pow2(D // 2), RMS=rms_of is not None, BLOCK_HID=block_hid,
        PDL=pdl_enabled(pdl), num_warps=num_warps, **QK_ROPE_STORE_OPTIONS, **launch_opts(pdl),
    )
    return q


@variant(
    "qk_rope_store", "triton",
    params=(Param("num_warps", (1, 2, 4, 8), 4), Param("pdl", (False, True), False)),
    devices=("cuda",),
    description="one program per token: split, per-head q/k norm, rotate-half RoPE, cache store",
)
def build_qk_rope_store(num_warps: int = 4, pdl: bool = False):
    # A closure with the op's own signature (the registry's contract), not a partial.
    def qk_rope_store_op(
        qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
        num_heads: int, num_kv_heads: int,
        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
    ) -> torch.Tensor:
        return qk_rope_store(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                             q_norm, k_norm, eps, num_warps=num_warps, pdl=pdl)

    return qk_rope_store_op
