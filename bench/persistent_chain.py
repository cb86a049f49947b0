#!/usr/bin/env python
"""Does one persistent launch per layer stream a bs=1 decode layer's GEMVs faster than the PDL
chain of GEMV kernels the best plans run? The experiment behind issue 4's 1B target (0.70 ms a
step; the best plan is at 0.88 ms, its GEMVs at ~72% of copy bandwidth).

Per layer the four projections of the shape (qkv, o, gate_up, down: 121.6 MB at 1B), each reading
the previous output (the next input is its first K values), every layer its own weights, all
layers in one CUDA graph, timed by CUDA events over graph replays (median of --reps):

  cublas          F.linear per projection (torch's GEMV), no PDL
  chain           small_m_gemm per projection with the params of the best 1B plan
                  (gemv-pdl-rope-gu-prefetch-down2-s1: FMA path, ticket split-K, ahead 2 on o/down,
                  gate_up on the dot path), PDL between all 64 kernels
  persistent-*    gemv_chain: one launch per layer, its four phases meeting at grid barriers, the
                  next phase's first weight tile requested before each barrier; PDL between layers
  barrier-*       gemv_chain over tiny weights (one row per program): what the launches and the
                  three barriers per layer cost with no bytes to move

Prediction (session 18): the chain's 64 boundaries cost ~2.75 µs each beyond the bytes (the 1B
profile's GEMV advance, 639 µs for 463 µs of weights); a barrier with its next tile in flight
~1-1.5 µs: persistent ~530-560 µs against the chain's ~600-640 µs per 16 layers. If it is not
clearly under the chain, a per-layer persistent kernel in Triton is not worth building.

Measured (H200, session 18, calls 2-4, 16 layers of the 1B shape, 1946 MB, roofline 463 µs): the
chain 613-615 µs (75%), cuBLAS 682-689; every persistent config slower: 676 µs at best (16 rows x
1024 columns, 16 warps: x0.91, call 4), once x was fetched a step ahead with W (call 2's version
stalled on it: 766 µs at best). A barrier costs 2.6-2.8 µs ((146.5-23.0) / 48, (156.6-25.7) / 48,
(157.3-24.2) / 48), as much as a kernel boundary of the chain; without the 48 barriers' ~130 µs
(as measured alone) the best config would stream at ~545 µs, under the chain's 614. One flag per
program (all polled) instead of one counter read 756 against 724 µs at 32 x 512, 16 warps, and
crashed Triton 3.6's layout pass at 4 and 8 warps: removed. Not built further: a persistent layer
in Triton wins only with dependencies far cheaper than a grid-wide barrier (per-tile flags, as
megakernels use).

The kernel (``gemv_chain``, its barrier and reference) lives here, beside the experiment that
measured it: nothing in the engine runs it. How it works:

* ``grid_barrier``: the cooperative-groups scheme. Every program adds 1 to one int32 counter,
  program 0 adds ``2**31 - (n - 1)``, so the counter's top bit flips exactly when all ``n`` have
  arrived and its low bits return to 0: no reset, any number of barriers and launches. Needs all
  programs resident (the grid is at most what fits on the SMs) and one such kernel at a time per
  counter (stream order). Release/acquire at GPU scope; activations written before a barrier are
  read after it with ``.cg`` loads (past L1, which is not coherent across SMs).
* ``gemv_chain(x, [W0, W1, ...])``: ``y0 = W0 @ x``, ``y1 = W1 @ y0[:K1]``, ...: each phase splits
  W's rows evenly over the programs (a contiguous slab each, ``rows`` at a time, ``block_k``
  columns per step), the next W tile and its x columns in registers while the current ones are used.
* Under Triton's interpreter programs run one after another, so a barrier would wait forever: there
  each phase is its own launch (same code, barrier compiled out), which checks the arithmetic and
  the row split on the CPU; the GPU test (tests/kernels/test_persistent_chain.py) checks the barrier.

    python bench/persistent_chain.py                  # CUDA; JSON to bench/results/
    python bench/persistent_chain.py --device cpu     # interpreter: checks every variant's output only
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, print_variant_row, probe_parser, time_graph, write_probe  # noqa: E402

from anneal.engine.kernels._common import (  # noqa: E402
    KernelInputError, check_device, launch_opts, pdl_enabled, pdl_launch_dependents, pdl_wait, sm_count,
)
from anneal.engine.ops.registry import interpreting  # noqa: E402

MAX_PHASES = 4

_BARRIERS: dict[torch.device, torch.Tensor] = {}


def barrier_counter(device: torch.device) -> torch.Tensor:
    """The int32 counter the persistent kernels on ``device`` synchronise on (zero at first; each
    barrier leaves its low 31 bits zero). Never freed: captured graphs keep its address."""
    buf = _BARRIERS.get(device)
    if buf is None:
        buf = _BARRIERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf


@triton.jit
def grid_barrier(bar_ptr, ENABLED: tl.constexpr):
    """Wait until every program of the grid has arrived here (see the module doc). One address for
    the whole grid: the arrivals serialise at its L2 slice (2.6-2.8 µs a barrier on the H200 with
    132 programs, session 18)."""
    if ENABLED:
        n = tl.num_programs(0)
        # 2**31 - (n - 1) as int32 (n >= 2: the grid is at least one program per SM)
        inc = tl.where(tl.program_id(0) == 0, 2147483647 - n + 2, 1)
        tl.debug_barrier()  # every thread's stores are issued before the release
        old = tl.atomic_add(bar_ptr, inc, sem="acq_rel", scope="gpu")
        cur = old
        while (cur ^ old) >= 0:  # top bit not yet flipped
            cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _tile(w_ptr, rb, r1, k0, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rb .. rb+ROWS`` (those below ``r1``) x columns ``k0 .. k0+BLOCK_K`` of W."""
    rows = rb + tl.arange(0, ROWS)
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
                   mask=(rows < r1)[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _slab(N, pid, nprog):
    """The program's contiguous share of W's rows: ``[r0, r1)``, sizes within one row of each other."""
    return (pid * N) // nprog, ((pid + 1) * N) // nprog


@triton.jit
def _first_tile(w_ptr, N, K, pid, nprog, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    r0, r1 = _slab(N, pid, nprog)
    return _tile(w_ptr, r0, r1, 0, K, ROWS, BLOCK_K)


@triton.jit
def _gemv_phase(x_ptr, w_ptr, y_ptr, N, K, w_cur, pid, nprog, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y[r0:r1] = W[r0:r1] @ x`` for this program's slab; ``w_cur`` holds its first tile (loaded
    before the barrier in front of this phase). Steps walk K within a row block, then the next
    block; tile s+1 of W and its x columns are requested before tile s is used (x comes from L2,
    written by the previous phase: waiting for it at each step would stall the W stream)."""
    r0, r1 = _slab(N, pid, nprog)
    ksteps = tl.cdiv(K, BLOCK_K)
    steps = tl.cdiv(r1 - r0, ROWS) * ksteps
    acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
    kk = tl.arange(0, BLOCK_K)
    x_cur = tl.load(x_ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg")
    for s in range(0, steps):
        sn = s + 1  # past the last step its rows start at or after r1: fully masked, no traffic
        w_nxt = _tile(w_ptr, r0 + (sn // ksteps) * ROWS, r1, (sn % ksteps) * BLOCK_K, K, ROWS, BLOCK_K)
        kn = (sn % ksteps) * BLOCK_K + tl.arange(0, BLOCK_K)
        x_nxt = tl.load(x_ptr + kn, mask=kn < tl.where(sn < steps, K, 0), other=0.0, cache_modifier=".cg")
        acc += w_cur.to(tl.float32) * x_cur.to(tl.float32)[None, :]
        if s % ksteps == ksteps - 1:
            rows = r0 + (s // ksteps) * ROWS + tl.arange(0, ROWS)
            tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < r1)
            acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
        w_cur = w_nxt
        x_cur = x_nxt


@triton.jit
def _pick(i: tl.constexpr, a0, a1, a2, a3):
    return a0 if i == 0 else (a1 if i == 1 else (a2 if i == 2 else a3))


@triton.jit
def _gemv_chain_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, w3_ptr, y0_ptr, y1_ptr, y2_ptr, y3_ptr, bar_ptr,
    N0, K0, N1, K1, N2, K2, N3, K3,
    FIRST: tl.constexpr, LAST: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    BARRIER: tl.constexpr, PDL: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # the first phase's first tile streams while the previous kernel finishes (PDL)
    w_pre = _first_tile(_pick(FIRST, w0_ptr, w1_ptr, w2_ptr, w3_ptr), _pick(FIRST, N0, N1, N2, N3),
                        _pick(FIRST, K0, K1, K2, K3), pid, nprog, ROWS, BLOCK_K)
    pdl_wait(PDL)
    for i in tl.static_range(FIRST, LAST):
        x = x_ptr if i == 0 else _pick(i - 1, y0_ptr, y1_ptr, y2_ptr, y3_ptr)
        w = _pick(i, w0_ptr, w1_ptr, w2_ptr, w3_ptr)
        y = _pick(i, y0_ptr, y1_ptr, y2_ptr, y3_ptr)
        _gemv_phase(x, w, y, _pick(i, N0, N1, N2, N3), _pick(i, K0, K1, K2, K3), w_pre, pid, nprog, ROWS, BLOCK_K)
        if i + 1 < LAST:
            # the next phase's first tile is requested before the wait: the bus streams through it
            w_pre = _first_tile(_pick(i + 1, w0_ptr, w1_ptr, w2_ptr, w3_ptr), _pick(i + 1, N0, N1, N2, N3),
                                _pick(i + 1, K0, K1, K2, K3), pid, nprog, ROWS, BLOCK_K)
            grid_barrier(bar_ptr, BARRIER)


def gemv_chain_reference(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The chain in plain PyTorch: each output rounded to x's dtype, the next input its first K."""
    outs, v = [], x
    for w in weights:
        y = (w.float() @ v[: w.shape[1]].float()).to(x.dtype)
        outs.append(y)
        v = y
    return outs


def _check_chain(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor] | None) -> None:
    name = "gemv_chain"
    if not 1 <= len(weights) <= MAX_PHASES:
        raise KernelInputError(f"{name}: 1 to {MAX_PHASES} weights, got {len(weights)}")
    check_device(name, x, *weights, *(outs or []))
    if x.dim() != 1 or not x.is_contiguous():
        raise KernelInputError(f"{name}: x must be a contiguous vector, got shape {tuple(x.shape)}")
    width = x.shape[0]
    for i, w in enumerate(weights):
        if w.dim() != 2 or not w.is_contiguous() or w.dtype != x.dtype:
            raise KernelInputError(f"{name}: weight {i} must be a contiguous [N, K] {x.dtype} matrix")
        if w.shape[1] > width:
            raise KernelInputError(f"{name}: weight {i} takes K={w.shape[1]} inputs, the previous output has {width}")
        width = w.shape[0]
    if outs is not None and [tuple(o.shape) for o in outs] != [(w.shape[0],) for w in weights]:
        raise KernelInputError(f"{name}: outs must be vectors of each weight's N")


def resident_per_sm(n_regs: int, shared: int, num_warps: int) -> int:
    """Programs of a kernel that fit on one sm_90 SM at once (registers per warp in units of 256,
    64K registers, 2048 threads, 32 blocks, 228 KB of shared memory with 1 KB reserved per block):
    a grid-wide barrier deadlocks unless every program of the grid is resident."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    return max(0, min(65536 // (regs_per_warp * num_warps), 2048 // (32 * num_warps), 32,
                      233472 // (shared + 1024)))


def gemv_chain(
    x: torch.Tensor, weights: list[torch.Tensor], *, outs: list[torch.Tensor] | None = None, rows: int = 8,
    block_k: int = 1024, num_warps: int = 8, programs_per_sm: int = 1, pdl: bool = False,
) -> list[torch.Tensor]:
    """``y0 = W0 @ x``, ``y1 = W1 @ y0[:K1]``, ... (up to four) in one persistent launch."""
    _check_chain(x, weights, outs)
    if programs_per_sm not in (1, 2):
        raise KernelInputError("gemv_chain: programs_per_sm must be 1 or 2 (all programs must be resident)")
    outs = outs if outs is not None else [torch.empty(w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    ws = weights + [weights[-1]] * (MAX_PHASES - len(weights))
    ys = outs + [outs[-1]] * (MAX_PHASES - len(outs))
    dims = [d for w in ws for d in (w.shape[0], w.shape[1])]
    grid = (3 if interpreting() else programs_per_sm * sm_count(x.device),)
    # Under the interpreter each phase is a launch of its own (no barrier: programs run in turn).
    spans = [(i, i + 1) for i in range(len(weights))] if interpreting() else [(0, len(weights))]
    for first, last in spans:
        args = (x, *ws, *ys, barrier_counter(x.device), *dims)
        meta = dict(FIRST=first, LAST=last, ROWS=rows, BLOCK_K=block_k, BARRIER=not interpreting(),
                    PDL=pdl_enabled(pdl), num_warps=num_warps, **launch_opts(pdl))
        if programs_per_sm > 1 and not interpreting():
            k = _gemv_chain_kernel.warmup(*args, grid=grid, **meta)
            k._init_handles()
            fits = resident_per_sm(k.n_regs, k.metadata.shared, num_warps)
            if fits < programs_per_sm:
                raise KernelInputError(f"gemv_chain: {programs_per_sm} programs per SM do not fit ({k.n_regs} "
                                       f"registers, {k.metadata.shared} B shared, {num_warps} warps: {fits} fit)")
        _gemv_chain_kernel[grid](*args, **meta)
    return outs


BEST_1B_PLAN = Path(__file__).resolve().parent / "plans" / "gemv-pdl-rope-gu-prefetch-down2-s1.json"
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the order of layer_dims


def chain_params(plan_file: Path = BEST_1B_PLAN) -> dict[str, dict]:
    """The plan's GEMV params per projection, as ``small_m_gemm`` takes them (``max_m`` is the
    op's switch to torch's GEMM above that many rows, not a kernel param)."""
    import json

    ops = json.loads(plan_file.read_text())["ops"]
    return {op: {k: v for k, v in ops[op]["params"].items() if k != "max_m"} for op in PROJECTIONS}


CONFIGS = {  # persistent: rows, block_k, num_warps, programs_per_sm
    "r8-k1024-w8": dict(rows=8, block_k=1024, num_warps=8),
    "r16-k512-w8": dict(rows=16, block_k=512, num_warps=8),
    "r8-k512-w4-x2": dict(rows=8, block_k=512, num_warps=4, programs_per_sm=2),
    "r32-k512-w16": dict(rows=32, block_k=512, num_warps=16),
    "r16-k1024-w16": dict(rows=16, block_k=1024, num_warps=16),
}


def layer_dims(shape: str) -> tuple[list[tuple[int, int]], int]:
    from anneal.engine.presets import preset_config

    c = preset_config(shape)
    H, I = c.hidden_size, c.intermediate_size
    return [(c.q_size + 2 * c.kv_size, H), (H, c.q_size), (2 * I, H), (H, I)], c.num_hidden_layers


def main() -> int:
    ap = probe_parser(__doc__, reps=50)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="persistent configs to time")
    args = ap.parse_args()
    from anneal.engine.kernels.gemv import small_m_gemm

    best = chain_params()
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    dims, L = layer_dims(args.shape)
    if not on_gpu:  # the interpreter: a few small layers, outputs checked, nothing timed
        dims, L = [(48, 40), (40, 32), (96, 40), (40, 48)], 2
    L = args.layers or L
    dtype = torch.bfloat16 if on_gpu else torch.float32
    g = torch.Generator(device="cpu").manual_seed(18)
    layers = [[(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype=dtype, device=dev) for n, k in dims]
              for _ in range(L)]
    x = torch.randn(dims[0][1], generator=g).to(dtype=dtype, device=dev)
    weight_bytes = sum(w.numel() * w.element_size() for ws in layers for w in ws)
    bw = copy_bandwidth_gbps() if on_gpu else None

    def cublas():
        v = x
        for ws in layers:
            for w in ws:
                v = F.linear(v[: w.shape[1]][None], w)[0]
        return v

    def chain():
        v = x
        for ws in layers:
            for w, params in zip(ws, best.values()):
                v = small_m_gemm(v[: w.shape[1]][None], w, **(params if on_gpu else {"m1": params.get("m1", "dot"),
                                                                                        "split_k": 2}))[0]
        return v

    def persistent(cfg, layers_=layers):
        outs = [[torch.empty(w.shape[0], dtype=dtype, device=dev) for w in ws] for ws in layers_]

        def run():
            v = x[: layers_[0][0].shape[1]]
            for ws, o in zip(layers_, outs):
                v = gemv_chain(v, ws, outs=o, pdl=True, **cfg)[-1]
            return v
        return run

    def expected(ws_list, v):
        for ws in ws_list:
            v = gemv_chain_reference(v, ws)[-1]
        return v

    ref = expected(layers, x)
    variants = [("cublas", cublas), ("chain", chain)]
    variants += [(f"persistent-{name}", persistent(CONFIGS[name])) for name in args.configs.split(",") if name]
    # tiny weights, one row per program: launches and barriers with no bytes to move
    progs = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 3
    tiny = [[(torch.randn(progs, 1 if i == 0 else progs, generator=g)).to(dtype=dtype, device=dev) for i in range(4)]
            for _ in range(L)]
    variants += [("barrier-4-phases", persistent(CONFIGS["r8-k1024-w8"], tiny)),
                 ("barrier-1-phase", persistent(CONFIGS["r8-k1024-w8"], [ws[:1] for ws in tiny]))]

    rows = []
    for name, fn in variants:
        row = {"variant": name}
        try:
            out = fn()
            if not name.startswith("barrier"):
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row["rel_err_vs_reference"] = err
                if not err < (5e-2 if on_gpu else 1e-4):  # 64 bf16 roundings deep on the GPU
                    raise AssertionError(f"output differs from the reference chain: rel err {err:.3g}")
            if on_gpu:
                us = time_graph(lambda _i: fn(), 1, args.reps)
                row["us_per_step"] = us
                if not name.startswith("barrier"):
                    row["gbps"] = weight_bytes / (us * 1e-6) / 1e9
                    row["of_copy_roofline"] = row["gbps"] / bw
        except Exception as e:  # one variant's failure is its result, not the run's end
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows.append(row)
        print_variant_row(row, 26)
    errs = [r["rel_err_vs_reference"] for r in rows if "rel_err_vs_reference" in r]
    print(f"every variant computes the reference chain: max rel err {max(errs):.3g} over {len(errs)}", file=sys.stderr)
    if on_gpu:
        chain_us = next((r["us_per_step"] for r in rows if r["variant"] == "chain" and "us_per_step" in r), None)
        for r in rows:
            if chain_us and "us_per_step" in r:
                r["x_vs_chain"] = chain_us / r["us_per_step"]
        roof_us = weight_bytes / (bw * 1e9) * 1e6
        print(f"\n{args.shape} x{L} layers: {weight_bytes / 1e6:.1f} MB of weights, copy {bw:.0f} GB/s, "
              f"roofline {roof_us:.1f} us")
        for r in rows:
            print(f"  {r['variant']:<26} {r.get('us_per_step', float('nan')):8.1f} us  "
                  f"{r.get('of_copy_roofline', float('nan')):6.1%}  x{r.get('x_vs_chain', float('nan')):.3f} vs chain"
                  + (f"  ERROR {r['error']}" if "error" in r else ""))
        write_probe(f"persistent-chain-{args.shape}", args.out, dev, reps=args.reps, rows=rows, copy_gbps=bw,
                    layers=L, dims=dims, weight_bytes=weight_bytes, roofline_us=roof_us, chain_params=best,
                    configs=CONFIGS)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
