"""Each plan's teacher-forced logits against the truth: the same weights and tokens computed in fp32.

Why: verification's quality check measured a bf16 plan's distance from the bf16 reference plan, so a
plan that only rounds otherwise read as far from it as a less accurate one. On the H200's 8B
(session 20) `folded_norm` sat at 0.0949 from the reference, `triton.json` at 0.0654, the tolerance
0.0707. Here every plan, the bf16 reference plan too, is measured against the model run in fp32 on
the bf16 weights (`engine/truth.py`, which verification now judges by), beside its distance from
the reference plan: when a plan's error against the truth is no larger than the reference plan's
own, it is differently rounded, not less accurate. Session 21 measured it on the 8B (NOTES).

The prompts and greedy tokens are verification's (`engine/verify.py`); "quality" is its check.

    python bench/quality_truth.py --model random:llama-3.1-8b \
        --plans reference,bench/plans/triton.json,bench/plans/triton-overlap-token-graphs-folded.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402
from plans import load_plans  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--plans", default="reference,bench/plans/triton.json")
    ap.add_argument("--dtype", default="bfloat16", help="the serving dtype the plans run in")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-file", default=None,
                    help="JSON with a \"prompts\" list of token-id lists (a trained checkpoint's heldout.json) "
                         "instead of verification's random prompts; each is cut to --max-prompt-len")
    ap.add_argument("--device", default=None)
    ap.add_argument("--name", default="quality-truth")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8-weights", action="store_true",
                    help="after the truth and the reference plan's logits, round every layer's projection weights "
                         "to float8_e4m3 (one scale an output row, as weight-only fp8 serving stores them) in place "
                         "and measure the plans again: the quality an fp8-weight plan would reach, against the "
                         "truth of the weights as served")
    args = ap.parse_args(argv)

    import torch

    from anneal.engine.llm import Engine, EngineArgs
    from anneal.engine.plan import Plan
    from anneal.engine.sampling_params import SamplingParams
    from anneal.engine.truth import truth_logits
    from anneal.engine.verify import _compare, _Forcer, _quality, reference_of, tolerance

    plans = load_plans(args.plans.split(","))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    blocks = args.num_prompts * (args.max_prompt_len + args.steps + 32) // 16 + 16
    served = Engine(EngineArgs(model=args.model, device=device, dtype=args.dtype, num_kv_blocks=blocks,
                               max_model_len=args.max_prompt_len + args.steps + 16))

    rng = random.Random(args.seed)  # as verify() draws them
    V = served.config.vocab_size
    if args.prompts_file:  # text the model was trained on the like of: its logits are as peaked as served
        prompts = [p[: args.max_prompt_len] for p in json.loads(Path(args.prompts_file).read_text())["prompts"]]
        prompts = prompts[: args.num_prompts]
    else:
        prompts = [[rng.randrange(V) for _ in range(rng.randint(8, args.max_prompt_len))]
                   for _ in range(args.num_prompts)]
    served.apply_plan(reference_of(Plan()))
    greedy = served.generate(prompts, SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True))
    forced = [g[: args.steps] for g in greedy]
    truth = truth_logits(served, prompts, forced)
    reference = _Forcer(served).run(prompts, forced)
    tol = tolerance(served)

    rows = {}
    runs = list(plans)
    if args.fp8_weights:
        runs += [(f"{label}+fp8-weights", plan) for label, plan in plans]
    rounded = False
    for label, plan in runs:
        if label.endswith("+fp8-weights") and not rounded:
            _round_to_fp8(served)
            rounded = True
        served.apply_plan(plan if not label.startswith("reference") else reference_of(plan))
        got = _Forcer(served).run(prompts, forced)
        vs_truth = _compare("truth", got, truth, tol, False)
        vs_ref = _compare("reference", got, reference, tol, False)
        gate = _quality(got, reference, truth, tol, False, 0.98)
        rows[label] = {"plan_hash": plan.hash, "fp8_weights": label.endswith("+fp8-weights"),
                       "vs_truth": vs_truth.metrics, "vs_reference": vs_ref.metrics,
                       "quality": {"passed": gate.passed, "detail": gate.detail, **gate.metrics}}
        print(f"{label:<40} vs fp32 truth: max rel err {vs_truth.metrics['max_rel_err']:.4f}, greedy "
              f"{vs_truth.metrics['argmax_agreement']:.3f} of {vs_truth.metrics['decisive_positions']} | vs the "
              f"{args.dtype} reference plan: {vs_ref.metrics['max_rel_err']:.4f}, greedy "
              f"{vs_ref.metrics['argmax_agreement']:.3f} (tolerance {tol:.4f}) | quality check: "
              f"{'passed' if gate.passed else 'FAILED'} (bound {gate.metrics['bound']:.4f}, "
              f"{gate.metrics['decisive_positions']} decisive)", file=sys.stderr, flush=True)
    path = write_result(args.name, {
        "benchmark": "teacher-forced logits of each plan against the fp32 truth and the reference plan",
        "environment": environment(), "model": args.model, "device": device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "prompts_file": args.prompts_file, "steps": args.steps, "seed": args.seed,
        "tolerance": tol,
        "plans": {label: plan.model_dump(mode="json") for label, plan in plans}, "results": rows,
        "fp8_weights": "float8_e4m3fn, one scale an output row (amax / 448), qkv / o / gate_up / down of every layer; "
                       "embedding, norms and lm_head as served" if args.fp8_weights else None,
    }, Path(args.out) if args.out else None)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _round_to_fp8(served) -> None:
    """Every layer's projection weights rounded to float8_e4m3fn with a scale per output row and
    stored back in the served dtype: what a weight-only fp8 plan's kernels would multiply by (they
    dequantize exactly), so its only new error is the weights' rounding. In place: the truth and the
    reference plan's logits were taken before."""
    import torch

    for layer in served.weights.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name)
            scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            w.copy_((q.float() * scale).to(w.dtype))
    served.weights.folded = None  # folded_norm copies are made from the weights at its next apply


if __name__ == "__main__":
    raise SystemExit(main())
