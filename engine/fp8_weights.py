"""Weight-only fp8: a projection's weight kept a second time as e4m3 with one fp32 scale per output
row, so a decode GEMV, bound by W's bytes, streams half of them.

Lossy by design: ``y = (x @ data.T) * scale`` is not ``x @ W.T``. A plan takes it by choosing the
``triton_gemv_fp8`` variant for a projection, and only the verification suite's quality check
against the reference plan says whether the model's outputs survive it (on a trained checkpoint they
do; on random weights, whose logits are near ties, they do not: bench/NOTES.md, sessions 41-43).

Only decode-sized row counts read it: above the variant's ``max_m`` rows (prompt steps, bound by
compute, where e4m3 would save nothing) the bf16 weight, still held, goes through torch's GEMM.

The copy hangs on the bf16 tensor it was made from (engine/weight_copies.py, format ``"fp8"``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from anneal.engine import weight_copies

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


class Fp8Weight(NamedTuple):
    data: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32: row n of W ~= data[n] * scale[n]


def quantize(w: torch.Tensor) -> Fp8Weight:
    """``w`` ([N, K]) as e4m3 rows scaled so each row's largest magnitude lands on 448 (round to
    nearest; an all-zero row keeps scale 1), a block of rows at a time."""
    if w.dim() != 2:
        raise ValueError(f"fp8 weights: need a [N, K] matrix, got {tuple(w.shape)}")
    data = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r in weight_copies.row_blocks(w):
        wf = w[r].float()
        amax = wf.abs().amax(dim=1) if wf.numel() else torch.zeros(wf.shape[0], device=w.device)
        scale[r] = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        data[r] = (wf / scale[r, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data, scale)


def dequantized(q: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale`` rounded to ``dtype``: the weight the fp8 GEMV stands for, as a dense tensor
    (the tests run the bf16 kernels and the reference plan on it)."""
    return (q.data.float() * q.scale[:, None]).to(dtype)


def reference_linear(x: torch.Tensor, q: Fp8Weight) -> torch.Tensor:
    """``(x @ data.T) * scale`` in fp32, rounded to x's dtype: what the fp8 GEMV computes, in plain
    PyTorch (its tests' reference)."""
    return ((x.float() @ q.data.float().T) * q.scale).to(x.dtype)


def fp8_bytes(w: torch.Tensor) -> int:
    """Bytes ``w``'s e4m3 copy holds (or would hold): one per element plus a float32 per row."""
    return w.numel() + 4 * w.shape[0]


weight_copies.register("fp8", quantize, fp8_bytes)


def fp8_of(w: torch.Tensor) -> Fp8Weight:
    """``w``'s e4m3 copy, made on first use and kept on ``w`` (never inside a CUDA-graph capture)."""
    return weight_copies.copy_of(w, "fp8")
