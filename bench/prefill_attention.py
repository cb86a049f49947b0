#!/usr/bin/env python
"""How far is the paged prefill attention from what the GPU's best attention does? An experiment
for issue 5's agentic shape.

Why ask: the agentic replay spends ~42% of its time in prompt steps (~18-20 steps of ~3,000 new
tokens over ~2,600 tokens of context), at ~73% of their matmul roofline (session 13,
`plans-compiled-*-s13-call3-seed800.json`), against ~81% for its decode steps. The projections at
3,000 rows are cuBLAS at ~94% of the matmul rate (session 8's mixed-step profile); what the step
spends beyond them is mostly `_prefill_kernel`. If that kernel runs far below torch's own fused
attention on the same work, a better prefill attention is a lever the kernel tuner's declared
configs cannot reach.

Measured: for each (query tokens x context) shape of one sequence (queries at the end of the
context, bottom-right causal), the engine's kernel on a paged cache (random block table) in every
config below (µs per call in a CUDA graph, median of --reps), and torch's
scaled_dot_product_attention on the same values in contiguous tensors, through each SDPA backend
that takes the call (cuDNN, flash, memory-efficient; eager, --reps calls back to back between two
events: they are long enough that the host stays ahead, and a backend that cannot be captured in a
graph must not break the run). TFLOP/s from the causal pairs actually attended (4 * pairs * D * H).
Prediction: the best config at 40-60% of the best SDPA backend at 3k x 6k; if it is within 80%,
prefill attention is not the lever.
Measured (session 14, H200, bench/results/prefill-attention-2026-12-01-s14-call3.json): 87% of
flash at 3072 x 6144, 78% at 1024 x 8192, ~50% of cuDNN on fresh causal prompts. The kernel then
masked every key tile; with the causal mask on the diagonal's tiles only (call 4) it leads torch's
best by 6-14% at the chunk-over-context shapes and stays at ~60% of cuDNN on fresh prompts.

    python bench/prefill_attention.py                # CUDA; JSON to bench/results/
    python bench/prefill_attention.py --device cpu   # Triton interpreter, tiny shapes: checks only
                                                     # that the kernel, SDPA and the reference agree
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from anneal.engine.kernels.attention_prefill import paged_prefill_attention
from anneal.engine.ops import reference as ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import premise_holds, probe_dtype, probe_parser, shape_pairs, time_graph, write_probe  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # llama-3.1-8b, the engine's block size
CONFIGS = [dict(), dict(pack_gqa=True), dict(block_m=128, num_warps=8), dict(block_m=128, num_warps=8, pack_gqa=True),
           dict(block_m=128, block_n=32, num_warps=8), dict(block_m=128, num_warps=8, num_stages=3),
           dict(block_m=128, block_n=128, num_warps=8, num_stages=2), dict(num_stages=3, pack_gqa=True),
           # Triton 3.6 waits for every K/V copy at the loop's top up to 4 stages (no tile in flight
           # while one computes); from 5 the next one stays in flight (three buffers). Session 25:
           # +24% at 64 rows (one CTA an SM), a wash at 128
           dict(num_stages=5), dict(num_stages=5, pack_gqa=True), dict(block_m=128, num_warps=8, num_stages=5)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attended_pairs(q_len: int, ctx: int) -> int:
    """(query, key) pairs a bottom-right causal mask keeps: query i sees ctx - q_len + i + 1 keys."""
    return q_len * (ctx - q_len) + q_len * (q_len + 1) // 2


def make_inputs(q_len: int, ctx: int, device, dtype, gen, heads=HEADS, kv_heads=KV_HEADS, d=HEAD_DIM):
    """One sequence: q [q_len, H, D], a paged cache holding ``ctx`` tokens under a random block
    table, and the same keys/values as contiguous [1, H, ctx, D] (GQA heads repeated) for SDPA."""
    nb = -(-ctx // BLOCK)
    k = torch.randn(nb, BLOCK, kv_heads, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(nb, BLOCK, kv_heads, d, device=device, dtype=dtype, generator=gen)
    bt = torch.randperm(nb, generator=torch.Generator().manual_seed(nb)).to(device=device, dtype=torch.int32)[None]
    q = torch.randn(q_len, heads, d, device=device, dtype=dtype, generator=gen)
    dense = [c[bt[0].long()].reshape(nb * BLOCK, kv_heads, d)[:ctx] for c in (k, v)]
    kd, vd = (t.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None].contiguous() for t in dense)
    paged = (q, k, v, bt, torch.tensor([0, q_len], dtype=torch.int32, device=device),
             torch.tensor([ctx], dtype=torch.int32, device=device), q_len, d ** -0.5)
    return paged, (q.transpose(0, 1)[None].contiguous(), kd, vd)


def sdpa(dense, q_len: int, ctx: int):
    q, k, v = dense
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, ctx))[0].transpose(0, 1)


def time_back_to_back(call, reps: int) -> float:
    """µs per call of ``reps`` eager calls queued back to back (kernels of 100 µs and more)."""
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def agree(device, dtype) -> float:
    """Largest difference between the kernel, SDPA and the reference on one small shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    q_len, ctx, H, Hkv, D = 24, 57, 4, 2, 16
    paged, dense = make_inputs(q_len, ctx, device, dtype, gen, H, Hkv, D)
    want = ref.attention_prefill(*paged).float()
    got = paged_prefill_attention(*paged, block_m=16, block_n=16).float()
    return max((got - want).abs().max().item(), (sdpa(dense, q_len, ctx).float() - want).abs().max().item())


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=20)
    ap.add_argument("--shapes", default="2048x2048,3072x3072,3072x6144,1024x8192")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = probe_dtype(device)
    diff = agree(device, dtype)
    if not premise_holds(f"kernel, SDPA and reference on one shape: max |diff| {diff:.3g}",
                         diff <= (2e-2 if dtype == torch.bfloat16 else 1e-4),
                         "they disagree: the comparison would not time the same function"):
        return 1
    if device.type != "cuda":
        return 0
    rows = []
    for q_len, ctx in shape_pairs(args.shapes):
        shape = f"{q_len}x{ctx}"
        gen = torch.Generator(device=device).manual_seed(q_len * 100_000 + ctx)
        paged, dense = make_inputs(q_len, ctx, device, dtype, gen)
        flop = 4 * attended_pairs(q_len, ctx) * HEAD_DIM * HEADS
        want = sdpa(dense, q_len, ctx).float()

        def record(impl: str, cfg: dict, call, graph: bool) -> None:
            try:
                err = (call().float() - want).abs().max().item()
                us = time_graph(lambda i: call(), 1, args.reps) if graph else time_back_to_back(call, args.reps)
            except Exception as e:  # a backend that refuses the call, a config that fails to launch
                rows.append({"q": q_len, "ctx": ctx, "impl": impl, **cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{shape:>10} {impl:9s} {cfg}: {type(e).__name__}", file=sys.stderr, flush=True)
                return
            row = {"q": q_len, "ctx": ctx, "impl": impl, **cfg, "us": round(us, 1),
                   "tflops": round(flop / us / 1e6, 1), "max_err": round(err, 4)}
            rows.append(row)
            print(f"{shape:>10} {impl:9s} {str(cfg):60s} {us:9.1f} µs {row['tflops']:6.1f} TFLOP/s "
                  f"err {err:.3g}", file=sys.stderr, flush=True)

        for name, backend in BACKENDS.items():
            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return sdpa(dense, q_len, ctx)
            record(f"sdpa-{name}", {}, call, graph=False)
        for cfg in CONFIGS:
            record("paged", cfg, lambda cfg=cfg: paged_prefill_attention(*paged, **cfg), graph=True)
        del paged, dense, want
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if "us" not in r:
            continue
        side = "sdpa" if r["impl"].startswith("sdpa") else "paged"
        cur = best.setdefault(f"{r['q']}x{r['ctx']}", {}).get(side)
        if cur is None or r["us"] < cur["us"]:
            best[f"{r['q']}x{r['ctx']}"][side] = {k: v for k, v in r.items() if k not in ("q", "ctx")}
    for key, b in best.items():
        if "paged" in b and "sdpa" in b:
            b["paged_vs_sdpa"] = round(b["sdpa"]["us"] / b["paged"]["us"], 3)
        print(f"best at {key}: {b}", file=sys.stderr)
    write_probe("prefill-attention", args.out, device, reps=args.reps, rows=rows, best=best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
