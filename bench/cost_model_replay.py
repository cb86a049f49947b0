#!/usr/bin/env python
"""How well does the cost model predict shapes it has not seen? A compile's ledger replayed (CPU only).

The fast tier times every candidate's ops at a few decode shapes (batch 1 and 16, the traffic's
mean context and a longer one). This feeds the per-op timings of some shapes to a fresh
``CostModel`` (``observe``, as the compile does) and compares its per-op predictions at the other
shapes with what the engine measured there, once with the fitted lines (``fixed + slope x
roofline`` a call, where the shapes seen allow) and once with multiplicative factors only (the
model before session 30). The graph-bucket agent, the kernel tuner's weighting over buckets and the
tensor-parallel choice all predict shapes nobody timed.

Then the whole decode step as the compile predicts it (``online_errors``): every fast-tier step in
ledger order, predicted before it is observed, by the model of each session (``ONLINE_MODELS``).

    python bench/cost_model_replay.py bench/results/compile-chat-s29-1800-final/ledger.sqlite.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

from anneal.agents.cost_model import GPU_SPECS, CostModel, shape_from_config
from anneal.agents.ledger import Ledger
from anneal.agents.types import HardwareSpec
from anneal.engine.presets import PRESETS


def _read(ledger_path: Path, read):
    """``read(Ledger)`` on the ledger (gzipped or not), through a temporary copy."""
    with tempfile.TemporaryDirectory() as tmp:
        path = ledger_path
        if ledger_path.suffix == ".gz":
            path = Path(tmp) / "ledger.sqlite"
            with gzip.open(ledger_path) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        return read(Ledger(path))


def decode_experiments(ledger_path: Path) -> list:
    """The ledger's measured fast-tier decode experiments, in the order they ran."""
    exps = _read(ledger_path, lambda ledger: ledger.experiments(tier="fast", kind="benchmark"))
    return sorted((e for e in exps if e.spec and e.spec.mode == "decode" and e.measurement
                   and e.measurement.median_ms > 0), key=lambda e: e.id)


def whole_model_errors(ledger_path: Path, exps: list, model: str, copy_gbps: float, layers: int,
                       gpu: str = "H200") -> dict:
    """The one whole-model decode step a compile measures (its winner served at each degree after
    the search, ledger meta ``tp_measured``, from session 34 on) against each model's prediction from
    every fast-tier step: what the tensor-parallel choice rests on. The spec is the fast tier's most
    timed one (the compile's decode spec)."""
    rows, every = _read(ledger_path, lambda ledger: (ledger.get_meta("tp_measured") or [], ledger.experiments()))
    plans = {e.plan.hash: e.plan for e in every if e.plan is not None}
    spec = Counter(e.spec for e in exps).most_common(1)[0][0] if exps else None
    rows = [r for r in rows if r["plan_hash"] in plans and "measured_ms" in r and spec is not None]
    out: dict = {}
    for name, flags in ONLINE_MODELS.items():
        if not rows:
            break
        cm = model_for(model, copy_gbps, layers, gpu, **flags)
        for e in exps:
            cm.observe(e.plan, e.spec, e.measurement)
        for row in rows:
            ms = cm.whole_model(row["degree"]).predict(plans[row["plan_hash"]], spec, tp=row["degree"]).ms
            out.setdefault(f"degree {row['degree']}", {})[name] = {
                "predicted_ms": round(ms, 4), "measured_ms": row["measured_ms"], "error": round(ms / row["measured_ms"] - 1, 4)}
    return out


def timed_ops(ledger_path: Path) -> list:
    """The ledger's fast-tier decode experiments that carry per-op timings."""
    return [e for e in decode_experiments(ledger_path) if e.measurement.per_op_ms]


def model_for(model: str, copy_gbps: float, layers: int, gpu: str = "H200", **flags) -> CostModel:
    """The compile's cost model on ``gpu`` (a ``GPU_SPECS`` name: its memory and graphed-step
    constant), at the run's measured copy bandwidth and the matmul rate measured on the H200."""
    hw = HardwareSpec(name=f"NVIDIA {gpu}", mem_gbps=copy_gbps, matmul_tflops=780,
                      memory_gb=GPU_SPECS[gpu]["memory_gb"], graph_step_us=GPU_SPECS[gpu].get("graph_step_us", 0.0))
    return CostModel(shape=shape_from_config(dict(PRESETS[model])), hw=hw, layers=layers, **flags)


# The whole step's prediction as the compile makes it, by session: factors and one step factor
# (geometric mean over every plan); per-op lines; the step factor per fusion set, as a median; that
# factor on the layers' part of the sum only (lm_head left as timed); a graphed step's constant
# counted once, out of that factor; that factor from the steps at the nearest batch, and a fused
# lm_head + argmax predicted as itself once timed (``FUSED_HEAD``).
_BEFORE_37 = dict(size_steps=False, fused_head=False)
ONLINE_MODELS = {
    "factors (before session 30)": dict(lines=False, fusion_steps=False, step_constant=False, **_BEFORE_37),
    "lines (session 30)": dict(lines=True, fusion_steps=False, step_constant=False, **_BEFORE_37),
    "lines + fusion-set steps (session 31)": dict(lines=True, fusion_steps=True, layer_steps=False,
                                                  step_constant=False, **_BEFORE_37),
    "+ step factor on the layers (session 35)": dict(lines=True, fusion_steps=True, layer_steps=True,
                                                     step_constant=False, **_BEFORE_37),
    "+ a graphed step's constant once (session 36)": dict(lines=True, fusion_steps=True, layer_steps=True,
                                                          **_BEFORE_37),
    "+ its factor at the nearest batch, the fused head as timed (session 37)": dict(
        lines=True, fusion_steps=True, layer_steps=True),
}


