"""Decode step time: our engine (eager, CUDA graphs, per plan) vs HF transformers `generate`.

For each shape and batch size at a fixed context, measures ms per decode step side by side in one
run, against the copy-bandwidth roofline measured in the same run:
  roofline_ms = (weight bytes + KV bytes read at that context) / copy bandwidth
and the weights-only roofline the issue quotes (weight bytes / bandwidth).

    python bench/decode.py --shapes llama-3.2-1b,llama-3.1-8b --batch-sizes 1,8,32,128 --context 1024
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, environment, matmul_tflops, summarize, write_result  # noqa: E402

from anneal.engine.llm import Engine, EngineArgs  # noqa: E402
from anneal.engine.plan import OpChoice, Plan, SchedulerKnobs, load_plan  # noqa: E402
from anneal.engine.sampling_params import SamplingParams  # noqa: E402
from anneal.engine.sequence import Sequence  # noqa: E402

# The hand-set Triton plan (one file, shared with the GPU tests and the serving benchmark).
HAND_SET = Path(__file__).resolve().parent / "plans" / "triton.json"
TRITON_OPS = load_plan(HAND_SET.read_text()).ops
GEMV_OPS = {op: OpChoice(impl="triton_gemv_splitk")
            for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")}


def plan_weight_bytes(engine, plan) -> int:
    """The weight bytes one decode step of ``plan`` reads: the model's, with each projection on an
    fp8 or bf12 copy counted at that copy's size (session 44: the bf12 8B step read "102.7% of the
    roofline" against the bf16 bytes)."""
    from anneal.engine import weight_copies
    from anneal.engine.plan import WEIGHT_FIELDS, weight_copies as plan_copies

    total = engine.weights.nbytes()
    for op, fmt in plan_copies(plan).items():
        for t in engine.weights.copy_targets(WEIGHT_FIELDS[op]):
            total += weight_copies.copy_bytes(t, fmt) - t.numel() * t.element_size()
    return total


def plan_key(token: str) -> str:
    """A ``--plans`` entry's name: a built-in plan's own, a plan file's stem."""
    return Path(token).stem if token.endswith(".json") else token


def bench_plans(buckets: list[int], files: list[str] = ()) -> dict[str, Plan]:
    """The built-in plans and the given plan files (keyed by ``plan_key``; a file overrides a
    built-in of the same name), all with the benchmark's graph buckets and scheduler."""
    sched = SchedulerKnobs(enable_prefix_caching=False, max_num_seqs=max(buckets))
    base = dict(cuda_graph_batch_sizes=buckets, scheduler=sched)
    built_in = {
        "reference": Plan(**base, name="reference"),
        "triton": Plan(**base, ops=TRITON_OPS, name="triton"),
        "triton-torch-argmax": Plan(**base, ops={k: v for k, v in TRITON_OPS.items() if k != "argmax"},
                                    name="triton with torch.argmax (the session-2 hand-set plan)"),
        "triton+gemv": Plan(**base, ops={**TRITON_OPS, **GEMV_OPS}, name="triton+gemv"),
        "triton+fused": Plan(**base, ops=TRITON_OPS, fusions=FUSED, name="triton+fused"),
        "triton+fused+pdl": Plan(**base, ops=with_pdl(TRITON_OPS), fusions=FUSED,
                                 name="triton+fused+pdl"),
    }
    return built_in | {plan_key(f): load_plan(Path(f).read_text()).model_copy(update=base) for f in files}


FUSED = {"lm_head_argmax": True, "silu_mul_down": True}


def with_pdl(ops: dict[str, OpChoice]) -> dict[str, OpChoice]:
    """Programmatic dependent launch where a variant declares it."""
    from anneal.engine.ops.registry import get_variant

    out = {}
    for op, c in ops.items():
        names = {p.name for p in get_variant(op, c.impl).params}
        out[op] = OpChoice(impl=c.impl, params={**c.params, "pdl": True}) if "pdl" in names else c
    return out


def decode_items(engine: Engine, bs: int, context: int, seed: int):
    rng = random.Random(seed)
    V = engine.config.vocab_size
    items = []
    for i in range(bs):
        s = Sequence(f"b{i}", [rng.randrange(V) for _ in range(context)],
                     SamplingParams(temperature=0), seed=i)
        assert engine.blocks.allocate(s), "KV cache too small for the benchmark"
        s.num_computed_tokens = context - 1  # the cache holds random (never zero) KV
        items.append((s, 1))
    return items


def time_steps(engine: Engine, items, steps: int, warmup: int) -> dict:
    for _ in range(warmup):
        engine.runner.run(items, decode_only=True)
    torch.cuda.synchronize()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.runner.run(items, decode_only=True)  # ends in the step's one host sync
        samples.append(time.perf_counter() - t0)
    return summarize(samples)


