#!/usr/bin/env python
"""Why does an early PDL trigger help the bs=1 GEMV chain and cost 5-9% at batch 4-16?

Session 28 measured it on the whole 8B step (`chat-s23-pdl` against `chat-s23-compiled`) and could
not say which kernel loses or why. This probe takes the attention and norms out: the 8B layer's four
projections (qkv, o, gate_up, down), each reading the previous output's first K columns, every layer
its own weights, all layers in one CUDA graph, timed by CUDA events over graph replays, at M rows:

  cublas              F.linear per projection (no PDL)
  dot-{none,early,late,after_wait}   small_m_gemm on the tl.dot path with chat-s23-pdl's params
                      (ticket split-K, the default tiles), PDL off / triggered first thing / after
                      the main loop / after the kernel's own wait (the previous kernel done)
  fma-{early,late,after_wait}   (M=1 only) the 8B bs=1 best plan's params: the FMA path with W
                      requested before the wait, where the early trigger is known to win

the same at M=12 with per-projection tiles whose grids let two consecutive kernels share the SMs
(``LAYER_TILES``), PDL off against after_wait; and the o_proj shape alone (32 launches of 4096 x 4096, each its own weight) at split_k 1-16 and
block_n 32-128, PDL off / early / after_wait: the grid's size against what fits on the SMs at once.

The hypothesis (session 29): an early trigger launches the next kernel's programs while the
current kernel's last ones still run, so they land on whichever SMs are free; a grid smaller than the
SMs can hold then sits unevenly (some SMs two or three programs, some none) and its slowest SM sets
the kernel's time. At M=1 the FMA path's W loads before the wait pay for it. Predicted: at M=12 the
dot path loses 5-10% with the early trigger in the layer chain; in the o_proj sweep the loss
shrinks where the grid fills every SM's slots (programs = resident per SM x 132) and is largest
where it is a fraction of that. If the M=1 dot path loses as much as M=12, the rows are not the
cause, the pre-wait loads are.

    python bench/pdl_batch.py                 # CUDA; JSON to bench/results/
    python bench/pdl_batch.py --device cpu    # interpreter: checks every variant's output only
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, print_variant_row, probe_parser, time_graph, write_probe  # noqa: E402
from persistent_chain import chain_params, layer_dims, resident_per_sm  # noqa: E402

DOT = {"reduce": "ticket"}  # chat-s23-pdl's projections: the default tiles, ticket split-K
FMA_8B = Path(__file__).resolve().parent / "plans" / "gemv-pdl-rope-gu-prefetch-downdot-o8-s1.json"
# Per-projection tiles (qkv, o, gate_up, down) for the M=12 layer chain: grids sized so that two
# consecutive kernels fit on the SMs together (what an after_wait trigger needs, session 29's o sweep)
# -- programs at the 8B: n32 tiles 40 registers / 24.5 KB, 9 an SM; n64 5; n128 3.
LAYER_TILES = {
    "n32-x4": [{"block_n": 32, "split_k": 2}, {"block_n": 32, "split_k": 4}, {"block_n": 32, "split_k": 1},
               {"block_n": 32, "split_k": 4}],
    "n32-x2": [{"block_n": 32, "split_k": 2}, {"block_n": 32, "split_k": 2}, {"block_n": 64, "split_k": 1},
               {"block_n": 32, "split_k": 2}],
    "n32-x4-st2": [{"block_n": 32, "split_k": 2, "num_stages": 2}, {"block_n": 32, "split_k": 4, "num_stages": 2},
                   {"block_n": 32, "split_k": 1, "num_stages": 2}, {"block_n": 32, "split_k": 4, "num_stages": 2}],
    "n64-x2": [{"block_n": 64, "split_k": 2}, {"block_n": 64, "split_k": 4}, {"block_n": 128, "split_k": 1},
               {"block_n": 64, "split_k": 4}],
    "n128-x1": [{"block_n": 128, "split_k": 2}, {"block_n": 128, "split_k": 4}, {"block_n": 128, "split_k": 1},
                {"block_n": 128, "split_k": 4}],
}
MODES = (("none", False), ("early", True), ("late", "late"), ("after_wait", "after_wait"))


def fma_params() -> list[dict]:
    """The 8B bs=1 best plan's projection params (qkv, o, gate_up, down), PDL left to the variant."""
    return [{k: v for k, v in p.items() if k != "pdl"} for p in chain_params(FMA_8B).values()]


