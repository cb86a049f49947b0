"""Greedy argmax over the vocabulary (Triton): tiles reduce to (max, index), a merge picks the row's.

``torch.argmax`` over a ``[B, 128256]`` row runs as one long reduction (28 µs per decode step at
bs=1 on an H200, more than any other kernel of a 1B step but the lm_head); splitting the row over
many programs and merging their winners takes two short launches. Ties go to the lowest index, as
``torch.argmax`` does; a row of all ``-inf`` gives 0, as it does there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anneal.engine.kernels._common import (
    KernelInputError, cdiv, check_contiguous_last, check_device, launch_opts, pdl_enabled, pdl_prologue, pow2,
)
from anneal.engine.ops.registry import Param, variant


@triton.jit
def _argmax_tile_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.num_programs(1)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    tl.store(val_ptr + row * tiles + tile, tl.max(x, axis=0))
    tl.store(idx_ptr + row * tiles + tile, tl.argmax(x, axis=0, tie_break_left=True) + tile * BLOCK)


@triton.jit
def argmax_merge_kernel(val_ptr, idx_ptr, tok_ptr, TILES, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(0)``: the winner among its ``TILES`` (max, index) pairs, lowest index on ties."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    best = tl.full([BLOCK_T], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_T], tl.int32)
    for t0 in range(0, TILES, BLOCK_T):  # element-wise max per lane keeps the lowest tile on ties
        tt = t0 + t
        v = tl.load(val_ptr + row * TILES + tt, mask=tt < TILES, other=float("-inf"))
        i = tl.load(idx_ptr + row * TILES + tt, mask=tt < TILES, other=0)
        better = v > best
        best = tl.where(better, v, best)
        best_i = tl.where(better, i, best_i)
    top = tl.max(best, axis=0)
    # lanes holding the max: the lowest token index among them (lanes hold increasing tiles)
    cand = tl.where(best == top, best_i, 2147483647)
    tl.store(tok_ptr + row, tl.min(cand, axis=0).to(tl.int64))


@variant(
    "argmax", "triton",
    params=(Param("block", (256, 512, 1024, 2048, 4096, 8192), 4096), Param("num_warps", (2, 4, 8), 4),
            Param("pdl", (False, True), False)),
    devices=("cuda",),
    description="row split over programs, (max, index) per tile, one merge program per row",
)
def build_argmax(block: int = 4096, num_warps: int = 4, pdl: bool = False):
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        check_device("argmax", logits)
        if logits.dim() != 2:
            raise KernelInputError(f"argmax: need logits[B, V], got {tuple(logits.shape)}")
        check_contiguous_last("argmax", logits=logits)
        B, V = logits.shape
        tokens = torch.empty((B,), dtype=torch.int64, device=logits.device)
        if B == 0:
            return tokens
        if V == 0:
            raise KernelInputError("argmax: empty vocabulary")
        tiles = cdiv(V, block)
        vals = torch.empty((B, tiles), dtype=torch.float32, device=logits.device)
        idxs = torch.empty((B, tiles), dtype=torch.int32, device=logits.device)
        _argmax_tile_kernel[(B, tiles)](logits, vals, idxs, V, logits.stride(0), BLOCK=block,
                                        PDL=pdl_enabled(pdl), num_warps=num_warps, **launch_opts(pdl))
        argmax_merge_kernel[(B,)](vals, idxs, tokens, tiles, BLOCK_T=min(1024, pow2(tiles)),
                                  PDL=pdl_enabled(pdl), num_warps=4, **launch_opts(pdl))
        return tokens

    return argmax