def time_replay(engine: Engine, bs: int, steps: int) -> dict | None:
    """GPU time of the captured graph alone (CUDA events), no host-side preparation."""
    if bs not in engine.runner.graphs:
        return None
    g = engine.runner.graphs[bs][0]  # (graph, outputs)
    for _ in range(3):
        g.replay()
    samples = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3)
    return summarize(samples)


def hf_decode_ms(shape: str, bs: int, context: int, new_tokens: int = 33) -> dict:
    """HF transformers eager `generate`: (T(n) - T(1)) / (n - 1) per decode step."""
    import transformers

    from anneal.engine.presets import preset_config

    c = preset_config(shape)
    kw = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=8192, tie_word_embeddings=c.tie_word_embeddings,
        rms_norm_eps=c.rms_norm_eps,
    )
    cls = transformers.Qwen3ForCausalLM if c.family == "qwen3" else transformers.LlamaForCausalLM
    cfg_cls = transformers.Qwen3Config if c.family == "qwen3" else transformers.LlamaConfig
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(cfg_cls(**kw)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, c.vocab_size, (bs, context), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        assert out.shape[1] == context + n
        return time.perf_counter() - t0

    run(2)  # warm-up
    t1 = statistics.median(run(1) for _ in range(2))
    tn = statistics.median(run(new_tokens) for _ in range(2))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"median_ms": (tn - t1) / (new_tokens - 1) * 1e3, "method": f"(T({new_tokens})-T(1))/{new_tokens - 1}"}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first step where two greedy streams differ (a shorter one parts where it ends); None if equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def greedy_margins(engine: Engine, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens with each step's top-1 minus top-2 log-probability: how near a tie each
    choice was. A plan that flips a near-tie (random weights give near-uniform logits) leaves the
    reference's stream without computing anything wrong; one that flips a wide margin is wrong."""
    rid = "greedy-margins"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=2))
    toks: list[int] = []
    margins: list[float] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            toks += o.new_token_ids
            for lp in o.new_logprobs or []:
                top = sorted(lp.top.values(), reverse=True)
                margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return toks, margins


