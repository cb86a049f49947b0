"""Write one-change variants of a plan (one op param each) as plan files, for a quick side-by-side
sweep with ``bench/decode.py --plans`` when the compiler is not run (e.g. one batch size on the GPU).

    python bench/plan_variants.py bench/plans/gemv-pdl.json --out /tmp/variants
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (op, params overlaid on the op's params in the base plan)
CHANGES = [
    ("attention_decode", {"split_k": 4}), ("attention_decode", {"split_k": 8}), ("attention_decode", {"split_k": 32}),
    ("attention_decode", {"block_n": 32}), ("attention_decode", {"block_n": 128}),
    ("attention_decode", {"num_warps": 2}),
    ("rmsnorm", {"num_warps": 2}), ("add_rmsnorm", {"num_warps": 2}), ("add_rmsnorm", {"num_warps": 8}),
    ("qk_rope_store", {"num_warps": 1}), ("qk_rope_store", {"num_warps": 2}),
    ("qkv_proj", {"num_warps": 8}), ("o_proj", {"block_n": 64, "block_k": 128}), ("down_proj", {"block_n": 64}),
    ("down_proj", {"num_warps": 8}), ("silu_and_mul", {"block": 2048, "num_warps": 8}),
    # for the 8B shape: the attention's merge done by the last split, wider GEMV tiles
    ("attention_decode", {"merge": "ticket"}), ("attention_decode", {"split_k": 16}),
    ("attention_decode", {"num_warps": 8}), ("qkv_proj", {"block_n": 64}), ("o_proj", {"block_n": 64}),
    ("down_proj", {"block_k": 128}), ("gate_up_proj", {"block_n": 64, "block_k": 128}),
    ("gate_up_proj", {"split_k": 0}),
    # session 9: with the attention prefetch, smaller attention tiles; GEMV weight tiles kept ahead
    ("attention_decode", {"split_k": 32, "block_n": 32}), ("attention_decode", {"num_stages": 1}),
    ("qkv_proj", {"ahead": 2}), ("o_proj", {"ahead": 2}), ("down_proj", {"ahead": 2}), ("down_proj", {"ahead": 3}),
    ("o_proj", {"split_k": 8}), ("down_proj", {"split_k": 8}),
    # session 10: neighbours of the dot-path down / gate_up (`-downdot-o8`) and of o split 8
    ("down_proj", {"split_k": 2}), ("down_proj", {"num_warps": 2}), ("gate_up_proj", {"num_stages": 4}),
    ("gate_up_proj", {"split_k": 2}), ("gate_up_proj", {"num_warps": 8}), ("o_proj", {"split_k": 16}),
    ("qkv_proj", {"split_k": 8}), ("qkv_proj", {"split_k": 16}), ("attention_decode", {"prefetch": 0}),
]

# fusions the base plan does not have, switched on one at a time
FUSION_CHANGES = ["lm_head_argmax", "silu_mul_down", "gate_up_silu", "linear_norm"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    base = json.loads(args.base.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for op, change in CHANGES:
        plan = json.loads(json.dumps(base))
        choice = plan["ops"].get(op)
        if choice is None:  # the base plan leaves this op on its default: nothing to vary
            continue
        choice["params"] = {**choice.get("params", {}), **change}
        tag = "-".join(f"{k}{v}" for k, v in change.items())
        plan["name"] = f"{base.get('name', args.base.stem)} | {op} {tag}"
        (args.out / f"{args.base.stem}--{op}-{tag}.json").write_text(json.dumps(plan, indent=1))
    for fusion in FUSION_CHANGES:
        if base.get("fusions", {}).get(fusion):
            continue
        plan = json.loads(json.dumps(base))
        plan["fusions"] = {**plan.get("fusions", {}), fusion: True}
        plan["name"] = f"{base.get('name', args.base.stem)} | + {fusion}"
        (args.out / f"{args.base.stem}--fusion-{fusion}.json").write_text(json.dumps(plan, indent=1))
    print(",".join(str(p) for p in sorted(args.out.glob("*.json"))))


if __name__ == "__main__":
    main()
