"""A projection's weight kept a second time in another format (``fp8``: e4m3 with a scale per row;
``bf12``: bf16 with a 4-bit exponent code), so a decode GEMV bound by W's bytes streams fewer.

The copy hangs on the bf16 tensor it was made from (made on first use, outside any CUDA-graph
capture, or before the KV cache is sized when the engine starts on such a plan), so every op and
fusion that is handed the weight finds it, and it lives no longer than that weight; the engine
drops the copies when it applies a plan that uses none (``drop``). The bf16 weight stays: prompt
steps, bound by compute, run it through torch's GEMM.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator

import torch

_LOCK = threading.Lock()  # the engine thread and compile-ahead passes may ask at once
_MAKERS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[torch.Tensor], int]]] = {}


ROW_BLOCK_ELEMENTS = 1 << 23  # a block's 4-byte temporaries: 32 MB each, whatever the weight's size


def row_blocks(w: torch.Tensor) -> Iterator[slice]:
    """The row ranges a maker converts one at a time. On lm_head (0.5 G weights) the whole
    matrix's fp32/int32 temporaries, and the int64 a bool ``sum`` casts it to (3.9 GB), ran a fast
    tier out of GPU memory beside its slow tier on an H100 (session 47); the copies themselves are
    1-1.5 bytes a weight."""
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, w.shape[1]))
    for r0 in range(0, w.shape[0], rows):
        yield slice(r0, min(w.shape[0], r0 + rows))


def register(fmt: str, make: Callable[[torch.Tensor], Any], nbytes: Callable[[torch.Tensor], int]) -> None:
    """``make(w)`` builds ``fmt``'s copy of ``w``; ``nbytes(w)`` says what it holds (or would)."""
    _MAKERS[fmt] = (make, nbytes)


def _attr(fmt: str) -> str:
    if fmt not in _MAKERS:  # the formats register themselves when their modules are first imported
        from anneal.engine import bf12_weights, fp8_weights  # noqa: F401
    if fmt not in _MAKERS:
        raise ValueError(f"weight copies: unknown format {fmt!r} (known: {sorted(_MAKERS)})")
    return f"_anneal_{fmt}"


def copy_of(w: torch.Tensor, fmt: str) -> Any:
    """``w``'s ``fmt`` copy, made on first use and kept on ``w``. Never inside a CUDA-graph capture:
    the graph would replay making it every step."""
    attr = _attr(fmt)
    q = getattr(w, attr, None)
    if q is not None:
        return q
    with _LOCK:
        q = getattr(w, attr, None)
        if q is None:
            if w.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{fmt} weights must be made before a CUDA-graph capture (warm the plan up first)")
            q = _MAKERS[fmt][0](w)
            setattr(w, attr, q)
    return q


def has_copy(w: torch.Tensor, fmt: str) -> bool:
    return getattr(w, _attr(fmt), None) is not None


def copy_bytes(w: torch.Tensor, fmt: str) -> int:
    """Bytes ``w``'s ``fmt`` copy holds (or would hold)."""
    _attr(fmt)
    return _MAKERS[fmt][1](w)


def drop(tensors: Iterable[torch.Tensor], fmt: str) -> int:
    """Forget the ``fmt`` copies of ``tensors``; the bytes given back."""
    attr, freed = _attr(fmt), 0
    for t in tensors:
        if getattr(t, attr, None) is not None:
            freed += copy_bytes(t, fmt)
            delattr(t, attr)
    return freed
