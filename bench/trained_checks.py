"""Greedy identity and the n-gram drafter on a trained checkpoint, beside the same model untrained.

Two open claims rest on random weights: bf16 plans leave the reference plan's greedy tokens at
near-ties (issue 4's 256-step identity), and prompt lookup accepts nothing (issue 5's last lever).
Both say "trained weights would differ"; this measures it on a checkpoint trained here
(`bench/train_small.py`) and on its own initial weights (the control: the same shapes, tokenizer and
prompts). Prompts are windows of held-out files (``heldout.json`` in the folder).

For each model and plan, at batch size 1: the greedy tokens of every prompt over ``--steps`` steps
against the reference plan's (identical or not, where they first part, the reference's top-1 minus
top-2 log-probability there), tokens/s at batch size 1 (a plan with ``speculative_tokens`` also
reports its drafts), and what the n-gram drafter (engine/ngram_draft.py) would have accepted on the
reference's outputs.

    python bench/trained_checks.py --models /tmp/stdlib-llama,/tmp/stdlib-llama-init \
        --plans reference,bench/plans/triton.json,bench/plans/gemv-pdl-rope-gu-prefetch-down2-s1.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402
from decode import first_divergence, greedy_margins  # noqa: E402
from plans import load_plans  # noqa: E402

from anneal.engine.ngram_draft import draft_stats  # noqa: E402


def check_model(folder: str, plan_names: list[str], prompts: list[list[int]], steps: int, device: str,
                dtype: str) -> dict:
    import torch

    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.sampling_params import SamplingParams

    max_len = max(map(len, prompts)) + steps + 16
    # each plan as it is (its scheduler knobs too), with a decode graph at batch size 1 and no prefix
    # cache: every prompt computed by the plan itself
    plans = {label: plan.model_copy(update={
        "cuda_graph_batch_sizes": [1] if plan.ops else [],
        "scheduler": plan.scheduler.model_copy(update={"enable_prefix_caching": False})})
        for label, plan in load_plans(plan_names)}
    keys = list(plans)
    engine = Engine(EngineArgs(model=folder, device=device, dtype=dtype, max_model_len=max_len,
                               num_kv_blocks=-(-max_len // 16) + 32, plan=plans["reference"]))
    out: dict = {"model": folder, "plans": {}}
    tokens: dict[str, list[list[int]]] = {}
    margins: list[list[float]] = []
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    for key in keys:
        t0 = time.perf_counter()
        try:
            if key != "reference":
                engine.apply_plan(plans[key])
        except Exception as e:  # a plan that does not apply to this model is a result
            out["plans"][key] = {"error": f"{type(e).__name__}: {e}"}
            continue
        engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm
        before, t1 = engine.stats(), time.perf_counter()
        tokens[key] = [engine.generate([p], params)[0] for p in prompts]  # batch size 1, as issue 4 asks
        gen_s, after = time.perf_counter() - t1, engine.stats()
        if key == "reference":
            margins = [greedy_margins(engine, p, steps)[1] for p in prompts]
        out["plans"][key] = {
            "hash": plans[key].hash, "seconds": time.perf_counter() - t0,
            # wall time of the greedy runs alone: tokens/s at batch size 1, and speculation's share of it
            "generate_s": gen_s, "tokens_per_s": len(prompts) * steps / gen_s, "steps": after.steps - before.steps,
            **{k: getattr(after, k) - getattr(before, k) for k in ("speculative_steps", "drafted_tokens",
                                                                   "accepted_tokens")}}
    ref = tokens.get("reference")
    if ref is None:
        return out
    flat = [m for ms in margins for m in ms]
    out["reference_margin"] = {
        "median": statistics.median(flat),
        "share_below": {str(t): sum(m < t for m in flat) / len(flat) for t in (0.01, 0.05, 0.1, 0.5)}}
    for key, toks in tokens.items():
        if key == "reference":
            continue
        div = [first_divergence(t, r) for t, r in zip(toks, ref)]
        out["plans"][key].update(
            identical=sum(d is None for d in div), prompts=len(prompts), first_divergence=div,
            margin_at_divergence=[margins[i][d] if d is not None and d < len(margins[i]) else None
                                  for i, d in enumerate(div)])
    out["drafter"] = {f"k{k}": draft_stats(list(zip(prompts, ref)), k=k).as_dict() for k in (2, 4, 6)}
    out["distinct_output_share"] = statistics.mean(len(set(r)) / len(r) for r in ref)
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="checkpoint folders, comma-separated (the first one's "
                                                    "heldout.json gives the prompts)")
    ap.add_argument("--plans", default="reference,bench/plans/triton.json")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--name", default="trained-checks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    folders = args.models.split(",")
    plan_names = args.plans.split(",")
    if "reference" not in plan_names:
        ap.error("--plans must include reference")
    plan_names.remove("reference")
    plan_names.insert(0, "reference")
    held = json.loads((Path(folders[0]) / "heldout.json").read_text())
    prompts = held["prompts"][: args.num_prompts]
    result = {"env": environment(), "steps": args.steps, "dtype": args.dtype, "prompts": len(prompts),
              "prompt_source": held.get("source"), "models": []}
    for folder in folders:
        row = check_model(folder, plan_names, prompts, args.steps, device, args.dtype)
        training = Path(folder) / "training.json"
        if training.exists():
            t = json.loads(training.read_text())
            row["training"] = {k: t.get(k) for k in ("params", "step", "seconds", "heldout_loss")}
        result["models"].append(row)
        for key, p in row["plans"].items():
            if "identical" in p:
                print(f"{folder}: {key}: {p['identical']}/{p['prompts']} identical over {args.steps} steps; "
                      f"first divergences {p['first_divergence']}; {p['tokens_per_s']:.0f} tok/s at bs 1, "
                      f"{p['accepted_tokens']}/{p['drafted_tokens']} drafts accepted", flush=True)
        if "drafter" in row:
            d = row["drafter"]["k4"]
            print(f"{folder}: reference margin median {row['reference_margin']['median']:.3f}, "
                  f"below 0.05: {row['reference_margin']['share_below']['0.05']:.3f}; drafter k=4 "
                  f"{d['tokens_per_step']:.3f} tokens a step ({d['accepted']}/{d['drafted']} accepted)", flush=True)
    path = write_result(args.name, result, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
