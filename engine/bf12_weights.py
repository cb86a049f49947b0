"""bf12: a bf16 weight in 12 bits, for the decode GEMV (``triton_gemv_bf12``), which is bound by W's
bytes and so streams it in three quarters of the time.

A bf16 value is a sign, an 8-bit exponent field and 7 mantissa bits. Within one row of a weight
matrix the exponents crowd into a narrow range (a trained or random row's values sit within a few
powers of two of its largest), so each weight keeps its sign and mantissa as one byte and its
exponent as a 4-bit code against the row's ``base``: code c in 1..15 is field ``base + c``, with
``base`` chosen so the row's largest exponent is code 15, and code 0 is field 0 (zeros and
subnormals, exactly). Every weight whose exponent is in that window (all but a few in ten thousand
of a Gaussian row) is stored exactly. The rest lie below the window's smallest normal, 2^-14 of
the row's largest power of two, and are rounded to the nearer of 0 and that value: an error of at
most ``max|w_row| * 2^-15`` on those weights alone, against bf16's own rounding of every weight
(2^-9 relative). ``pack`` counts them (``flushed``).

Layout: ``mant[N, K]`` uint8 (sign << 7 | mantissa), ``exps[N, K/2]`` uint8 (weight 2j's code in
the low nibble of byte j, weight 2j+1's in the high), ``base[N]`` int32: 1.5 bytes a weight.
The copy hangs on the bf16 tensor it was made from (engine/weight_copies.py, format ``"bf12"``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from anneal.engine import weight_copies

WINDOW = 15  # exponent codes 1..15; code 0 is exponent field 0


class Bf12Weight(NamedTuple):
    mant: torch.Tensor  # [N, K] uint8: sign << 7 | the 7 mantissa bits
    exps: torch.Tensor  # [N, K/2] uint8: two 4-bit exponent codes, weight 2j's in the low nibble
    base: torch.Tensor  # [N] int32: code c (1..15) is exponent field base + c
    flushed: int  # weights below their row's window, rounded to 0 or its smallest normal


def pack(w: torch.Tensor) -> Bf12Weight:
    """``w`` ([N, K] bf16, K even) in bf12 (see the module doc)."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or w.shape[1] % 2:
        raise ValueError(f"bf12 weights: need a bf16 [N, K] matrix with K even, got {w.dtype} {tuple(w.shape)}")
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sign, field, man = bits >> 15, (bits >> 7) & 0xFF, bits & 0x7F
    base = (field.amax(dim=1) - WINDOW).clamp(min=0) if w.numel() else torch.zeros(w.shape[0], dtype=torch.int32)
    inside = field > base[:, None]
    below = (field > 0) & ~inside  # under the window: round to 0 or the window's smallest normal
    up = below & (field == base[:, None])  # |w| >= half that normal
    code = torch.where(inside, field - base[:, None], torch.zeros_like(field))
    code = torch.where(up, torch.ones_like(code), code)
    man = torch.where(below, torch.zeros_like(man), man)
    mant = ((sign << 7) | man).to(torch.uint8)
    exps = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return Bf12Weight(mant.contiguous(), exps.contiguous(), base.to(torch.int32).contiguous(), int(below.sum()))


def unpacked(q: Bf12Weight) -> torch.Tensor:
    """The bf16 weight ``q`` stands for (what the bf12 GEMV multiplies by; the tests' reference)."""
    e = q.exps.to(torch.int32)
    code = torch.stack((e & 15, e >> 4), dim=-1).reshape(q.mant.shape)
    field = torch.where(code == 0, torch.zeros_like(code), code + q.base[:, None])
    m = q.mant.to(torch.int32)
    bits = ((m >> 7) << 15) | (field << 7) | (m & 0x7F)
    return bits.to(torch.int16).view(torch.bfloat16)


def reference_linear(x: torch.Tensor, q: Bf12Weight) -> torch.Tensor:
    """``x @ unpacked(q).T`` in fp32, rounded to x's dtype: what the bf12 GEMV computes."""
    return (x.float() @ unpacked(q).float().T).to(x.dtype)


def bf12_bytes(w: torch.Tensor) -> int:
    """Bytes ``w``'s bf12 copy holds (or would hold): 1.5 per element plus an int32 per row."""
    return w.numel() * 3 // 2 + 4 * w.shape[0]


weight_copies.register("bf12", pack, bf12_bytes)


def bf12_of(w: torch.Tensor) -> Bf12Weight:
    """``w``'s bf12 copy, made on first use and kept on ``w`` (never inside a CUDA-graph capture)."""
    return weight_copies.copy_of(w, "bf12")
