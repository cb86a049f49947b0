"""Helpers shared by the Triton kernel modules: input checks, launch options (PDL), the MMA helper,
shared-memory fitting, arrival counters for last-arrival reductions, small numeric utilities."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from anneal.engine.ops.registry import interpreting

if interpreting():
    from anneal.engine.kernels.interpreter import patch_language_once_a_launch

    patch_language_once_a_launch()


class KernelInputError(ValueError):
    """Inputs a kernel cannot take (wrong device, dtype, layout or shape), with what to do instead."""


def check_device(name: str, *tensors: torch.Tensor | None) -> None:
    """All tensors on one device, and a device the compiled kernels can run on.

    On the CPU the kernels only run through Triton's interpreter (tests); it has to be switched on
    with ``TRITON_INTERPRET=1`` before triton is first imported.
    """
    devs = {t.device for t in tensors if t is not None}
    if len(devs) != 1:
        raise KernelInputError(f"{name}: tensors on several devices {sorted(map(str, devs))}")
    dev = devs.pop()
    if dev.type == "cpu" and not interpreting():
        raise KernelInputError(
            f"{name}: Triton kernels need CUDA tensors; on the CPU they run only under "
            "TRITON_INTERPRET=1 set before triton is first imported (use the reference variant "
            "on the CPU)"
        )


def check_contiguous_last(name: str, **tensors: torch.Tensor) -> None:
    for arg, t in tensors.items():
        if t.stride(-1) != 1:
            raise KernelInputError(f"{name}: {arg} must be contiguous in its last dim (got {t.stride()})")


def rms_operand(name: str, rms_of: torch.Tensor | None, rows: int, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a kernel with the ``rms_of`` option (``folded_norm``) is given for it: the checked
    ``[rows, hidden]`` residual rows and their power-of-two width, or, without them, ``fallback``
    (never read) and 16."""
    if rms_of is None:
        return fallback, 16
    if rms_of.dim() != 2 or rms_of.shape[0] != rows:
        raise KernelInputError(f"{name}: rms_of must be [T={rows}, hidden], got {tuple(rms_of.shape)}")
    check_contiguous_last(name, rms_of=rms_of)
    return rms_of, pow2(rms_of.shape[1])


def pow2(n: int, minimum: int = 1) -> int:
    """The next power of two >= n, at least ``minimum``. Host code runs this per launch: plain
    Python, not ``triton.next_power_of_2`` (a constexpr-function wrapper, ~5-7 µs a call; an 8B
    prompt step made 226 of these calls)."""
    n = int(n)
    return max(minimum, 1 << (n - 1).bit_length() if n > 1 else 1)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids and tile counts on the host (``triton.cdiv`` costs ~6 µs a call)."""
    return -(-int(a) // int(b))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: exact fp32 products for fp32 inputs (tests), tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast() -> bool:
    """Whether ``mma`` must upcast its operands: Triton's interpreter (checked with triton 3.9)
    returns garbage for ``tl.dot`` on bf16 operands, so under ``TRITON_INTERPRET=1`` the operands
    are converted to fp32 first. Compiled kernels always use the operands' own dtype."""
    return interpreting()