def bench_shape(shape: str, batch_sizes: list[int], context: int, steps: int, bw: float,
                hf: bool, greedy_check: int, wanted: list[str], greedy_dtype: str = "bfloat16") -> dict:
    max_len = context + max(greedy_check, 16) + 16
    blocks_per_seq = -(-max_len // 16)
    keys = {plan_key(w) for w in wanted} | {"reference"}
    files = [w for w in wanted if w.endswith(".json")]
    plans = {k: v for k, v in bench_plans(batch_sizes, files).items() if k in keys}
    engine = Engine(EngineArgs(
        model=f"random:{shape}", device="cuda", dtype="bfloat16", max_model_len=max_len,
        num_kv_blocks=max(batch_sizes) * blocks_per_seq + 32, plan=plans["reference"],
    ))
    cfg = engine.config
    weight_bytes = engine.weights.nbytes()
    out: dict = {"shape": shape, "weight_bytes": weight_bytes, "context": context,
                 "load_s": engine.load_s, "plans": {}, "apply": {}, "rows": []}
    kv_per_token = cfg.kv_bytes_per_token(dtype_bytes=2)
    tokens: dict[str, list[int]] = {}
    margin_tokens: list[int] = []
    margins: list[float] = []  # the reference's top-1 minus top-2 log-probability per greedy step
    prompt = [random.Random(7).randrange(cfg.vocab_size) for _ in range(64)]
    for name, plan in plans.items():
        try:
            if name != "reference":
                rep = engine.apply_plan(plan)
                out["apply"][name] = rep.__dict__
        except Exception as e:  # a plan that fails to apply is a result, not a crash
            out["plans"][name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            continue
        read = plan_weight_bytes(engine, plan)  # fp8 / bf12 projections stream fewer bytes than bf16
        out["plans"][name] = {"ok": True, "hash": plan.hash, "weight_bytes_read": read}
        for bs in batch_sizes:
            items = decode_items(engine, bs, context, seed=bs)
            row = {"plan": name, "batch_size": bs, "mode": "cuda_graph"}
            row["step"] = time_steps(engine, items, steps, warmup=5)
            row["gpu"] = time_replay(engine, bs, steps)
            roof_w = read / (bw * 1e9) * 1e3
            roof_all = (read + bs * context * kv_per_token) / (bw * 1e9) * 1e3
            ms = (row["gpu"] or row["step"])["median_ms"]
            row.update(roofline_weights_ms=roof_w, roofline_ms=roof_all,
                       pct_roofline=100 * roof_all / ms, pct_roofline_weights=100 * roof_w / ms,
                       tokens_per_s=bs / row["step"]["median_ms"] * 1e3)
            out["rows"].append(row)
            print(f"{shape:14s} {name:12s} bs={bs:<4d} graph step {row['step']['median_ms']:8.3f} ms "
                  f"gpu {ms:8.3f} ms  {row['pct_roofline']:5.1f}% of roofline", flush=True)
            if name == "reference" or bs in (1, max(batch_sizes)):
                with engine.runner.eager():
                    er = time_steps(engine, items, max(steps // 4, 5), warmup=2)
                out["rows"].append({"plan": name, "batch_size": bs, "mode": "eager", "step": er,
                                    "pct_roofline": 100 * roof_all / er["median_ms"],
                                    "tokens_per_s": bs / er["median_ms"] * 1e3})
                print(f"{shape:14s} {name:12s} bs={bs:<4d} eager step {er['median_ms']:8.3f} ms", flush=True)
            for s, _ in items:
                engine.blocks.free(s)
        if greedy_check and greedy_dtype == "bfloat16":
            tokens[name] = engine.generate(
                [prompt], SamplingParams(max_tokens=greedy_check, temperature=0, ignore_eos=True))[0]
            if name == "reference":
                margin_tokens, margins = greedy_margins(engine, prompt, greedy_check)
    if greedy_check and greedy_dtype != "bfloat16":
        # Random weights give near-uniform logits, where a last-bit difference in bf16 flips an
        # argmax; in fp32 the same plans differ only by summation order.
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        engine = Engine(EngineArgs(model=f"random:{shape}", device="cuda", dtype=greedy_dtype,
                                   max_model_len=max_len, num_kv_blocks=blocks_per_seq + 32,
                                   plan=plans["reference"].model_copy(update={"cuda_graph_batch_sizes": [1]})))
        for name, plan in plans.items():
            if out["plans"].get(name, {}).get("ok"):
                if name != "reference":
                    engine.apply_plan(plan.model_copy(update={"cuda_graph_batch_sizes": [1]}))
                tokens[name] = engine.generate(
                    [prompt], SamplingParams(max_tokens=greedy_check, temperature=0, ignore_eos=True))[0]
        out["greedy_dtype"] = greedy_dtype
    if "reference" in tokens:
        ref = tokens["reference"]
        out["greedy_identical_to_reference"] = {n: t == ref for n, t in tokens.items() if n != "reference"}
        # where a plan's greedy stream first leaves the reference's (random weights give
        # near-uniform logits, so a last-bit difference can flip an argmax)
        out["greedy_first_divergence"] = {n: first_divergence(t, ref) for n, t in tokens.items() if n != "reference"}
        out["greedy_steps"] = greedy_check
        if margins:
            # how near a tie the reference's choice was where each plan left it, against a typical step
            out["greedy_reference_margin"] = {
                "median": statistics.median(margins), "min": min(margins),
                "tokens_match_without_logprobs": margin_tokens == ref,
                "at_divergence": {n: margins[i] if i is not None and i < len(margins) else None
                                  for n, i in out["greedy_first_divergence"].items()}}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if hf:
        for bs in batch_sizes:
            try:
                h = hf_decode_ms(shape, bs, context)
            except Exception as e:
                h = {"error": f"{type(e).__name__}: {e}"}
            roof_all = (weight_bytes + bs * context * kv_per_token) / (bw * 1e9) * 1e3
            row = {"plan": "hf_transformers_generate", "batch_size": bs, "mode": "eager", "step": h}
            if "median_ms" in h:
                row["pct_roofline"] = 100 * roof_all / h["median_ms"]
                row["tokens_per_s"] = bs / h["median_ms"] * 1e3
            out["rows"].append(row)
            print(f"{shape:14s} HF generate  bs={bs:<4d} {h}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--plans", default="reference,triton,triton+gemv,triton+fused,triton+fused+pdl",
                    help="named plans and/or plan JSON files (named by their file stem)")
    ap.add_argument("--greedy-check", type=int, default=256)
    ap.add_argument("--greedy-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of the greedy-identity check (float32: a separate engine)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    ap.add_argument("--name", default="decode", help="result file stem")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    bs = [int(x) for x in args.batch_sizes.split(",")]
    result = {"env": environment(), "copy_gbps": copy_bandwidth_gbps(), "matmul_tflops": matmul_tflops(),
              "shapes": []}
    print(f"copy bandwidth {result['copy_gbps']:.0f} GB/s, bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s")
    for shape in args.shapes.split(","):
        result["shapes"].append(bench_shape(shape, bs, args.context, args.steps, result["copy_gbps"],
                                            not args.no_hf, args.greedy_check,
                                            args.plans.split(","), args.greedy_dtype))
    path = write_result(args.name, result, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
