"""Write one-change variants of a plan (one op param each) as plan files, for a quick side-by-side
sweep with ``bench/decode.py --plans`` when the compiler is not run (e.g. one batch size on the GPU).

    python bench/plan_variants.py bench/plans/gemv-pdl.json --out /tmp/variants
    python bench/plan_variants.py bench/plans/chat-s23-compiled.json --fused-tiles --out /tmp/tiles

``--fused-tiles``: the tiles of the GEMVs the plan's fusions run, one change at a time. A fused GEMV
takes its projection's params (``engine/fusions.build_fusions``), and a compiled plan whose
projections chose cuBLAS runs its fused GEMVs at the default tiles: each variant puts that
projection on the Triton GEMV (up to 64 rows, as the fusions run) with one param changed, beside a
control with none changed. Why: session 23's fused GEMVs lost 10-12% with the unfused bs=1 tiles,
so fused tiles have to be timed fused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from anneal.engine.plan import GEMV_FUSION_PROJECTIONS, GEMV_MAX_M

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

# one change each from the GEMV's defaults (64 x 64 x 128 tiles, split-K from the SM count, 4 warps,
# 3 stages, split sums by a second kernel)
TILE_CHANGES = [
    {"block_n": 32}, {"block_n": 128}, {"block_k": 64}, {"block_k": 256}, {"block_m": 16}, {"block_m": 32},
    {"split_k": 1}, {"split_k": 2}, {"split_k": 4}, {"num_warps": 2}, {"num_warps": 8},
    {"num_stages": 2}, {"num_stages": 4}, {"reduce": "ticket"},
]


def fused_tile_variants(base: dict, stem: str) -> dict[str, dict]:
    """File name -> plan: for each projection a fusion of ``base`` runs, a control (the Triton GEMV
    at its defaults) and one variant per ``TILE_CHANGES`` entry, over the projection's own params
    when it already is the Triton GEMV."""
    out: dict[str, dict] = {}
    on = [f for f, enabled in base.get("fusions", {}).items() if enabled]
    projections = sorted({p for f in on for p in GEMV_FUSION_PROJECTIONS.get(f, ())})
    for op in projections:
        choice = base.get("ops", {}).get(op, {"impl": "reference"})
        params = dict(choice.get("params", {})) if choice.get("impl") == "triton_gemv_splitk" else {}
        params.setdefault("max_m", GEMV_MAX_M)  # as the fusions run: decode steps up to it
        for change in [{}, *TILE_CHANGES]:
            if change and all(params.get(k) == v for k, v in change.items()):
                continue  # already the base's
            plan = json.loads(json.dumps(base))
            plan.setdefault("ops", {})[op] = {"impl": "triton_gemv_splitk", "params": {**params, **change}}
            tag = "-".join(f"{k}{v}" for k, v in change.items()) or "gemv"
            plan["name"] = f"{base.get('name', stem)} | fused {op} {tag}"
            out[f"{stem}--{op}-{tag}.json"] = plan
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fused-tiles", action="store_true",
                    help="only the tiles of the GEMVs the plan's fusions run, one change at a time")
    args = ap.parse_args()
    base = json.loads(args.base.read_text())
    base = base.get("plan", base)  # a CompiledPlan artifact holds its plan under "plan"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fused_tiles:
        variants = fused_tile_variants(base, args.base.stem)
        if not variants:
            raise SystemExit(f"{args.base}: no GEMV fusion on ({sorted(GEMV_FUSION_PROJECTIONS)}), no fused tiles to vary")
        for name, plan in variants.items():
            (args.out / name).write_text(json.dumps(plan, indent=1))
        print(",".join(str(args.out / n) for n in sorted(variants)))
        return
    for op, change in CHANGES:
        plan = json.loads(json.dumps(base))
        choice = plan["ops"].get(op)
        if choice is None or choice.get("impl", "reference") == "reference":
            continue  # the op's default or the reference (which has no params): nothing to vary
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