@triton.jit
def mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation; see ``dot_upcast`` for UPCAST."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def row_rstd(src_ptr, n, eps, BLOCK: tl.constexpr):
    """``rsqrt(mean(x**2) + eps)`` of the ``n`` values at ``src_ptr``, in fp32 (one row per program).
    The other half of an RMSNorm whose weight was folded into a projection (``folded_norm``)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+): let the next kernel in the stream start launching.
    Safe first thing in a kernel: the next kernel still waits (``pdl_wait``) for this one to finish
    and flush its writes before it reads anything this one writes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible. Loads
    of data no earlier kernel writes (weights) may be issued before it: that is what PDL buys."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (Triton tutorial 11): with
    ``launch_pdl=True`` the launch latency and prologue of each kernel overlap its predecessor."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)


def pdl_enabled(pdl: bool | str) -> bool:
    """PDL only in compiled kernels (the interpreter has no grid-dependency control)."""
    return bool(pdl) and not interpreting()


PDL_CHOICES = (False, True, "late", "after_wait")


def check_pdl(name: str, pdl) -> None:
    """A kernel's ``pdl`` argument is one of ``PDL_CHOICES`` (plans are checked by the registry;
    this is for direct calls)."""
    if pdl not in PDL_CHOICES:
        raise KernelInputError(f"{name}: pdl must be one of {PDL_CHOICES}, got {pdl!r}")


def pdl_mode(pdl: bool | str) -> int:
    """The ``PDL`` constexpr of kernels that can trigger their dependents late: 0 no PDL; 1 the next
    kernel may launch as soon as every program of this one has started (the trigger first thing);
    2 (``"late"``) only once every program is past its main loop; 3 (``"after_wait"``) once every
    program is past its own wait, i.e. once the previous kernel has finished.
    An early trigger cascades: the next kernel triggers as its programs start, so the one after it
    launches too, and several kernels' programs take SM slots and wait in them while this one runs;
    each kernel's programs then sit wherever slots were free, unevenly. ``after_wait`` lets only
    the next kernel in (its launch and prologue overlap this one's run). H200, 8B decode at ctx 800
    (session 28): with every kernel of the all-GEMV step on PDL, the early trigger is 5-9% slower
    than no PDL at batches 4-16 and the late one within -1.4..+0.8% of it; at bs=1 (one wave a
    kernel) the early trigger is the faster by 1-4%. Session 29 (``bench/pdl_batch.py``): the dot
    path loses 22% to the early trigger at M=1 as at M=12; ``after_wait`` wins 4-10% on o_proj alone
    and 2% on a layer's GEMVs when consecutive grids fit on the SMs together, loses where they do
    not, and lost in the whole decode step with every kernel on it (bench/NOTES.md, session 29)."""
    if not pdl_enabled(pdl):
        return 0
    return {"late": 2, "after_wait": 3}.get(pdl, 1)


def launch_opts(pdl: bool | str) -> dict:
    """Extra launch keyword arguments: ``launch_pdl`` where PDL is on."""
    return {"launch_pdl": True} if pdl_enabled(pdl) else {}


PDL_PARAM_DOC = "pdl: launch with programmatic dependent launch (sm_90+; overlaps launch gaps under CUDA graphs)"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 on the CPU, for the interpreter's heuristics)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pow2_split(want: int, useful: int, cap: int) -> int:
    """The largest power of two <= min(want, useful, cap), at least 1."""
    split = 1
    while split * 2 <= min(want, useful, cap):
        split *= 2
    return split


SMEM_BUDGET = 180 * 1024  # of 227 KB per block on sm_90, leaving room for layout conversions


def fit_stages(num_stages: int, bytes_per_stage: int, budget: int = SMEM_BUDGET) -> int:
    """``num_stages`` lowered until the software pipeline's tiles fit in shared memory, so a config
    that is fine in bf16 does not fail to launch in fp32 (the tests run both)."""
    stages = num_stages
    while stages > 1 and stages * bytes_per_stage > budget:
        stages -= 1
    return stages


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_KEEP_ALIVE: list[torch.Tensor] = []


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters for the last-arrival ("ticket") reductions: int32 zeros, and every kernel
    that uses them leaves them zero.

    One buffer per device, grown when a larger grid needs it (normally while kernels are warmed up,
    before graph capture); kernels that share it must not run concurrently on several streams.
    Allocated inside a graph capture, a buffer serves that call only (it lives in the capture's
    memory pool)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    fresh = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    # Never freed: a captured graph keeps using the address it saw (and memory freed inside a
    # capture would be handed to the capture's later allocations).
    _KEEP_ALIVE.append(fresh)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _COUNTERS[device] = fresh
    return fresh