def compiled_gemv_kernels() -> list[dict]:
    """Registers, shared memory and warps of every ``_gemv_kernel`` specialisation compiled so far,
    with what fits on one SM: the grid sizes above are read against it."""
    from anneal.engine.kernels.gemv import _gemv_kernel

    out = []
    for cache in getattr(_gemv_kernel, "device_caches", {}).values():
        for key, k in cache[0].items():
            try:
                k._init_handles()
                consts = dict(k.src.constants) if hasattr(k, "src") else {}
                fits = resident_per_sm(k.n_regs, k.metadata.shared, k.metadata.num_warps)
                out.append({"n_regs": k.n_regs, "shared": k.metadata.shared, "num_warps": k.metadata.num_warps,
                            "num_stages": k.metadata.num_stages, "resident_per_sm": fits,
                            "key": str(consts or key)[:400]})
            except Exception as e:  # noqa: BLE001 - a probe's report, not its result
                out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def main() -> int:
    ap = probe_parser(__doc__, reps=30)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", default="1,12", help="M values of the layer chain")
    ap.add_argument("--o-rows", type=int, default=12, help="M of the o_proj sweep")
    args = ap.parse_args()
    from anneal.engine.kernels.gemv import small_m_gemm

    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    dims, L = layer_dims(args.shape)[0], args.layers
    o_dims, o_count = (4096, 4096), 32
    if not on_gpu:  # the interpreter: a few small layers, outputs checked, nothing timed
        dims, L, o_dims, o_count = [(48, 40), (40, 32), (96, 40), (40, 48)], 2, (40, 40), 2
    dtype = torch.bfloat16 if on_gpu else torch.float32
    g = torch.Generator(device="cpu").manual_seed(29)
    layers = [[(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype=dtype, device=dev) for n, k in dims]
              for _ in range(L)]
    o_ws = [(torch.randn(*o_dims, generator=g) * o_dims[1] ** -0.5).to(dtype=dtype, device=dev) for _ in range(o_count)]
    layer_bytes = sum(w.numel() * w.element_size() for ws in layers for w in ws)
    o_bytes = sum(w.numel() * w.element_size() for w in o_ws)
    bw = copy_bandwidth_gbps() if on_gpu else None
    fma = fma_params()

    def chain(x, params: list[dict] | None, ws_list=layers):
        v = x
        for ws in ws_list:
            for i, w in enumerate(ws):
                inp = v[:, : w.shape[1]]
                v = F.linear(inp, w) if params is None else small_m_gemm(inp, w, **params[i % len(params)])
        return v

    rows, variants = [], []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, dims[0][1], generator=g).to(dtype=dtype, device=dev)
        variants.append((f"layers-m{m}-cublas", x, None, layers, layer_bytes))
        for mode, pdl in MODES:
            variants.append((f"layers-m{m}-dot-{mode}", x, [{**DOT, "pdl": pdl}], layers, layer_bytes))
        if m > 1:
            for tiles, per_op in LAYER_TILES.items():
                for mode, pdl in (MODES[0], MODES[3]):
                    variants.append((f"layers-m{m}-{tiles}-{mode}", x, [{**DOT, **p, "pdl": pdl} for p in per_op],
                                     layers, layer_bytes))
        if m == 1:
            for mode, pdl in MODES[1:]:
                variants.append((f"layers-m1-fma-{mode}", x, [{**p, "pdl": pdl} for p in fma], layers, layer_bytes))
    xo = torch.randn(args.o_rows, o_dims[1], generator=g).to(dtype=dtype, device=dev)
    o_layers = [[w] for w in o_ws]
    variants.append((f"o-m{args.o_rows}-cublas", xo, None, o_layers, o_bytes))
    for block_n in (32, 64, 128):
        for split in (1, 2, 4, 8, 16):
            for mode, pdl in (MODES[0], MODES[1], MODES[3]):
                p = {**DOT, "pdl": pdl, "block_n": block_n, "split_k": split}
                grid = -(-o_dims[0] // block_n) * split
                variants.append((f"o-m{args.o_rows}-n{block_n}-s{split}-{mode}", xo, [p], o_layers, o_bytes, grid))

    refs: dict[tuple[int, int], torch.Tensor] = {}  # the fp32 chain of each (input, weights), once
    for name, x, params, ws_list, nbytes, *grid in variants:
        row = {"variant": name, **({"grid": grid[0]} if grid else {})}
        try:
            out = chain(x, params, ws_list)
            key = (id(x), id(ws_list))
            if key not in refs:
                refs[key] = chain(x.float(), None, [[w.float() for w in ws] for ws in ws_list])
            ref = refs[key]
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row["rel_err_vs_fp32"] = err
            if not err < (5e-2 if on_gpu else 1e-4):
                raise AssertionError(f"output differs from the fp32 chain: rel err {err:.3g}")
            if on_gpu:
                us = time_graph(lambda _i: chain(x, params, ws_list), 1, args.reps)
                launches = sum(len(ws) for ws in ws_list)
                row.update(us=us, us_per_launch=us / launches, of_copy_roofline=nbytes / (us * 1e-6) / 1e9 / bw)
        except Exception as e:  # one variant's failure is its result, not the run's end
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows.append(row)
        print_variant_row(row, 28)
    bad = [r["variant"] for r in rows if "error" in r]
    print(f"failed: {bad}" if bad else f"every variant computes the fp32 chain ({len(rows)} of {len(rows)})",
          file=sys.stderr)
    if on_gpu:
        write_probe(f"pdl-batch-{args.shape}", args.out, dev, reps=args.reps, rows=rows, copy_gbps=bw, layers=L,
                    dims=dims, o_dims=o_dims, layer_bytes=layer_bytes, o_bytes=o_bytes, kernels=compiled_gemv_kernels())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
