"""SiLU-and-mul (Triton): ``silu(x[:, :I]) * x[:, I:]``, elementwise over column tiles.

For the fused form that feeds the down projection directly from the gate/up output (no ``[T, I]``
intermediate), see ``anneal.engine.kernels.gemv.silu_mul_down_proj``. With ``rms_of`` (the
``folded_norm`` fusion) each row of gate/up is first scaled by ``rsqrt(mean(rms_of[row]**2) + eps)``:
the gate/up projection ran on the un-normalised residual stream through weights with the post-
attention norm's weight folded in (reference: ``reference.rms_scaled``, then the activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, cdiv, check_contiguous_last, check_device, launch_opts, pdl_enabled, pdl_prologue,
    rms_operand, row_rstd, sm_count,
)
from anneal.engine.ops.registry import Param, variant


@triton.jit
def silu_mul(gate, up, OUT_DTYPE: tl.constexpr):
    """``silu(gate) * up`` rounded as the reference rounds: silu to OUT_DTYPE first, then the product."""
    g = gate.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    return (s * up.to(tl.float32)).to(OUT_DTYPE)


@triton.jit(do_not_specialize=["tiles"])  # one compiled kernel for every tiles value (no JIT mid-serving)
def _silu_and_mul_kernel(x_ptr, out_ptr, rms_ptr, I, stride_x, stride_o, stride_rms, hidden, rms_eps, tiles,
                         BLOCK: tl.constexpr, RMS: tl.constexpr, BLOCK_HID: tl.constexpr, PDL: tl.constexpr):
    """Program (row, j) does column tiles ``j * tiles ... j * tiles + tiles - 1`` of its row."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    scale = 1.0
    if RMS:  # folded_norm: the post-attention norm's 1/rms, from the residual row the projection read
        scale = row_rstd(rms_ptr + row * stride_rms, hidden, rms_eps, BLOCK_HID)
    for t in range(0, tiles):
        offs = (tl.program_id(1) * tiles + t) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
        if RMS:
            g = (g.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
            u = (u.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, silu_mul(g, u, out_ptr.dtype.element_ty), mask=mask)


def tiles_per_program(rows: int, col_tiles: int, device: torch.device) -> int:
    """Column tiles one program does: 1 while the grid is small (decode: every SM busy), more once
    there are ~8 programs per SM anyway (prompt steps), so that ``rms_of``'s row is read once per
    program, not once per tile (3072 rows x 14 tiles read 350 MB of it per layer)."""
    return max(1, min(col_tiles, (rows * col_tiles) // (8 * sm_count(device))))


def silu_and_mul(x: torch.Tensor, *, block: int = 1024, num_warps: int = 4, pdl: bool = False,
                 rms_of: torch.Tensor | None = None, rms_eps: float = 0.0) -> torch.Tensor:
    """The op; ``rms_of`` ``[T, hidden]``: each row scaled by that row's 1/rms first (see the module doc)."""
    check_device("silu_and_mul", x, rms_of)
    if x.dim() != 2 or x.shape[1] % 2:
        raise KernelInputError(f"silu_and_mul: need x[T, 2*I], got {tuple(x.shape)}")
    check_contiguous_last("silu_and_mul", x=x)
    rms, block_hid = rms_operand("silu_and_mul", rms_of, x.shape[0], x)
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T > 0 and I > 0:
        col_tiles = cdiv(I, block)
        tiles = tiles_per_program(T, col_tiles, x.device) if rms_of is not None else 1
        grid = (T, cdiv(col_tiles, tiles))
        _silu_and_mul_kernel[grid](x, out, rms, I, x.stride(0), out.stride(0), rms.stride(0), rms.shape[1],
                                   float(rms_eps), tiles, BLOCK=block, RMS=rms_of is not None,
                                   BLOCK_HID=block_hid,
                                   PDL=pdl_enabled(pdl), num_warps=num_warps, **launch_opts(pdl))
    return out


@variant(
    "silu_and_mul", "triton",
    params=(Param("block", (256, 512, 1024, 2048, 4096), 1024), Param("num_warps", (1, 2, 4, 8), 4),
            Param("pdl", (False, True), False)),
    devices=("cuda",),
    description="elementwise over [row, column tile]; reference rounding",
)
def build_silu_and_mul(block: int = 1024, num_warps: int = 4, pdl: bool = False):
    def silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:  # the op's own signature (the registry's contract)
        return silu_and_mul(x, block=block, num_warps=num_warps, pdl=pdl)

    return silu_and_mul_op