def online_errors(exps: list, model: str, copy_gbps: float, layers: int, gpu: str = "H200",
                  **flags) -> dict[str, list[float]]:
    """The compile's own use: each step predicted before it is measured, then observed, in ledger
    order. |predicted / measured - 1| of the whole step, for plans with and without fusions, counted
    once the model has seen a step (the first is the bare roofline)."""
    cm = model_for(model, copy_gbps, layers, gpu, **flags)
    errs: dict[str, list[float]] = {"fused": [], "unfused": []}
    for e in exps:
        pred = cm.predict(e.plan, e.spec)
        if pred.corrected:
            errs["fused" if e.plan.fusions else "unfused"].append(abs(pred.ms / e.measurement.median_ms - 1))
        cm.observe(e.plan, e.spec, e.measurement)
    return errs


def held_out_errors(exps: list, train: set, model: str, copy_gbps: float, layers: int, lines: bool,
                    gpu: str = "H200") -> dict:
    """|predicted / measured - 1| per op at the shapes outside ``train`` ((batch, context) pairs)."""
    cm = model_for(model, copy_gbps, layers, gpu, lines=lines)
    shape_of = lambda e: (e.spec.batch_size, e.spec.context_len)  # noqa: E731
    for e in exps:
        if shape_of(e) in train:
            cm.observe(e.plan, e.spec, e.measurement)
    errs: dict[str, list[float]] = {}
    for e in exps:
        if shape_of(e) not in train:
            pred = cm.predict(e.plan, e.spec).per_op_ms
            for op, ms in e.measurement.per_op_ms.items():
                if op in pred and ms > 0:
                    errs.setdefault(op, []).append(abs(pred[op] / ms - 1))
    return errs


def summary(errs: dict) -> dict:
    every = sorted(x for v in errs.values() for x in v)
    return {"n": len(every), "median": statistics.median(every), "p90": every[int(0.9 * (len(every) - 1))],
            "per_op_median": {op: round(statistics.median(v), 3) for op, v in sorted(errs.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ledger", type=Path)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2, help="layers the fast tier loaded")
    ap.add_argument("--copy-gbps", type=float, default=4037.0, help="the run's copy bandwidth (its report)")
    ap.add_argument("--gpu", default="H200", choices=sorted(GPU_SPECS), help="the GPU the run had (its report's title)")
    args = ap.parse_args(argv)
    if not args.ledger.is_file():  # Ledger() would create an empty one
        print(f"{args.ledger}: no such ledger", file=sys.stderr)
        return 2
    exps = timed_ops(args.ledger)
    shapes = sorted({(e.spec.batch_size, e.spec.context_len) for e in exps})
    if len(shapes) < 2:
        print(f"{args.ledger}: per-op timings at {len(shapes)} shape(s): nothing to hold out", file=sys.stderr)
        return 1
    splits = {f"hold out {s}": set(shapes) - {s} for s in shapes}
    contexts = sorted({c for _, c in shapes})
    if len(contexts) > 1:  # learn at the shortest context, predict the longer ones
        splits[f"context {contexts[0]} -> longer"] = {s for s in shapes if s[1] == contexts[0]}
    out = {"ledger": str(args.ledger), "shapes": shapes, "experiments": len(exps), "splits": {}}
    for name, train in splits.items():
        row = {kind: summary(held_out_errors(exps, train, args.model, args.copy_gbps, args.layers, kind == "lines",
                                                 args.gpu))
               for kind in ("lines", "factors")}
        out["splits"][name] = row
        print(f"{name:28s} lines: median {row['lines']['median']:.3f} p90 {row['lines']['p90']:.3f}   "
              f"factors: median {row['factors']['median']:.3f} p90 {row['factors']['p90']:.3f}   "
              f"(n={row['lines']['n']}; decode attention {row['lines']['per_op_median'].get('attention_decode')} "
              f"vs {row['factors']['per_op_median'].get('attention_decode')})", file=sys.stderr)
    out["online"] = {}
    steps = decode_experiments(args.ledger)
    for name, flags in ONLINE_MODELS.items():
        errs = online_errors(steps, args.model, args.copy_gbps, args.layers, args.gpu, **flags)
        row = {k: {"n": len(v), "median": statistics.median(v) if v else None} for k, v in errs.items()}
        every = errs["fused"] + errs["unfused"]
        row["all"] = {"n": len(every), "median": statistics.median(every) if every else None}
        out["online"][name] = row
        print(f"online, {name:34s} " + "   ".join(
            f"{k} {v['median']:.3f} (n={v['n']})" for k, v in row.items() if v["median"] is not None), file=sys.stderr)
    out["whole_model"] = whole_model_errors(args.ledger, steps, args.model, args.copy_gbps, args.layers, args.gpu)
    for degree, by_model in out["whole_model"].items():
        for name, r in by_model.items():
            print(f"whole model, {degree}, {name:34s} predicted {r['predicted_ms']:.3f} ms, measured "
                  f"{r['measured_ms']:.3f}: {r['error']:+.3f}", file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
