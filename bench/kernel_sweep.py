#!/usr/bin/env python
"""Kernel benchmark: every Triton variant against its reference (and torch where relevant) at
Llama-3.2-1B and Llama-3.1-8B decode shapes, in GB/s and % of the measured copy-bandwidth roofline.

    python bench/kernel_sweep.py                     # CUDA, full run (< 4 min on an H200), JSON to bench/results/
    python bench/kernel_sweep.py --budget 120        # stop sweeping after 120 s (defaults still measured)
    python bench/kernel_sweep.py --only attention_decode,lm_head
    python bench/kernel_sweep.py --device cpu --tiny # CPU, Triton interpreter, tiny shapes: checks the logic only

Timing (CUDA): each case is captured in a CUDA graph that calls the function once on each of R
rotating input sets (R chosen so they do not all fit in L2), and ``triton.testing.do_bench`` times
graph replays (it also flushes L2 before each replay); the median per call is reported with p10/p90.
That is the time the engine sees inside its captured decode step, without Python launch overhead.
Functions that cannot be captured (host syncs) are timed with plain ``do_bench``, marked
``"graph": false``.

Each variant is also checked against the reference on the benchmarked inputs (max abs error), and
swept over a small set of its params; the best config per shape is reported. Bytes counted are the
minimum an op must move (weights, KV read, activations in and out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MODELS = {
    "llama-3.2-1b": dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192, vocab=128256),
    "llama-3.1-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256),
}
TINY = {"tiny": dict(hidden=96, heads=4, kv_heads=2, head_dim=16, inter=80, vocab=300)}
BATCHES, CONTEXTS = (1, 8, 32, 128), (1024, 8192)
TINY_BATCHES, TINY_CONTEXTS = (1, 3), (40,)
BLOCK_SIZE = 16
ROTATE_BYTES = 256 * 2**20  # rotating input sets cover at least this much (H200 L2: 50 MB)
MAX_ROTATIONS = 32
# M = 1 GEMV configs: register FMA path (first weight tile requested before the PDL wait, the next
# one a step ahead), last-arrival split-K sum; PDL lets consecutive calls overlap in the graph.
_FMA = {"m1": "fma", "reduce": "ticket"}
M1_SWEEP = [_FMA, {**_FMA, "pdl": True}, {**_FMA, "pdl": True, "block_k": 256}, {**_FMA, "pdl": True, "block_n": 32},
            {**_FMA, "pdl": True, "block_n": 128, "block_k": 64}, {**_FMA, "pdl": True, "num_warps": 8},
            {**_FMA, "pdl": True, "split_k": 1}, {"reduce": "ticket", "pdl": True}]


@dataclass
class Case:
    op: str
    model: str
    shape: dict
    nbytes: int  # minimum bytes moved per call
    make: Callable[[int], tuple]  # seed -> args
    reference: Callable
    baselines: dict[str, Callable] = field(default_factory=dict)
    variant: tuple[str, Callable[..., Callable], list[dict]] | None = None  # (label, build, sweep)
    compare: Callable[[Any, Any], float] | None = None  # (out, ref_out) -> error (see err_metric)
    err_metric: str = "max_abs_err"
    no_graph: tuple[str, ...] = ()  # impls with host syncs: timed without CUDA-graph capture


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (implied by --device cpu)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds after which sweeps stop")
    ap.add_argument("--deadline", type=float, default=225.0, help="seconds after which cases are skipped")
    ap.add_argument("--only", default="", help="comma-separated ops to run")
    ap.add_argument("--models", default="", help="comma-separated model shapes (default: all)")
    ap.add_argument("--batches", default="", help="comma-separated batch sizes (default: 1,8,32,128)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/kernels-<date>.json)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        args.tiny = True
        os.environ["TRITON_INTERPRET"] = "1"  # before triton or any kernel module is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for the logic check", file=sys.stderr)
        return 2
    bench = Bench(args)
    return bench.run()


class Bench:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.args = args
        self.dev = args.device
        self.t0 = time.perf_counter()
        self.truncated = False
        self.dtype = torch.bfloat16
        self.models = TINY if args.tiny else MODELS
        self.batches = TINY_BATCHES if args.tiny else BATCHES
        self.contexts = TINY_CONTEXTS if args.tiny else CONTEXTS
        self.only = {s.strip() for s in args.only.split(",") if s.strip()}
        if args.models:
            self.models = {m: self.models[m] for m in args.models.split(",")}
        if args.batches:
            self.batches = tuple(int(b) for b in args.batches.split(","))

    # ---- timing ------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def rotations(self, nbytes: int) -> int:
        if self.args.tiny:
            return 2
        return max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / max(1, nbytes))))

    def time_fn(self, fn: Callable, inputs: list[tuple], graph_ok: bool = True) -> dict:
        torch = self.torch
        if self.dev == "cpu":
            for a in inputs:
                fn(*a)
            t = time.perf_counter()
            for a in inputs:
                fn(*a)
            ms = (time.perf_counter() - t) * 1e3 / len(inputs)
            return {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "graph": False}
        import triton.testing

        def run_all():
            for a in inputs:
                fn(*a)

        run_all()  # compile, warm caches of the allocator
        torch.cuda.synchronize()
        graph = None
        try:
            if not graph_ok:
                raise SkippedError("not capturable")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run_all()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_all()
            target = graph.replay
        except Exception:  # not capturable (host sync): time eager launches
            graph = None
            torch.cuda.synchronize()
            target = run_all
        med, p10, p90 = triton.testing.do_bench(target, warmup=5, rep=25, quantiles=[0.5, 0.1, 0.9])
        n = len(inputs)
        del graph
        return {"median_ms": med / n, "p10_ms": p10 / n, "p90_ms": p90 / n, "graph": target is not run_all}

    def rate(self, t: dict, nbytes: int) -> dict:
        gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
        t = dict(t, GBps=round(gbps, 1))
        if self.roofline:
            t["pct_roofline"] = round(100 * gbps / self.roofline, 1)
        return t

    # ---- one case ----------------------------------------------------------------------------

    def run_case(self, c: Case) -> dict:
        torch = self.torch
        R = self.rotations(c.nbytes)
        inputs = [c.make(i) for i in range(R)]
        rec: dict[str, Any] = {"op": c.op, "model": c.model, "shape": c.shape, "bytes": c.nbytes, "rotations": R,
                               "err_metric": c.err_metric}
        ref_out = c.reference(*c.make(0)) if c.compare else None
        impls: dict[str, Any] = {}
        rec["impls"] = impls
        for name, fn in {"reference": c.reference, **c.baselines}.items():
            try:
                impls[name] = self.rate(self.time_fn(fn, inputs, name not in c.no_graph), c.nbytes)
            except SkippedError as e:
                impls[name] = {"skipped": str(e)}
            except Exception as e:  # a baseline that cannot run here is reported, not fatal
                impls[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if self.dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        if c.variant is not None:
            label, build, sweep = c.variant
            if not self.args.tiny and "pdl" in _param_names(build):
                sweep = sweep + [{"pdl": True}]
            results = []
            for i, params in enumerate(sweep):
                if i > 0 and self.elapsed() > self.args.budget:
                    self.truncated = True
                    rec["sweep_truncated"] = True
                    break
                try:
                    fn = build(**params)
                    entry = {"params": params, **self.rate(self.time_fn(fn, inputs), c.nbytes)}
                    if c.compare is not None and ref_out is not None:
                        entry[c.err_metric] = c.compare(fn(*c.make(0)), ref_out)
                except Exception as e:  # a config that does not compile/fit is a result, not a crash
                    entry = {"params": params, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                results.append(entry)
            ok = [r for r in results if "median_ms" in r]
            impls[label] = results[0] if results else {"skipped": "budget"}
            if ok:
                best = min(ok, key=lambda r: r["median_ms"])
                rec["best"] = {"impl": label, **best}
                ref = impls.get("reference", {})
                if "median_ms" in ref:
                    rec["best_speedup_vs_reference"] = round(ref["median_ms"] / best["median_ms"], 2)
            rec["sweep"] = results
        del inputs
        if self.dev == "cuda":
            torch.cuda.empty_cache()
        return rec

    # ---- run ---------------------------------------------------------------------------------

    def run(self) -> int:
        torch = self.torch
        import triton

        import anneal.engine.kernels  # noqa: F401  (after TRITON_INTERPRET is settled)

        sys.path.insert(0, str(Path(__file__).parent))
        try:
            from common import copy_bandwidth_gbps, environment
        except ImportError:  # bench/common.py missing: the essentials, measured here
            environment, copy_bandwidth_gbps = None, None
        env = environment() if environment else {"torch": torch.__version__, "triton": triton.__version__}
        if self.dev == "cuda":
            env.setdefault("gpu", torch.cuda.get_device_name())
        self.roofline = None
        if self.dev == "cuda":
            self.roofline = copy_bandwidth_gbps() if copy_bandwidth_gbps else _copy_bandwidth(torch)
            print(f"{env.get('gpu')}: copy roofline {self.roofline:.0f} GB/s", flush=True)
        records = []
        skipped = []
        for c in self.cases():
            if self.only and c.op not in self.only:
                continue
            if self.elapsed() > self.args.deadline:
                skipped.append({"op": c.op, "model": c.model, "shape": c.shape})
                continue
            t = time.perf_counter()
            rec = self.run_case(c)
            records.append(rec)
            print(summary_line(rec, time.perf_counter() - t), flush=True)
        out = {
            "benchmark": "kernels",
            "environment": env,
            "device": self.dev,
            "interpreter": self.dev == "cpu",
            "dtype": str(self.dtype),
            "copy_roofline_GBps": self.roofline,
            "timing": "CUDA graph of R rotating input sets, do_bench median per call" if self.dev == "cuda"
            else "wall clock under the Triton interpreter (logic check only, not a measurement)",
            "sweep_budget_s": self.args.budget,
            "sweep_truncated": self.truncated,
            "deadline_s": self.args.deadline,
            "cases_skipped_at_deadline": skipped,
            "elapsed_s": round(self.elapsed(), 1),
            "results": records,
        }
        path = self.args.out
        if path is None and self.dev == "cuda":
            path = Path(__file__).parent / "results" / f"kernels-{dt.date.today().isoformat()}.json"
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=1, sort_keys=True, default=str))
            print(f"wrote {path} ({self.elapsed():.0f} s)")
        return 0

    # ---- the cases ---------------------------------------------------------------------------

    def cases(self):
        """Attention first (where the plan gains most), then projections, then the small ops."""
        for model, cfg in self.models.items():
            for bs in self.batches:
                for ctx in self.contexts:
                    yield self.case_attention_decode(model, cfg, bs, ctx)
        for model, cfg in self.models.items():
            for bs in self.batches:
                for op, (n, k) in projection_shapes(cfg).items():
                    yield self.case_linear(op, model, bs, n, k)
                yield self.case_lm_head_argmax(model, cfg, bs)
                yield self.case_norm_lm_head_argmax(model, cfg, bs)
                yield self.case_silu_mul_down(model, cfg, bs)
                yield self.case_norm_linear(model, cfg, bs)
        for model, cfg in self.models.items():
            for bs in self.batches:
                yield self.case_norm("rmsnorm", model, cfg, bs)
                yield self.case_norm("add_rmsnorm", model, cfg, bs)
                yield self.case_silu(model, cfg, bs)
                yield self.case_rope(model, cfg, bs)
        for model, cfg in self.models.items():
            yield self.case_prefill(model, cfg)

    def randn(self, *shape, g, scale=1.0, dtype=None):
        torch = self.torch
        return (torch.randn(*shape, generator=g, device=self.dev, dtype=torch.float32) * scale).to(dtype or self.dtype)

    def gen(self, seed):
        g = self.torch.Generator(device=self.dev)
        g.manual_seed(seed)
        return g

    def _err(self, out, ref):
        return float((out.float() - ref.float()).abs().max().item())

    def case_attention_decode(self, model, cfg, bs, ctx):
        torch = self.torch
        from anneal.engine.kernels.attention_decode import build_attention_decode
        from anneal.engine.ops import reference as ref

        H, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        nb = math.ceil(ctx / BLOCK_SIZE)
        e = self.dtype.itemsize
        kv_bytes = bs * ctx * Hkv * D * e * 2
        nbytes = kv_bytes + 2 * bs * H * D * e
        R = self.rotations(nbytes)
        g = self.gen(1)
        # One cache holding R disjoint sets of blocks: each rotation reads its own KV.
        k_cache = self.randn(R * bs * nb + 1, BLOCK_SIZE, Hkv, D, g=g)
        v_cache = self.randn(R * bs * nb + 1, BLOCK_SIZE, Hkv, D, g=g)
        perm = torch.randperm(R * bs * nb, generator=g, device=self.dev).to(torch.int32) + 1
        lens = torch.full((bs,), ctx, dtype=torch.int32, device=self.dev)

        def make(i):
            gi = self.gen(100 + i)
            q = self.randn(bs, H, D, g=gi)
            bt = perm[(i % R) * bs * nb:(i % R + 1) * bs * nb].view(bs, nb).contiguous()
            return (q, k_cache, v_cache, bt, lens, D ** -0.5)

        def sdpa(q, kc, vc, bt, cl, scale):
            k = ref.gather_kv(kc, bt).transpose(1, 2)
            v = ref.gather_kv(vc, bt).transpose(1, 2)
            mask = (torch.arange(k.shape[2], device=q.device)[None, :] < cl[:, None])[:, None, None, :]
            return torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]

        # The reference upcasts the gathered, GQA-repeated K/V to fp32: skip where that cannot fit.
        ref_gb = bs * nb * BLOCK_SIZE * Hkv * D * (2 + 6 * (H // Hkv)) * 2 / 1e9
        sweep = [{}, {"merge": "ticket"}, {"pv_precision": "tf32"}, {"split_k": 1}, {"split_k": 4},
                 {"split_k": 16}, {"split_k": 32, "block_n": 32}, {"block_n": 32}, {"block_n": 128, "num_warps": 8},
                 {"split_k": 2}, {"split_k": 8}, {"num_warps": 8}, {"num_warps": 2}, {"num_stages": 3},
                 {"num_stages": 4, "block_n": 32}, {"block_n": 16, "num_warps": 2}]
        if self.args.tiny:
            sweep = [{}, {"split_k": 2, "block_n": 16, "merge": "ticket"}]
        c = Case("attention_decode", model, {"batch": bs, "context": ctx, "heads": H, "kv_heads": Hkv, "head_dim": D},
                 nbytes, make, ref.attention_decode, {"torch_sdpa_gather": sdpa},
                 ("triton_splitk", build_attention_decode, sweep), self._err)
        if ref_gb > 40:
            c.reference = _skipped(f"reference needs ~{ref_gb:.0f} GB")
            c.compare = None
        return c

    def case_linear(self, op, model, bs, n, k):
        from anneal.engine.kernels.gemv import _make_linear
        from anneal.engine.ops.registry import get_op, get_variant

        e = self.dtype.itemsize
        nbytes = (n * k + bs * k + bs * n) * e
        R = self.rotations(nbytes)
        ws = [self.randn(n, k, g=self.gen(10 + i), scale=k ** -0.5) for i in range(R)]

        def make(i):
            return (self.randn(bs, k, g=self.gen(200 + i)), ws[i % R])

        defaults = get_variant(op, "triton_gemv_splitk").defaults()
        build = lambda **p: _make_linear(**{**defaults, **p})  # noqa: E731
        sweep = [{}, {"reduce": "ticket"}, {"split_k": 1}, {"block_n": 128, "block_k": 64},
                 {"block_n": 32, "block_k": 256}, {"block_k": 256, "num_warps": 8}, {"num_stages": 4}]
        if bs == 1:
            sweep += [{"m1": "fma"}, {"m1": "fma", "block_k": 512, "reduce": "ticket"}, *M1_SWEEP]
        if bs > 64:
            sweep += [{"max_m": 0}, {"max_m": 0, "block_n": 128, "num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"split_k": 2, "block_k": 64}]
        return Case(op, model, {"M": bs, "N": n, "K": k}, nbytes, make, get_op(op).reference, {},
                    ("triton_gemv_splitk", build, sweep), self._err)

    def case_lm_head_argmax(self, model, cfg, bs):
        from anneal.engine.kernels.lm_head_argmax import lm_head_argmax
        from anneal.engine.ops.registry import get_op

        V, K = cfg["vocab"], cfg["hidden"]
        nbytes = (V * K + bs * K) * self.dtype.itemsize + bs * 8
        w = self.randn(V, K, g=self.gen(20), scale=K ** -0.5)
        lm_head = get_op("lm_head").reference

        def make(i):
            return (self.randn(bs, K, g=self.gen(300 + i)), w)

        def reference(x, weight):
            return lm_head(x, weight).argmax(-1)

        sweep = [{}, {"block_n": 64}, {"block_n": 256, "num_warps": 8}, {"block_k": 256}, {"num_stages": 4}]
        if bs == 1:
            sweep.append({"m1": "fma"})
        if self.args.tiny:
            sweep = [{}, {"block_n": 64, "block_k": 64}]
        build = lambda **p: (lambda x, weight: lm_head_argmax(x, weight, **p))  # noqa: E731
        agree = lambda out, ref: float((out != ref).float().mean().item())  # noqa: E731  (fraction differing)
        return Case("lm_head_argmax", model, {"M": bs, "V": V, "K": K}, nbytes, make, reference, {},
                    ("triton_fused", build, sweep), agree, "fraction_of_tokens_differing")

    def case_norm_lm_head_argmax(self, model, cfg, bs):
        from anneal.engine.kernels.lm_head_argmax import norm_lm_head_argmax
        from anneal.engine.ops import reference as ref
        from anneal.engine.ops.registry import get_op

        V, K = cfg["vocab"], cfg["hidden"]
        nbytes = (V * K + 3 * bs * K + K) * self.dtype.itemsize + bs * 8
        w = self.randn(V, K, g=self.gen(21), scale=K ** -0.5)
        nw = self.randn(K, g=self.gen(22))
        lm_head = get_op("lm_head").reference

        def make(i):
            return (self.randn(bs, K, g=self.gen(350 + i)), self.randn(bs, K, g=self.gen(370 + i)), nw, 1e-5, w)

        def reference(x, r, w_norm, eps, weight):
            return lm_head(ref.add_rmsnorm(x, r, w_norm, eps)[0], weight).argmax(-1)

        sweep = [{}, {"block_n": 64}, {"block_n": 256, "num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"block_n": 64, "block_k": 32}]
        build = lambda **p: (lambda x, r, w_norm, eps, weight: norm_lm_head_argmax(x, r, w_norm, eps, weight, **p))  # noqa: E731
        agree = lambda out, ref_out: float((out != ref_out).float().mean().item())  # noqa: E731
        return Case("add_rmsnorm_lm_head_argmax", model, {"M": bs, "V": V, "K": K}, nbytes, make, reference, {},
                    ("triton_fused", build, sweep), agree, "fraction_of_tokens_differing")

    def case_silu_mul_down(self, model, cfg, bs):
        from anneal.engine.kernels.gemv import silu_mul_down_proj
        from anneal.engine.ops import reference as ref
        from anneal.engine.ops.registry import build_op, get_op

        I, N = cfg["inter"], cfg["hidden"]
        e = self.dtype.itemsize
        nbytes = (N * I + bs * 2 * I + bs * N) * e
        R = self.rotations(nbytes)
        ws = [self.randn(N, I, g=self.gen(30 + i), scale=I ** -0.5) for i in range(R)]
        down = get_op("down_proj").reference
        t_silu, t_down = build_op("silu_and_mul", "triton"), build_op("down_proj", "triton_gemv_splitk")

        def make(i):
            return (self.randn(bs, 2 * I, g=self.gen(400 + i)), ws[i % R])

        sweep = [{}, {"reduce": "ticket"}, {"split_k": 1}, {"block_n": 32, "block_k": 256},
                 {"block_k": 256, "num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"block_k": 64, "split_k": 2, "reduce": "ticket"}]
        if bs == 1 and not self.args.tiny:
            sweep += M1_SWEEP
        build = lambda **p: (lambda gu, w: silu_mul_down_proj(gu, w, **p))  # noqa: E731
        return Case("silu_mul_down_proj", model, {"M": bs, "N": N, "I": I}, nbytes, make,
                    lambda gu, w: down(ref.silu_and_mul(gu), w),
                    {"triton_unfused": lambda gu, w: t_down(t_silu(gu), w)},
                    ("triton_fused", build, sweep), self._err)

    def case_norm_linear(self, model, cfg, bs):
        from anneal.engine.kernels.gemv import add_rmsnorm_linear
        from anneal.engine.ops import reference as ref
        from anneal.engine.ops.registry import build_op, get_op

        K = cfg["hidden"]
        N = (cfg["heads"] + 2 * cfg["kv_heads"]) * cfg["head_dim"]
        e = self.dtype.itemsize
        nbytes = (N * K + 3 * bs * K + K + bs * N) * e
        R = self.rotations(nbytes)
        ws = [self.randn(N, K, g=self.gen(70 + i), scale=K ** -0.5) for i in range(R)]
        nw = self.randn(K, g=self.gen(79))
        qkv = get_op("qkv_proj").reference
        t_norm, t_qkv = build_op("add_rmsnorm", "triton"), build_op("qkv_proj", "triton_gemv_splitk")

        def make(i):
            return (self.randn(bs, K, g=self.gen(1100 + i)), self.randn(bs, K, g=self.gen(1200 + i)), nw, 1e-5, ws[i % R])

        def reference(x, r, w_norm, eps, w):
            normed, summed = ref.add_rmsnorm(x, r, w_norm, eps)
            return qkv(normed, w), summed

        def unfused(x, r, w_norm, eps, w):
            normed, summed = t_norm(x, r, w_norm, eps)
            return t_qkv(normed, w), summed

        sweep = [{}, {"reduce": "ticket"}, {"split_k": 1}, {"block_n": 32, "block_k": 256},
                 {"block_k": 256, "num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"block_k": 64, "split_k": 2, "reduce": "ticket"}]
        if bs == 1 and not self.args.tiny:
            sweep += M1_SWEEP
        build = lambda **p: (lambda x, r, w_norm, eps, w: add_rmsnorm_linear(x, r, w_norm, eps, w, **p))  # noqa: E731
        err = lambda out, r: max(self._err(out[0], r[0]), self._err(out[1], r[1]))  # noqa: E731
        return Case("add_rmsnorm_qkv_proj", model, {"M": bs, "N": N, "K": K}, nbytes, make, reference,
                    {"triton_unfused": unfused}, ("triton_fused", build, sweep), err)

    def case_norm(self, op, model, cfg, bs):
        import torch.nn.functional as F

        from anneal.engine.kernels import norm
        from anneal.engine.ops import reference as ref

        H = cfg["hidden"]
        e = self.dtype.itemsize
        w = self.randn(H, g=self.gen(40))
        if op == "rmsnorm":
            nbytes = (2 * bs * H + H) * e

            def make(i):
                return (self.randn(bs, H, g=self.gen(500 + i)), w, 1e-5)

            baselines = {"torch_rms_norm": lambda x, weight, eps: F.rms_norm(x, (H,), weight, eps)}
            build, reference = norm.build_rmsnorm, ref.rmsnorm
            err = self._err
        else:
            nbytes = (4 * bs * H + H) * e

            def make(i):
                return (self.randn(bs, H, g=self.gen(600 + i)), self.randn(bs, H, g=self.gen(700 + i)), w, 1e-5)

            baselines = {}
            build, reference = norm.build_add_rmsnorm, ref.add_rmsnorm
            err = lambda out, r: max(self._err(out[0], r[0]), self._err(out[1], r[1]))  # noqa: E731
        sweep = [{}, {"num_warps": 1}, {"num_warps": 8}, {"num_warps": 16}]
        if self.args.tiny:
            sweep = [{}, {"num_warps": 1}]
        return Case(op, model, {"T": bs, "H": H}, nbytes, make, reference, baselines, ("triton", build, sweep), err)

    def case_silu(self, model, cfg, bs):
        from anneal.engine.kernels.activation import build_silu_and_mul
        from anneal.engine.ops import reference as ref

        I = cfg["inter"]
        nbytes = 3 * bs * I * self.dtype.itemsize

        def make(i):
            return (self.randn(bs, 2 * I, g=self.gen(800 + i)),)

        sweep = [{}, {"block": 2048, "num_warps": 8}, {"block": 512, "num_warps": 2}, {"block": 4096, "num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"block": 256}]
        return Case("silu_and_mul", model, {"T": bs, "I": I}, nbytes, make, ref.silu_and_mul, {},
                    ("triton", build_silu_and_mul, sweep), self._err)

    def case_rope(self, model, cfg, bs):
        torch = self.torch
        from anneal.engine.kernels.rope import build_qk_rope_store
        from anneal.engine.ops import reference as ref

        H, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        e = self.dtype.itemsize
        nbytes = bs * (H + 2 * Hkv) * D * e * 2 + bs * D * 4
        max_pos = 8192
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, dtype=torch.float32, device=self.dev) / D))
        ang = torch.arange(max_pos, dtype=torch.float32, device=self.dev)[:, None] * inv[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
        nblocks = 64 * max(1, bs)
        k_cache = self.randn(nblocks, BLOCK_SIZE, Hkv, D, g=self.gen(50))
        v_cache = self.randn(nblocks, BLOCK_SIZE, Hkv, D, g=self.gen(51))

        def make(i):
            g = self.gen(900 + i)
            qkv = self.randn(bs, (H + 2 * Hkv) * D, g=g)
            pos = torch.randint(0, max_pos, (bs,), generator=g, device=self.dev)
            slots = torch.randperm(nblocks * BLOCK_SIZE, generator=g, device=self.dev)[:bs]
            return (qkv, pos, cos_sin, k_cache, v_cache, slots, H, Hkv, None, None, 1e-6)

        sweep = [{}, {"num_warps": 1}, {"num_warps": 2}, {"num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"num_warps": 1}]
        return Case("qk_rope_store", model, {"T": bs, "heads": H, "kv_heads": Hkv, "head_dim": D}, nbytes, make,
                    ref.qk_rope_store, {}, ("triton", build_qk_rope_store, sweep), self._err)

    def case_prefill(self, model, cfg):
        torch = self.torch
        from anneal.engine.kernels.attention_prefill import build_attention_prefill
        from anneal.engine.ops import reference as ref

        H, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        seqs = [(24, 40), (7, 7)] if self.args.tiny else [(2048, 2048), (512, 1536), (512, 512), (1000, 3000), (64, 8192)]
        B = len(seqs)
        nb = max(math.ceil(c / BLOCK_SIZE) for _, c in seqs)
        g = self.gen(60)
        k_cache = self.randn(B * nb + 1, BLOCK_SIZE, Hkv, D, g=g)
        v_cache = self.randn(B * nb + 1, BLOCK_SIZE, Hkv, D, g=g)
        bt = (torch.randperm(B * nb, generator=g, device=self.dev).to(torch.int32) + 1).view(B, nb)
        lens = torch.tensor([c for _, c in seqs], dtype=torch.int32, device=self.dev)
        qlens = [q for q, _ in seqs]
        cu = torch.tensor([0] + list(_cumsum(qlens)), dtype=torch.int32, device=self.dev)
        e = self.dtype.itemsize
        nbytes = sum(c for _, c in seqs) * Hkv * D * e * 2 + 2 * sum(qlens) * H * D * e

        def make(i):
            return (self.randn(sum(qlens), H, D, g=self.gen(1000 + i)), k_cache, v_cache, bt, cu, lens, max(qlens), D ** -0.5)

        sweep = [{}, {"block_m": 128, "num_warps": 8}, {"block_m": 128, "block_n": 32, "num_warps": 8},
                 {"block_n": 32}, {"num_stages": 3}, {"pack_gqa": True}, {"pack_gqa": True, "block_m": 128, "num_warps": 8}]
        if self.args.tiny:
            sweep = [{}, {"block_m": 16, "block_n": 16, "pack_gqa": True}]
        return Case("attention_prefill", model, {"seqs_q_ctx": seqs, "heads": H, "kv_heads": Hkv, "head_dim": D},
                    nbytes, make, ref.attention_prefill, {}, ("triton", build_attention_prefill, sweep), self._err,
                    no_graph=("reference",))


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    h, D = cfg["hidden"], cfg["head_dim"]
    qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * D
    return {
        "qkv_proj": (qkv, h),
        "o_proj": (h, cfg["heads"] * D),
        "gate_up_proj": (2 * cfg["inter"], h),
        "down_proj": (h, cfg["inter"]),
        "lm_head": (cfg["vocab"], h),
    }


def _copy_bandwidth(torch) -> float:
    import triton.testing

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def _param_names(build) -> set[str]:
    import inspect

    try:
        params = inspect.signature(build).parameters
    except (TypeError, ValueError):
        return set()
    names = set(params)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names.add("pdl")  # the fused builders pass every keyword on to the kernel function
    return names


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _skipped(reason: str):
    def fn(*_a, **_k):
        raise SkippedError(reason)

    return fn


class SkippedError(RuntimeError):
    pass


def summary_line(rec: dict, seconds: float) -> str:
    ref = rec["impls"].get("reference", {})
    best = rec.get("best", {})
    fmt = lambda r: f"{r['median_ms'] * 1e3:8.1f} us {r.get('pct_roofline', float('nan')):5.1f}%" if "median_ms" in r else "       -"  # noqa: E731
    shape = ",".join(f"{k}={v}" for k, v in rec["shape"].items() if not isinstance(v, list))
    return (f"{rec['op']:<20} {rec['model']:<13} {shape:<44} ref {fmt(ref)}  best {fmt(best)} "
            f"x{rec.get('best_speedup_vs_reference', float('nan')):.2f} {best.get('params', '')} ({seconds:.1f}s)")


if __name__ == "__main__":
    sys.exit(main())
