"""bf12: a bf16 weight in 12 bits, for the decode GEMV (``triton_gemv_bf12``), which is bound by W's
bytes and so could stream it in three quarters of the time.

A bf16 value is two bytes: the high one is the sign and the exponent's top 7 bits, the low one the
exponent's last bit and the 7 mantissa bits. Within one row of a weight matrix the exponents crowd
into a narrow range (a trained or random row's values sit within a few powers of two of its
largest), so the low byte is kept as it is and the high byte as a 4-bit code: the sign and the top
exponent bits less the row's ``base`` (0..7), ``base`` chosen so the row's largest is code 7. That
is a window of 16 exponents under the row's largest power of two; every weight in it is stored
exactly (all but a few in ten thousand of a Gaussian row). The rest (smaller than 2^-14 of the row's
largest power of two, zeros included unless the row is that small) are stored as the window's
smallest value with their sign: an error of at most ``max|w_row| * 2^-15`` on those weights alone,
against bf16's own rounding of every weight (2^-9 relative). ``pack`` counts them (``flushed``).

Rebuilding a weight is a few integer operations (``hi = v + 15 * (v & 8) + base``, then
``hi << 8 | lo``), which the GEMV does on each tile after loading it (session 44's first layout, a
sign|mantissa byte and an exponent code with a special zero, took twice as many and ran 1.15-1.24x
slower than the bf16 GEMV on an H100).

Layout: ``lo[N, K]`` uint8 (each bf16's low byte), ``codes[N, K/2]`` uint8 (weight 2j's code in the
low nibble of byte j, weight 2j+1's in the high; a code is ``sign << 3 | top7 - base``),
``base[N]`` int32: 1.5 bytes a weight. The copy hangs on the bf16 tensor it was made from
(engine/weight_copies.py, format ``"bf12"``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from anneal.engine import weight_copies

CODES = 8  # top-7 exponent values a row keeps: 16 exponents with the low byte's last exponent bit


class Bf12Weight(NamedTuple):
    lo: torch.Tensor  # [N, K] uint8: each bf16's low byte (last exponent bit, 7 mantissa bits)
    codes: torch.Tensor  # [N, K/2] uint8: two 4-bit codes (sign << 3 | top7 - base), weight 2j's low
    base: torch.Tensor  # [N] int32: the row's smallest top-7 exponent bits
    flushed: int  # weights below their row's window, stored as its smallest value


def pack(w: torch.Tensor) -> Bf12Weight:
    """``w`` ([N, K] bf16, K even) in bf12 (see the module doc), a block of rows at a time."""
    if w.dim() != 2 or w.dtype != torch.bfloat16 or w.shape[1] % 2:
        raise ValueError(f"bf12 weights: need a bf16 [N, K] matrix with K even, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    lo = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    codes = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    base = torch.zeros(n, dtype=torch.int32, device=w.device)
    flushed = torch.zeros((), dtype=torch.int64, device=w.device)
    for r in weight_copies.row_blocks(w):
        flushed += _pack_rows(w[r], lo[r], codes[r], base[r])
    return Bf12Weight(lo, codes, base, int(flushed))


def _pack_rows(w: torch.Tensor, lo_out: torch.Tensor, codes_out: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
    """Rows of ``w`` into their slices of the copy; returns how many weights were flushed."""
    if not w.numel():
        return torch.zeros((), dtype=torch.int64, device=w.device)
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    lo, sign, top = bits & 0xFF, bits >> 15, (bits >> 8) & 0x7F
    base = (top.amax(dim=1) - (CODES - 1)).clamp(min=0)
    below = top < base[:, None]  # under the window: the window's smallest value, signed
    code = torch.where(below, torch.zeros_like(top), top - base[:, None])
    lo_out.copy_(torch.where(below, torch.zeros_like(lo), lo))
    v = (sign << 3) | code
    codes_out.copy_(v[:, 0::2] | (v[:, 1::2] << 4))
    base_out.copy_(base)
    return torch.count_nonzero(below)


def unpacked(q: Bf12Weight) -> torch.Tensor:
    """The bf16 weight ``q`` stands for (what the bf12 GEMV multiplies by; the tests' reference)."""
    c = q.codes.to(torch.int32)
    v = torch.stack((c & 15, c >> 4), dim=-1).reshape(q.lo.shape)
    hi = v + (v & 8) * 15 + q.base[:, None]  # sign << 7 | (top7 - base) + base
    return ((hi << 8) | q.lo.to(torch.int32)).to(torch.int16).view(torch.bfloat16)


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
