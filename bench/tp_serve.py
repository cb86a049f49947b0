#!/usr/bin/env python
"""The serving engine at tensor-parallel degree N beside degree 1, on one host (issue 5).

``bench/tp_probe.py`` times one split decode step in isolation; this runs the engine itself
(``Engine`` with ``parallelism.tensor_parallel``: worker processes mirroring rank 0's runner,
engine/tp_workers.py), once per degree, back to back in one run on the same GPUs and weights:

* decode steps at fixed batches and context (``POST /admin/benchmark``'s decode mode: graph
  replays, CUDA-event timing, rotating inputs): the step's ms and its ratio to degree 1;
* a traffic shape's workload replay (the same requests at each degree): tokens/s and p90 ITL;
* greedy tokens of a few prompts, compared with degree 1's (in bf16 near-ties of random weights may
  part: the share of equal tokens is reported; in fp32 on the CPU they must be equal);
* the engine's start-up phases (the workers load, split and capture in parallel with rank 0).

Run: ``python bench/tp_serve.py --out DIR`` on a host with 2+ GPUs (``bench/h200.sh tp``; NCCL's
NVLink multicast off on the lent machines). ``--device cpu`` runs ``random:tiny`` at degrees 1 and 2
under gloo and checks the premise only: degree 2's greedy tokens equal degree 1's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import premise_holds, print_variant_row, probe_parser, write_probe  # noqa: E402

from anneal.engine.benchmark import BenchmarkRequest, run_benchmark  # noqa: E402
from anneal.engine.llm import Engine, EngineArgs  # noqa: E402
from anneal.engine.plan import Plan, load_plan  # noqa: E402
from anneal.engine.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[(7 * i + 13 * j) % 250 + 1 for j in range(12 + 5 * i)] for i in range(4)]


def measure(args, plan: Plan, degree: int) -> dict:
    """One engine at ``degree``: its start-up, decode steps, workload replay and greedy tokens."""
    t0 = time.perf_counter()
    engine = Engine(EngineArgs(model=args.model, device=args.device, plan=plan.with_tensor_parallel(degree),
                               max_model_len=args.max_model_len))
    start_s = time.perf_counter() - t0
    try:
        tokens = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        decode = {}
        for b in args.batch_list:
            r = run_benchmark(engine, BenchmarkRequest(mode="decode", batch_size=b, context_len=args.context,
                                                       steps=args.steps, warmup=5))
            decode[b] = r.median_ms
            print(f"degree {degree}, batch {b}: {r.median_ms:.4f} ms", flush=True)
        workload = None
        if args.traffic:
            w = run_benchmark(engine, BenchmarkRequest(mode="workload", traffic=args.traffic,
                                                       num_requests=args.num_requests, seed=1))
            workload = {"tokens_per_s": w.tokens_per_s, **{k: w.extra.get(k) for k in ("itl_p90_ms", "ttft_p90_ms")}}
            print(f"degree {degree}, {args.traffic}: {w.tokens_per_s:.1f} tokens/s", flush=True)
        return {"start_s": start_s, "startup": engine.startup, "decode_ms": decode, "workload": workload,
                "tokens": tokens, "kv_blocks": engine.blocks.num_blocks}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=0)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--plan", default=str(ROOT / "bench" / "plans" / "triton-overlap.json"))
    ap.add_argument("--degrees", default=None, help="default: 1 and every GPU (1,2 on the CPU)")
    ap.add_argument("--batches", default="1,8,16,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--traffic", default="chat", help="a traffic preset to replay ('' for none)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens a prompt for the comparison")
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:  # the premise only: the tiny model in fp32, a short replay
        args.model, args.plan, args.batches, args.context, args.steps = "random:tiny", None, "1,4", 64, 3
        args.traffic, args.max_model_len, args.tokens = "", 256, 12
    args.batch_list = [int(b) for b in args.batches.split(",")]
    degrees = [int(d) for d in args.degrees.split(",")] if args.degrees else \
        [1, 2] if cpu else [1, torch.cuda.device_count()]
    plan = load_plan(Path(args.plan).read_text()) if args.plan else Plan()
    runs = {d: measure(args, plan, d) for d in degrees}
    base = runs[degrees[0]]
    rows = []
    for d, run in runs.items():
        same = [a == b for x, y in zip(run["tokens"], base["tokens"]) for a, b in zip(x, y)]
        row = {"variant": f"tp{d}", "degree": d, "start_s": round(run["start_s"], 2),
               "equal_tokens": round(sum(same) / len(same), 4), "kv_blocks": run["kv_blocks"],
               **{f"bs{b}_ms": round(ms, 4) for b, ms in run["decode_ms"].items()},
               **{f"bs{b}_ratio": round(ms / base["decode_ms"][b], 4) for b, ms in run["decode_ms"].items()}}
        if run["workload"]:
            row.update({f"{args.traffic}_{k}": v for k, v in run["workload"].items()})
            row[f"{args.traffic}_ratio"] = round(run["workload"]["tokens_per_s"] / base["workload"]["tokens_per_s"], 4)
        rows.append(row)
        print_variant_row(row, 6)
    if cpu:
        equal = all(r["equal_tokens"] == 1.0 for r in rows)
        ok = premise_holds(f"degree 2 serves degree 1's greedy tokens: {equal}", equal,
                           "the split engine computes another model: its timings would mean nothing")
        return 0 if ok else 1
    write_probe(f"tp-serve-{Path(args.model.split(':')[-1]).name}", args.out, torch.device("cuda"), reps=args.steps,
                rows=rows, model=args.model, plan=plan.name or args.plan, context=args.context,
                startup={d: r["startup"] for d, r in runs.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
