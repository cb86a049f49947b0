"""Seconds to evaluate one candidate plan: persistent engine vs a cold engine start.

Both through the real HTTP admin API of `anneal serve`, side by side in one run:
  persistent: PUT /admin/plan (validate, build, kernel compile + warm-up, graph capture)
              + POST /admin/benchmark (timed decode), per candidate, RPC included;
  cold:       a new `anneal serve` process on a safetensors folder on local disk (page cache
              dropped first when allowed): process start + imports, weight load, KV sizing,
              warm-up + capture, API readiness, then the same first benchmark.

    python bench/iteration.py --shape llama-3.1-8b --candidates 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

TOKEN = "iteration-bench"
H = {"Authorization": f"Bearer {TOKEN}"}


def write_checkpoint(shape: str, folder: Path) -> float:
    """A HF-format safetensors folder with the shape's random weights (bf16, sharded)."""
    from safetensors.torch import save_file

    from anneal.engine.presets import preset_config
    from anneal.engine.weights import random_weights

    cfg = preset_config(shape)
    t0 = time.perf_counter()
    w = random_weights(cfg, torch.device("cuda"), torch.bfloat16, cfg.num_hidden_layers)
    tensors = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = w.lm_head
    q, kv = cfg.q_size, cfg.kv_size
    for i, L in enumerate(w.layers):
        p = f"model.layers.{i}."
        qw, kw_, vw = L.qkv.split([q, kv, kv])
        g, u = L.gate_up.chunk(2)
        tensors.update({
            p + "input_layernorm.weight": L.input_norm, p + "post_attention_layernorm.weight": L.post_norm,
            p + "self_attn.q_proj.weight": qw, p + "self_attn.k_proj.weight": kw_,
            p + "self_attn.v_proj.weight": vw, p + "self_attn.o_proj.weight": L.o,
            p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u, p + "mlp.down_proj.weight": L.down,
        })
    folder.mkdir(parents=True, exist_ok=True)
    shard, shards, size, index = {}, [], 0, {}
    for name, t in tensors.items():
        shard[name] = t.contiguous().cpu()
        size += t.numel() * 2
        if size > 4 * 2**30:
            shards.append(shard)
            shard, size = {}, 0
    shards.append(shard)
    for n, sh in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(folder / fname), metadata={"format": "pt"})
        index.update({k: fname for k in sh})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    hf = {
        "architectures": ["Qwen3ForCausalLM" if cfg.family == "qwen3" else "LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "bfloat16",
        "eos_token_id": cfg.eos_token_ids, "bos_token_id": cfg.bos_token_id,
    }
    if cfg.rope_scaling:
        hf["rope_scaling"] = cfg.rope_scaling.model_dump()
    (folder / "config.json").write_text(json.dumps(hf))
    del w, tensors, shards, shard
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def start_server(model: str, port: int, aport: int, plan_file: str | None, kv_blocks: int,
                 jit_cache: str | None = None, parallel_jit: bool = False,
                 compile_ahead_processes: int | None = None, warm_prompt_steps: bool = False):
    cmd = [sys.executable, "-m", "anneal.cli", "serve", "--model", model, "--device", "cuda",
           "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(aport),
           "--max-model-len", "2048", "--num-kv-blocks", str(kv_blocks), "--log-level", "warning",
           # by default a candidate as the compiler's fast tier evaluates it: timed on decode steps,
           # whose kernels the apply warms; the slow tier and serving engines warm prompt steps too
           "--warm-prompt-steps" if warm_prompt_steps else "--no-warm-prompt-steps"]
    if plan_file:
        cmd += ["--plan", plan_file]
    if parallel_jit:
        cmd += ["--parallel-jit"]
    if compile_ahead_processes is not None:
        cmd += ["--compile-ahead-processes", str(compile_ahead_processes)]
    env = {**os.environ, "ANNEAL_ADMIN_TOKEN": TOKEN}
    if jit_cache:  # Triton's kernel cache: an empty one is what a new pod on a new node starts with
        env["TRITON_CACHE_DIR"] = jit_cache
    log = open(os.environ.get("ANNEAL_BENCH_LOG", "/tmp/anneal-iteration-server.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_ready(port: int, proc, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError("server exited; see ANNEAL_BENCH_LOG")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError("server not ready")


BENCH = {"mode": "decode", "batch_size": 1, "context_len": 1024, "steps": 30, "warmup": 3}


def candidates(n: int) -> list[dict]:
    """Distinct plans of the kind the search proposes: kernel params + graph buckets."""
    out = []
    splits = [0, 4, 8, 16, 2, 32, 1]
    warps = [4, 8, 2]
    for i in range(n):
        out.append({
            "ops": {
                "rmsnorm": {"impl": "triton"}, "add_rmsnorm": {"impl": "triton"},
                "qk_rope_store": {"impl": "triton"}, "silu_and_mul": {"impl": "triton"},
                "attention_prefill": {"impl": "triton"},
                "attention_decode": {"impl": "triton_splitk",
                                     "params": {"split_k": splits[i % len(splits)],
                                                "num_warps": warps[i % len(warps)]}},
            },
            "cuda_graph_batch_sizes": [1, 2, 4, 8, 16, 32][: 3 + i % 4],
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--candidates", type=int, default=5)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cold-jit-cache", action="store_true",
                    help="start the server with an empty Triton cache (a fresh node), not this machine's")
    ap.add_argument("--parallel-jit", action="store_true",
                    help="the server compiles each plan's kernels in parallel before its warm-up")
    ap.add_argument("--compile-ahead", action="store_true",
                    help="as the swarm can: queue the next candidate (POST /admin/prepare) before applying "
                         "the current one, so its kernels compile while this one is applied and measured")
    ap.add_argument("--ahead", type=int, default=4,
                    help="with --compile-ahead: candidates known ahead (a swarm of 4 agents keeps ~4 queued)")
    ap.add_argument("--compile-ahead-processes", type=int, default=None, metavar="N",
                    help="the server's compile-ahead child processes (default: its own; 0: compile on a "
                         "thread of the server process, as session 5 did)")
    ap.add_argument("--warm-prompt-steps", action="store_true",
                    help="each apply also compiles what the plan's prompt steps launch, as on the slow tier "
                         "and a serving engine (engine/prompt_warmup.py)")
    ap.add_argument("--name", default="iteration")
    args = ap.parse_args()
    result: dict = {"env": environment(), "shape": args.shape, "benchmark": BENCH,
                    "cold_jit_cache": args.cold_jit_cache, "parallel_jit": args.parallel_jit,
                    "compile_ahead": args.compile_ahead, "ahead": args.ahead if args.compile_ahead else 0,
                    "compile_ahead_processes": args.compile_ahead_processes,
                    "warm_prompt_steps": args.warm_prompt_steps}
    folder = Path(tempfile.mkdtemp(prefix="anneal-ckpt-", dir="/tmp"))
    result["write_checkpoint_s"] = write_checkpoint(args.shape, folder)
    print(f"checkpoint written in {result['write_checkpoint_s']:.1f} s", flush=True)
    plans = candidates(args.candidates)
    plan_file = folder / "plan0.json"
    plan_file.write_text(json.dumps(plans[0]))

    # Cold start: a fresh process per candidate, page cache dropped when we are allowed to.
    result["page_cache_dropped"] = drop_page_cache()
    # One client for every admin call, as the compiler's EngineClient holds one: `httpx.post(...)`
    # builds a new client per call, 25 ms each on the dev CPU, which is the harness's cost, not the
    # engine's. Made before either path's clock starts.
    admin = httpx.Client(base_url="http://127.0.0.1:18001", headers=H, timeout=600)
    t_spawn = time.perf_counter()
    jit_cache = tempfile.mkdtemp(prefix="anneal-triton-cache-", dir="/tmp") if args.cold_jit_cache else None
    proc = start_server(str(folder), 18000, 18001, str(plan_file), args.kv_blocks, jit_cache, args.parallel_jit,
                        args.compile_ahead_processes, args.warm_prompt_steps)
    try:
        t_ready = wait_ready(18000, proc)
        st = admin.get("/admin/state").json()
        t_b = time.perf_counter()
        first = admin.post("/admin/benchmark", json=BENCH).json()
        if "error" in first:
            print("first benchmark failed:", first, flush=True)
        t_done = time.perf_counter()
        startup = st.get("startup", {})
        engine_s = sum(v for v in startup.values())
        cold = {
            "total_s": (t_ready - t_spawn) + (t_done - t_b),
            "ready_s": t_ready - t_spawn,
            "process_start_imports_api_s": (t_ready - t_spawn) - engine_s,
            "startup_phases_s": startup,
            "first_benchmark_s": t_done - t_b,
            "first_benchmark": {k: first.get(k) for k in ("median_ms", "p10_ms", "p90_ms")},
        }
        result["cold_start"] = cold
        print("cold start", json.dumps(cold, indent=1), flush=True)

        # Persistent: the same process evaluates the remaining candidates by hot reload.
        per = []
        t_all = time.perf_counter()
        untimed = 0.0  # checks between candidates, taken out of the stream's total
        hashes: dict[int, str] = {}  # candidate -> plan hash, from POST /admin/prepare
        for i, plan in enumerate(plans):
            if i in hashes:  # was this candidate's compile done when its apply began?
                tc = time.perf_counter()
                st = admin.get("/admin/prepare").json()
                h = hashes[i]
                ahead_state = "done" if h in st["done"] else "compiling" if h in st["compiling"] else "queued"
                untimed += time.perf_counter() - tc
            else:
                ahead_state = None
            t0 = time.perf_counter()
            # The search knows its next candidates: keep the next --ahead of them queued. The first
            # candidate gets no head start (it is the start-up plan, compiled at start).
            known = [j for j in range(i + 1, min(len(plans), i + 1 + args.ahead)) if j not in hashes]
            if args.compile_ahead and known:
                resp = admin.post("/admin/prepare", json={"plans": [plans[j] for j in known]})
                resp.raise_for_status()
                hashes.update(zip(known, resp.json()["plan_hashes"]))
            r = admin.put("/admin/plan", json=plan)
            t1 = time.perf_counter()
            b = admin.post("/admin/benchmark", json=BENCH).json()
            t2 = time.perf_counter()
            for what, resp in (("apply", r.json()), ("benchmark", b)):
                if "error" in resp:
                    print(f"candidate {i} {what} failed: {resp['error']}", flush=True)
            row = {"candidate": i, "apply_http_s": t1 - t0, "benchmark_http_s": t2 - t1,
                   "total_s": t2 - t0, "status": r.status_code,
                   "apply_timings": r.json().get("timings"), "median_ms": b.get("median_ms"),
                   "p10_ms": b.get("p10_ms"), "p90_ms": b.get("p90_ms"),
                   **({"compile_ahead": ahead_state} if ahead_state else {})}
            per.append(row)
            print(f"candidate {i}: apply {t1 - t0:.2f}s benchmark {t2 - t1:.2f}s "
                  f"decode {b.get('median_ms')} ms", flush=True)
        result["persistent"] = per
        # All candidates, end to end, over their count: what a stream of candidates costs each one
        # (with --compile-ahead the first one pays its own JIT, and a later one waits for any of
        # its compile still running).
        result["persistent_mean_s"] = (time.perf_counter() - t_all - untimed) / len(per)
        if args.compile_ahead:
            result["compile_ahead_status"] = admin.get("/admin/prepare").json()
        import statistics

        med = statistics.median(r["total_s"] for r in per)
        result["persistent_median_s"] = med
        result["speedup_vs_cold_mean"] = cold["total_s"] / result["persistent_mean_s"]
        result["speedup_vs_cold"] = cold["total_s"] / med
        print(f"persistent median {med:.2f} s/candidate (mean {result['persistent_mean_s']:.2f}), cold "
              f"{cold['total_s']:.1f} s: {result['speedup_vs_cold']:.0f}x ({result['speedup_vs_cold_mean']:.0f}x "
              f"on the mean)", flush=True)
    finally:
        admin.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    path = write_result(args.name, result, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
