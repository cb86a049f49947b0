"""RMSNorm and fused residual-add + RMSNorm (Triton): one program per row.

Numerics follow the reference (``anneal.engine.ops.reference._rms``) step by step: the sum
``x + residual`` is rounded to the activation dtype before it is normalised, the normalised row is
rounded to that dtype before the weight multiplies it, and the product is rounded once more. Only
the order of the fp32 sum of squares differs, so outputs match the reference to the last bit in
almost every element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, check_contiguous_last, check_device, launch_opts, pdl_enabled, pdl_prologue, pow2,
)
from anneal.engine.ops.registry import Param, variant

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    H, stride_x, stride_r, stride_o, stride_s, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Rounded to the activation dtype, as `x + residual` is in the reference.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, num_warps, pdl=False):
    name = "add_rmsnorm" if residual is not None else "rmsnorm"
    check_device(name, x, residual, weight)
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise KernelInputError(f"{name}: need x[T, H] and weight[H], got {tuple(x.shape)}, {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise KernelInputError(f"{name}: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    T, H = x.shape
    if H > MAX_HIDDEN:
        raise KernelInputError(f"{name}: hidden size {H} > {MAX_HIDDEN} (one row per program)")
    weight = weight.contiguous()
    check_contiguous_last(name, x=x, **({"residual": residual} if residual is not None else {}))
    out = torch.empty((T, H), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x) if residual is not None else out
    if T > 0:
        r = residual if residual is not None else x
        _rmsnorm_kernel[(T,)](
            x, r, weight, out, summed, H, x.stride(0), r.stride(0), out.stride(0), summed.stride(0),
            float(eps), HAS_RESIDUAL=residual is not None, BLOCK_H=pow2(H), PDL=pdl_enabled(pdl),
            num_warps=num_warps, **launch_opts(pdl),
        )
    return out, summed


_WARPS = Param("num_warps", (1, 2, 4, 8, 16), 4)
_PDL = Param("pdl", (False, True), False)


@variant("rmsnorm", "triton", params=(_WARPS, _PDL), devices=("cuda",),
         description="one program per row, fp32 statistics, reference rounding")
def build_rmsnorm(num_warps: int = 4, pdl: bool = False):
    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _launch(x, None, weight, eps, num_warps, pdl)[0]

    return rmsnorm


@variant("add_rmsnorm", "triton", params=(_WARPS, _PDL), devices=("cuda",),
         description="residual add and RMSNorm in one pass: reads x and residual once, writes both outputs")
def build_add_rmsnorm(num_warps: int = 4, pdl: bool = False):
    def add_rmsnorm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(x, residual, weight, eps, num_warps, pdl)

    return add_rmsnorm
