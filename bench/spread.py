"""Fast-tier timing spread: how much one plan's decode time moves between repeated benchmarks.

Why: the fast tier (first k layers) ranks candidates by differences of a few percent, so the same
plan measured again must land within a tighter band than the gains it is asked to see. This loads
the fast tier, applies one plan, and runs the compiler's decode benchmark (graph replays timed by
CUDA events, warm-up excluded, rotating inputs) many times; the figure is p90/p10 of the per-run
medians of the time the compiler ranks on, with the wall clock's beside it.

    python bench/spread.py --model random:llama-3.1-8b --layers 2 --plan bench/plans/triton.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, summarize, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--plan", default=None, help="Plan/CompiledPlan file (default: the reference plan)")
    ap.add_argument("--shapes", default="1x1024,16x700,64x1024", help="BATCHxCONTEXT,...")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from anneal.engine.benchmark import BenchmarkRequest, run_benchmark
    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.plan import Plan, load_plan

    plan = load_plan(Path(args.plan).read_text()) if args.plan else Plan()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    eng = Engine(EngineArgs(model=args.model, device=device, layers=args.layers, plan=plan))
    results = []
    for shape in args.shapes.split(","):
        bs, ctx = (int(x) for x in shape.split("x"))
        req = BenchmarkRequest(mode="decode", batch_size=bs, context_len=ctx, prompt_len=min(ctx - 1, 128),
                               steps=args.steps, warmup=3)
        meds, inner, wall, timing = [], [], [], set()
        for i in range(args.runs):
            res = run_benchmark(eng, req.model_copy(update={"seed": i}))
            meds.append(res.median_ms)  # what the compiler ranks on
            inner.append(res.p90_ms / res.p10_ms)
            wall.append(res.extra["wall_median_ms"])
            timing.add(res.extra["timing"])
        s = summarize([m / 1e3 for m in meds])
        w = summarize([m / 1e3 for m in wall])
        row = {"batch": bs, "context": ctx, "runs": args.runs, "steps": args.steps, "timing": sorted(timing),
               "medians_ms": meds, **s, "spread_p90_over_p10": s["p90_ms"] / s["p10_ms"],
               "within_run_p90_over_p10_median": statistics.median(inner),
               "wall": {**w, "medians_ms": wall, "spread_p90_over_p10": w["p90_ms"] / w["p10_ms"]}}
        line = (f"bs={bs:>4} ctx={ctx:>5}: ranked step time ({', '.join(sorted(timing))}) median "
                f"{s['median_ms']:.4f} ms, p90/p10 of {args.runs} run medians {row['spread_p90_over_p10']:.4f} "
                f"(within a run {row['within_run_p90_over_p10_median']:.4f}); wall median {w['median_ms']:.4f} ms, "
                f"p90/p10 {row['wall']['spread_p90_over_p10']:.4f}")
        results.append(row)
        print(line, file=sys.stderr, flush=True)
    path = write_result(args.name or f"spread-{args.model.removeprefix('random:')}-k{args.layers}", {
        "benchmark": "fast-tier timing spread", "environment": environment(), "model": args.model,
        "layers": args.layers, "plan": plan.model_dump(mode="json"), "plan_hash": plan.hash,
        "device": device, "results": results,
    }, Path(args.out) if args.out else None)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
