#!/usr/bin/env python
"""Can a bs=1 decode step read o_proj's weights from L2 instead of HBM? An experiment for issue 4's
8B bs=1 target (90% of copy-bandwidth roofline; the best plan is at 85.4%).

Why it might: at 8B bs=1 the o_proj GEMV (33.5 MB of weights) runs at ~74% of bandwidth, 10.8 µs
against 8.0 µs at roofline. It follows decode attention, which reads only ~4 MB of KV in its ~7 µs
(split + merge): HBM sits mostly idle then. A kernel on a second stream that streams W_o through L2
during the attention (H200 L2: 50 MB) would let o_proj read from L2. Saved, if it works: ~5 µs
per layer, ~0.15 ms per 8B step (4.54 → ~4.39 ms), a third of the gap to 90%.

Measured (CUDA events around each case, L2 flushed before every repetition, median of --reps):
  gemv_cold            flush → o_proj GEMV (cuBLAS, x[1,4096] @ W[4096,4096]ᵀ, bf16)
  gemv_warm            flush → prefetch W → GEMV, the GEMV alone timed: the best case
  attn                 flush → decode attention (Triton split-K, bs=1, ctx --context, 8B heads)
  attn_gemv            flush → attention → GEMV: today's order
  attn_prefetch_gemv   flush → [attention ‖ prefetch of W on a second stream] → GEMV
  prefetch             flush → prefetch alone (should run near copy bandwidth: 33.5 MB ≈ 8 µs)
Prediction: gemv_warm 3-5 µs; attn_prefetch_gemv − attn_gemv ≈ −4 µs. If gemv_warm is not well
under gemv_cold, L2 reads are no faster for this shape and the idea is dead.

    python bench/l2_prefetch.py                    # CUDA; JSON to bench/results/
    python bench/l2_prefetch.py --device cpu       # Triton interpreter: checks the prefetch kernel only
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))


@triton.jit
def _stream_into_l2(w_ptr, sink_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Read ``n`` elements of ``w`` (program p takes chunks p, p + P, ...), keeping them in L2
    (evict_last); one value per program goes to ``sink`` so the loads are not dead code."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(ITERS):
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        offs += step
    tl.store(sink_ptr + pid, tl.sum(acc, axis=0))


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int, block: int = 2048) -> None:
    n = w.numel()
    iters = triton.cdiv(n, programs * block)
    _stream_into_l2[(programs,)](w, sink, n, BLOCK=block, ITERS=iters, num_warps=8)


def prefetch_reference(w: torch.Tensor, programs: int, block: int = 2048) -> torch.Tensor:
    """What ``sink`` must hold: each program's sum over its chunks."""
    flat = w.flatten().float()
    pad = (-flat.numel()) % (programs * block)
    chunks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, programs, block)
    return chunks.sum(dim=(0, 2))


def timed(fn, flush, reps: int, stream=None) -> float:
    """Median µs of ``fn`` between two events, L2 flushed before each repetition."""
    out = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.device == "cpu":  # the interpreter: the prefetch kernel's sums, nothing timed
        os.environ.setdefault("TRITON_INTERPRET", "1")
        w = torch.randn(1000, 37)
        sink = torch.empty(3)
        prefetch(w, sink, programs=3, block=64)
        ref = prefetch_reference(w, programs=3, block=64)
        print("prefetch sums match:", torch.allclose(sink, ref, rtol=1e-4, atol=1e-3))
        return 0 if torch.allclose(sink, ref, rtol=1e-4, atol=1e-3) else 1

    from anneal.engine.kernels.attention_decode import paged_decode_attention

    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim, bs_tok = 4096, 32, 8, 128, 16
    w = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    blocks = args.context // bs_tok
    k_cache = torch.randn(blocks, bs_tok, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, heads, head_dim, device=dev, dtype=torch.bfloat16)
    table = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    lens = torch.tensor([args.context], device=dev, dtype=torch.int32)
    scale = head_dim ** -0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sink = torch.empty(sms, device=dev, dtype=torch.float32)
    scratch = torch.empty(512 * 2**20, device=dev, dtype=torch.uint8)  # 512 MB: past any L2
    side = torch.cuda.Stream(dev)

    def flush():
        scratch.zero_()

    def gemv():
        torch.nn.functional.linear(x, w)

    def attn():
        paged_decode_attention(q, k_cache, v_cache, table, lens, scale)

    def pre():
        prefetch(w, sink, programs=sms)

    def attn_prefetch_gemv():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            pre()
        attn()
        main.wait_stream(side)
        gemv()

    def warm_then_gemv():  # the GEMV alone, timed after the prefetch finished
        flush()
        pre()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemv()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    for f in (gemv, attn, pre, attn_prefetch_gemv):  # JIT and cuBLAS warm-up
        f()
    torch.cuda.synchronize()
    assert torch.allclose(sink, prefetch_reference(w, programs=sms).to(sink), rtol=1e-2, atol=1e-1)

    # Copy bandwidth, to place the GEMV against its roofline.
    a = torch.empty(1 << 28, device=dev, dtype=torch.uint8)
    b = torch.empty_like(a)
    copy_us = timed(lambda: b.copy_(a), flush, 20)
    bw = 2 * a.numel() / (copy_us * 1e-6) / 1e9
    res = {
        "gemv_cold_us": timed(gemv, flush, args.reps),
        "gemv_warm_us": statistics.median(warm_then_gemv() for _ in range(args.reps)),
        "attn_us": timed(attn, flush, args.reps),
        "attn_gemv_us": timed(lambda: (attn(), gemv()), flush, args.reps),
        "attn_prefetch_gemv_us": timed(attn_prefetch_gemv, flush, args.reps),
        "prefetch_us": timed(pre, flush, args.reps),
    }
    res["gemv_roofline_us"] = w.numel() * 2 / (bw * 1e9) * 1e6
    res["saved_per_layer_us"] = res["attn_gemv_us"] - res["attn_prefetch_gemv_us"]
    out = {"env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "triton": triton.__version__, "copy_gbps": bw},
           "shape": {"hidden": hidden, "context": args.context, "reps": args.reps}, "results": res}
    print(json.dumps(out, indent=1))
    folder = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"l2-prefetch-8b-{dt.date.today().isoformat()}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
