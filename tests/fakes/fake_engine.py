"""FAKE ENGINE — a stand-in for the engine's *numbers* only, for the compiler's unit tests.

It speaks the admin API's wire format (engine/ADMIN_API.md) over real HTTP, but its timings are a
made-up deterministic function of the plan (some impls/params faster, seeded noise), its kernel
check only looks for a marker string, and its verification fails plans naming a "bad" impl. It
exists so the search, ledger, resume and report logic can be tested without a model; everything
about real kernels, real timing and real verification is tested against a real `anneal serve`.

Run standalone for subprocess tests: ``python tests/fakes/fake_engine.py --port P --token T``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from anneal.engine.plan import OP_NAMES, Plan

VARIANTS = {
    "rmsnorm": {"reference": {}, "triton": {"block": [64, 128, 256]}},
    "silu_and_mul": {"reference": {}, "triton": {"block": [128, 256]}},
    "attention_decode": {"reference": {}, "splitk": {"split_k": [1, 2, 4], "block_n": [16, 32]}},
    "qkv_proj": {"reference": {}},
}
# Fake per-op ms of the reference, and how much each (impl, param) changes it.
BASE_MS = {"rmsnorm": 0.2, "silu_and_mul": 0.3, "attention_decode": 1.0, "qkv_proj": 0.5}
FACTOR = {("triton", "block", 128): 0.6, ("triton", "block", 256): 0.8, ("triton", "block", 64): 0.9,
          ("splitk", "split_k", 4): 0.5, ("splitk", "split_k", 2): 0.7, ("splitk", "block_n", 32): 0.9}


def fake_per_op(plan: Plan, batch: int) -> dict[str, float]:
    out = {}
    for op, base in BASE_MS.items():
        ch = plan.choice(op)
        f = 1.0 if ch.impl == "reference" else 0.95
        for name, value in ch.params.items():
            f *= FACTOR.get((ch.impl, name, value), 1.0)
        if ch.impl.startswith("llm_"):
            f = 0.4
        out[op] = base * f * (1 + 0.05 * batch)
    return out


PROMPT_SHARE = 0.25  # of a workload replay's time, in its prompt steps


class FakeEngine:
    def __init__(self, token: str = "tok", layers: int = 1, noise: float = 0.02, model: str = "random:tiny",
                 bad_impls: tuple[str, ...] = ("splitk_bad",), delay_s: float = 0.0, device: str = "cpu",
                 per_op: bool = True, sample_spread: float = 0.0, token_graph_gain: float = 0.0,
                 extra_variants: dict | None = None, drift: float = 0.0, fusion_gains: dict[str, float] | None = None,
                 decode_drift: float = 0.0, bad_fusions: tuple[str, ...] = (), token_plan_decode_noise: float = 0.0,
                 step_penalties: dict[tuple[str, str], float] | None = None, drafted_tokens_per_step: float | None = None,
                 fusion_gain_of: Callable[[str, Plan], float] | None = None,
                 prompt_penalties: dict[tuple[str, str], float] | None = None):
        self.token, self.layers, self.noise, self.model = token, layers, noise, model
        # workload replays: each seed's request sample scales every plan's time alike, by up to this
        self.sample_spread = sample_spread
        self.token_graph_gain = token_graph_gain  # how much faster a workload replays with token graphs
        # the decode steps of a token-graph plan's replays read this much slower: host noise that
        # landed on them (token graphs change prompt steps only; session 22's pair read x1.056)
        self.token_plan_decode_noise = token_plan_decode_noise
        self.extra_variants = extra_variants or {}  # op -> {impl: params}, beside VARIANTS
        # a host whose speed moves as a search goes on (compile-ahead's builds): a workload replay
        # this much slower for every benchmark before it, whatever its plan
        self.drift, self.benchmarks = drift, 0
        self.fusion_gains = fusion_gains or {}  # fusion -> how much faster every step runs with it
        # or that gain as a function of the fusion and the plan (a fused GEMV runs its projection's tiles)
        self.fusion_gain_of = fusion_gain_of
        self.decode_drift = decode_drift  # the same drift for decode-step benchmarks
        self.bad_fusions = set(bad_fusions)  # fusions whose plans fail verification (quality)
        # (op, impl) -> ms each layer's step loses with it, which its own per-op time does not show
        # (session 27: a ticket merge faster alone, slower inside the graph)
        self.step_penalties = step_penalties or {}
        # the same for prompt and mixed steps alone (session 56: a GEMV at every row count, faster on
        # the decode step, at a prompt step's rows streams its weights once per row tile)
        self.prompt_penalties = prompt_penalties or {}
        # workload replays report an n-gram drafter emitting this many tokens a verify step (their
        # extra.speculation), and a speculating plan's decode steps run that many times fewer
        self.drafted_tokens_per_step = drafted_tokens_per_step
        self.bad_impls, self.delay_s, self.device = set(bad_impls), delay_s, device
        self.per_op = per_op  # False: an engine that cannot time ops even when asked
        self.plan = Plan()
        self.calls: dict[str, int] = {}
        self.kernels: dict[str, dict] = {}
        self.lock = threading.Lock()

    def state(self) -> dict:
        variants = {op: {i: dict(p) for i, p in v.items()} for op, v in {**VARIANTS, **self.extra_variants}.items()}
        for key, k in self.kernels.items():
            variants.setdefault(k["op"], {"reference": {}})[k["impl"]] = k["params"]
        return {
            "model": self.model, "device": self.device, "gpu_name": "NVIDIA H200" if self.device == "cuda" else None, "dtype": "float32",
            "num_layers_loaded": self.layers, "num_layers_total": 4,
            "plan": self.plan.model_dump(mode="json"), "plan_hash": self.plan.hash,
            "kv": {"num_blocks": 64, "free_blocks": 64, "block_size": 16},
            "ops": {op: list(v) for op, v in variants.items()}, "variants": variants,
            "hardware": {"copy_gbps": 20.0, "matmul_tflops": 0.2},
        }

    def benchmark(self, body: dict) -> dict:
        import time

        plan = Plan.model_validate(body.get("plan") or self.plan.model_dump())
        for op, ch in plan.ops.items():
            if ch.impl not in self.state()["variants"].get(op, {"reference": {}}):
                raise ValueError(f"op {op} has no variant {ch.impl}")
        key = (f"{plan.hash}|{body.get('mode')}|b{body.get('batch_size')}|c{body.get('context_len')}"
               f"|s{body.get('seed')}")
        with self.lock:
            self.calls[key] = self.calls.get(key, 0) + 1
            before, self.benchmarks = self.benchmarks, self.benchmarks + 1
        if self.delay_s:
            time.sleep(self.delay_s)
        seed = int(hashlib.sha256(f"{plan.hash}{body.get('seed')}{body.get('mode')}".encode()).hexdigest()[:8], 16)
        rng = random.Random(seed)
        batch = int(body.get("batch_size", 1))
        if self.device == "cuda" and body.get("mode") == "decode":
            # Fake CUDA graphs: a batch runs padded to the next captured size, eager (x1.5) above all.
            padded = [g for g in plan.cuda_graph_batch_sizes if g >= batch]
            batch = min(padded) if padded else int(batch * 1.5) + 1
        per_op = fake_per_op(plan, batch)
        step = sum(per_op.values()) * self.layers + 0.1
        step += self.layers * sum(ms for (op, impl), ms in self.step_penalties.items() if plan.choice(op).impl == impl)
        if body.get("mode") in ("prefill", "mixed"):
            step += self.layers * sum(ms for (op, impl), ms in self.prompt_penalties.items() if plan.choice(op).impl == impl)
        for f in plan.fusions:
            step *= 1 - (self.fusion_gain_of(f, plan) if self.fusion_gain_of else self.fusion_gains.get(f, 0.0))
        if body.get("mode") == "decode":
            step *= 1 + self.decode_drift * before
        if body.get("mode") == "workload":
            s = plan.scheduler
            eff = min(1.0, s.max_num_seqs / 16) * (1.05 if s.chunked_prefill else 1.0)
            step = step / max(eff, 0.2)
            step *= 1 + self.sample_spread * (int(body.get("seed") or 0) % 3 - 1)
            # a quarter of a replay is its prompt steps; token graphs change those alone
            prompt, rest = step * PROMPT_SHARE, step * (1 - PROMPT_SHARE)
            if self.drafted_tokens_per_step and s.speculative_tokens:
                rest /= self.drafted_tokens_per_step
            if self.device == "cuda" and plan.cuda_graph_token_sizes:  # prompt steps without host launches
                prompt *= 1 - self.token_graph_gain / PROMPT_SHARE
                rest *= 1 + self.token_plan_decode_noise
            prompt, rest = prompt * (1 + self.drift * before), rest * (1 + self.drift * before)
            step = prompt + rest
        samples = [step * (1 + self.noise * rng.uniform(-1, 1)) for _ in range(int(body.get("repeats", 5)))]
        samples.sort()
        med = samples[len(samples) // 2]
        out = {"plan_hash": plan.hash, "median_ms": med, "p10_ms": samples[0], "p90_ms": samples[-1],
               "tokens_per_s": 1e3 * batch / med if body.get("mode") != "workload" else 1e3 * 16 / med,
               "samples_ms": samples, "per_op_ms": {k: v * self.layers for k, v in per_op.items()}}
        if not (self.per_op and body.get("per_op")):  # like the engine: per-op times when asked for
            del out["per_op_ms"]
        if body.get("mode") == "workload":
            out["itl_p90_ms"] = med * 1.1
            out["ttft_p90_ms"] = med * 3
            # a closed loop of 16: steady at the cap, then a drain through every smaller batch
            cap = min(16, plan.scheduler.max_num_seqs)
            out["decode_batches"] = {cap: 40, **{b: 3 for b in range(1, cap)}}
            scale = med / step  # the median replay's split; the same requests, so the same prompt tokens
            out["time_split"] = {"total_ms": med, "prefill_ms": prompt * scale, "tokens_in_prefill_steps": 4096,
                                 "decode_ms": med - prompt * scale}
            if self.drafted_tokens_per_step is not None:
                out["extra"] = {"speculation": {"drafter": "ngram", "k": 4, "max_n": 3, "verify_steps": 100,
                                                "tokens_per_step": self.drafted_tokens_per_step,
                                                "drafted_per_step": 1.0}}
        return out

    def verify(self, body: dict) -> dict:
        plan = Plan.model_validate(body["plan"])
        bad = [op for op in OP_NAMES if plan.choice(op).impl in self.bad_impls]
        bad += [f"fusion {f}" for f in sorted(self.bad_fusions) if plan.fusions.get(f)]
        checks = [{"name": "quality", "passed": not bad, "detail": f"bad impl in {bad}" if bad else "",
                   "metrics": {}}]
        return {"passed": not bad, "plan_hash": plan.hash, "checks": checks}

    def kernel(self, body: dict) -> dict:
        """Compile the source and compare it with the reference on one random input (elementwise ops)."""
        import torch

        from anneal.engine.ops.registry import get_op

        ns: dict = {}
        try:
            exec(compile(body["source"], f"<kernel {body['impl']}>", "exec"), ns)
            fn = ns["build"]()
        except Exception as e:  # noqa: BLE001
            return {"ok": False, "stage": "compile", "error": f"{type(e).__name__}: {e}"}
        g = torch.Generator().manual_seed(0)
        args = {"silu_and_mul": lambda: (torch.randn(5, 32, generator=g),),
                "rmsnorm": lambda: (torch.randn(5, 32, generator=g), torch.rand(32, generator=g), 1e-5)}
        if body["op"] in args:
            a = args[body["op"]]()
            try:
                got, want = fn(*a), get_op(body["op"]).reference(*a)
            except Exception as e:  # noqa: BLE001
                return {"ok": False, "stage": "check", "error": f"{type(e).__name__}: {e}"}
            err = float(((got - want).abs().max() / want.abs().max().clamp_min(1e-6)))
            if not err < 1e-3:
                return {"ok": False, "stage": "check", "error": f"max_rel_err {err:.3g} > 1e-3", "max_rel_err": err}
        self.kernels[f"{body['op']}/{body['impl']}"] = {"op": body["op"], "impl": body["impl"],
                                                         "params": body.get("params") or {}}
        return {"ok": True, "stage": "registered", "error": None, "max_rel_err": 0.0, "ms": 0.1}


def make_server(engine: FakeEngine, port: int = 0) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            if self.path == "/fake/calls":
                return self._send(200, engine.calls)
            if self.headers.get("Authorization") != f"Bearer {engine.token}":
                return self._send(401, {"error": {"message": "bad token", "type": "auth"}})
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            try:
                if method == "GET" and self.path == "/admin/state":
                    return self._send(200, engine.state())
                if method == "POST" and self.path == "/admin/benchmark":
                    return self._send(200, engine.benchmark(body))
                if method == "POST" and self.path == "/admin/verify":
                    return self._send(200, engine.verify(body))
                if method == "POST" and self.path == "/admin/kernels":
                    return self._send(200, engine.kernel(body))
                if method == "PUT" and self.path == "/admin/plan":
                    engine.plan = Plan.model_validate(body)
                    return self._send(200, {"plan_hash": engine.plan.hash, "timings": {}})
            except Exception as e:  # noqa: BLE001
                return self._send(400, {"error": {"message": str(e), "type": "invalid"}})
            return self._send(404, {"error": {"message": "not found", "type": "not_found"}})

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

        def do_PUT(self):
            self._handle("PUT")

    return ThreadingHTTPServer(("127.0.0.1", port), H)


def serve_in_thread(engine: FakeEngine) -> tuple[ThreadingHTTPServer, str]:
    srv = make_server(engine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token", default="tok")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args()
    make_server(FakeEngine(a.token, a.layers, delay_s=a.delay), a.port).serve_forever()
