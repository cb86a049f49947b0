#!/usr/bin/env python
"""The decode step at several layer counts: what a step costs once, whatever its layers (issue 5).

The compile times candidates on a fast tier that loads 2 of the model's layers, and its cost model
projects the whole model from that: the once-a-step ops (embedding, lm_head) as timed, the layers'
part times 16 for the 8B. Session 35 found that projection 6-12% slow against the whole model
measured (``bench/cost_model_replay.py``, ``whole_model``), and guessed why: a per-step constant
(the graph's launch, the first kernel's ramp, whatever the per-op timings do not see) is folded into
the layers' factor on 2 layers and so counted 16 times. A guess until the step is measured at more
than one layer count, which is what this does: one engine per layer count ``k`` (``--layers k``, as
the fast tier loads them), each plan's graphed decode step (``engine/benchmark.py``, the fast tier's
own benchmark, per-op timings included) at each batch and context.

Per (plan, batch, context) it fits ``step = once + per_layer x k`` over the layer counts: ``once``
is the part a step runs once, to be set beside its timed once-a-step ops (``once_a_step_ms``); then
it feeds the k = 2 engine's timings to a fresh ``CostModel`` exactly as the compile does and
predicts the whole model's step (``whole_model``), beside the step measured there.

Run: ``python bench/layer_sweep.py --out DIR`` on a GPU (``bench/h200.sh layer-sweep``);
``--device cpu`` checks the premise only (each engine runs the layers asked, the profile names
every per-layer op), on the tiny model with the reference plan.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, premise_holds, probe_parser, write_probe  # noqa: E402

from anneal.agents.cost_model import PER_LAYER_OPS, CostModel, hardware_from_state, once_a_step_ms, shape_from_config  # noqa: E402
from anneal.agents.types import BenchSpec, EngineState, HardwareInfo, Measurement  # noqa: E402
from anneal.engine.benchmark import BenchmarkRequest, run_benchmark  # noqa: E402
from anneal.engine.llm import Engine, EngineArgs  # noqa: E402
from anneal.engine.plan import Plan, load_plan  # noqa: E402
from anneal.engine.presets import PRESETS  # noqa: E402

PLANS = "bench/plans/triton.json,bench/plans/triton-overlap-token-graphs-folded-ropeattn.json"


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def measure(engine: Engine, plan: Plan, batch: int, context: int, steps: int) -> dict:
    """The fast tier's decode benchmark of ``plan`` at one shape, per-op timings included."""
    r = run_benchmark(engine, BenchmarkRequest(plan=plan, mode="decode", batch_size=batch, context_len=context,
                                               steps=steps, warmup=5, per_op=True))
    return {"median_ms": r.median_ms, "p10_ms": r.p10_ms, "p90_ms": r.p90_ms, "per_op_ms": r.per_op_ms,
            "graph": r.extra.get("graph")}


def sweep(args, plans: dict[str, Plan], device: str) -> tuple[list[dict], dict[int, int]]:
    """One engine per layer count, every plan and shape on it; rows as measured, and the layers each
    engine actually ran (the premise)."""
    model = f"random:{args.shape}"
    shapes = [(b, c) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    max_len = max(c for _, c in shapes) + 64
    blocks = max(b for b, _ in shapes) * args.rotate_blocks * (-(-max_len // 16)) + 32
    rows, ran = [], {}
    full = PRESETS[args.shape]["num_hidden_layers"]
    for k in map(int, args.layers.split(",")):
        engine = Engine(EngineArgs(model=model, device=device, dtype=args.dtype, layers=None if k >= full else k,
                                   max_model_len=max_len, num_kv_blocks=blocks, plan=Plan()))
        ran[k] = engine.num_layers
        for name, plan in plans.items():
            for batch, context in shapes:
                try:
                    row = measure(engine, plan, batch, context, args.steps)
                except Exception as e:  # noqa: BLE001 - a plan that fails is a result
                    row = {"error": f"{type(e).__name__}: {e}"}
                rows.append({"layers": k, "plan": name, "batch": batch, "context": context, **row})
                print(f"{args.shape} k={k:>2} {name:<48} b={batch:<3} c={context:<5} "
                      + (f"{row['median_ms']:.4f} ms" if "median_ms" in row else row["error"]), flush=True)
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, ran


def analyse(args, rows: list[dict], plans: dict[str, Plan], copy_gbps: float | None, gpu: str,
            step_constant: bool = True) -> list[dict]:
    """Per (plan, batch, context): the line over layer counts, the once-a-step ops as timed at each
    count, and the compile's projection from its fast tier (k = ``--fast-layers``) to the whole model
    by a cost model that counts a graphed step's constant once (``step_constant``) or not."""
    cfg = dict(PRESETS[args.shape])
    full = cfg["num_hidden_layers"]
    ok = [r for r in rows if "median_ms" in r]
    state = EngineState(model=f"random:{args.shape}", dtype=args.dtype, gpu_name=gpu,
                        device="cpu" if gpu == "cpu" else "cuda", config=cfg, num_layers_total=full,
                        num_layers_loaded=args.fast_layers, hardware=HardwareInfo(copy_gbps=copy_gbps))
    cm = CostModel(shape=shape_from_config(cfg), hw=hardware_from_state(state), layers=args.fast_layers,
                   step_constant=step_constant)
    spec_of = lambda r: BenchSpec(mode="decode", batch_size=r["batch"], context_len=r["context"])  # noqa: E731
    for r in ok:
        if r["layers"] == args.fast_layers:
            cm.observe(plans[r["plan"]], spec_of(r), Measurement(median_ms=r["median_ms"], per_op_ms=r["per_op_ms"]))
    whole = cm.whole_model()
    out = []
    for key in sorted({(r["plan"], r["batch"], r["context"]) for r in ok}):
        mine = sorted((r for r in ok if (r["plan"], r["batch"], r["context"]) == key), key=lambda r: r["layers"])
        if len(mine) < 2:
            continue
        ks, steps = [r["layers"] for r in mine], [r["median_ms"] for r in mine]
        once, per_layer = line_fit(ks, steps)
        timed_once = [once_a_step_ms(r["per_op_ms"]) for r in mine if r["per_op_ms"]]
        layer_ops = [sum(ms for op, ms in r["per_op_ms"].items() if op in PER_LAYER_OPS or op.startswith("attention")
                         or op.startswith(("linear_", "rope_", "norm_"))) / r["layers"] for r in mine if r["per_op_ms"]]
        at_full = next((r["median_ms"] for r in mine if r["layers"] >= full), None)
        predicted = whole.predict(plans[key[0]], spec_of(mine[0])).ms
        timed = [t for t in timed_once if t is not None]
        out.append({
            "plan": key[0], "batch": key[1], "context": key[2], "layers": ks, "step_ms": steps,
            "once_ms": once, "per_layer_ms": per_layer,
            "constant_ms": once - statistics.median(timed) if timed else None,
            "residual_max_ms": max(abs(s - (once + per_layer * k)) for k, s in zip(ks, steps)),
            "timed_once_a_step_ms": timed,
            "timed_layer_ops_ms_a_layer": layer_ops,
            "whole_model_measured_ms": at_full, "whole_model_predicted_ms": predicted,
            "whole_model_error": None if at_full is None else predicted / at_full - 1,
        })
        o = out[-1]
        print(f"{key[0]:<48} b={key[1]:<3} c={key[2]:<5} step = {once:.4f} + {per_layer:.4f} k ms "
              f"(residual <= {o['residual_max_ms']:.4f}); once-a-step ops timed "
              f"{statistics.median(timed or [float('nan')]):.4f} ms; whole model "
              f"predicted {predicted:.4f}" + (f" vs {at_full:.4f} measured ({o['whole_model_error']:+.1%})"
                                             if at_full else ""), flush=True)
    return out


def replay(args, path: Path) -> int:
    """A device run's rows fitted again here: the whole model's projection from its fast tier by the
    cost model as it is, with and without the graphed step's constant counted once."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    args.shape, args.dtype = data["shape"], data["dtype"]
    args.fast_layers = data["fast_layers"]
    plans = {name: load_plan((Path("bench/plans") / f"{name}.json").read_text()) for name in {r["plan"] for r in rows}}
    for constant in (False, True):
        print(f"== step constant counted once: {constant} (graph_step_us of {data['gpu']}: "
              f"{hardware_from_state(EngineState(model='', dtype='bfloat16', gpu_name=data['gpu'], device='cuda')).graph_step_us} µs)")
        fits = analyse(args, rows, plans, data.get("copy_gbps"), data["gpu"], step_constant=constant)
        errs = [abs(f["whole_model_error"]) for f in fits if f["whole_model_error"] is not None]
        print(f"   whole-model |error|: median {statistics.median(errs):.1%}, max {max(errs):.1%}" if errs else "")
    return 0


def main() -> int:
    ap = probe_parser(__doc__, reps=0)
    ap.add_argument("--shape", default=None, help="preset (default llama-3.1-8b; tiny on the CPU)")
    ap.add_argument("--layers", default=None, help="layer counts (default 1,2,4,8,16,32; 1,2,4 on the CPU)")
    ap.add_argument("--fast-layers", type=int, default=2, help="the compile's fast tier: whose timings the model fits")
    ap.add_argument("--batches", default=None, help="default 1,16 (1,2 on the CPU)")
    ap.add_argument("--contexts", default=None, help="default 416,1024 (32 on the CPU)")
    ap.add_argument("--plans", default=None, help=f"plan files (default {PLANS}; the reference plan on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps a benchmark (default 50; 3 on the CPU)")
    ap.add_argument("--rotate-blocks", type=int, default=2, help="KV sets the benchmark rotates through")
    ap.add_argument("--replay", default=None, help="a result file of this probe: fit it again on the CPU, "
                    "the whole model projected with and without the step's constant")
    args = ap.parse_args()
    if args.replay:
        return replay(args, Path(args.replay))
    cpu = args.device == "cpu"
    args.shape = args.shape or ("tiny" if cpu else "llama-3.1-8b")
    args.layers = args.layers or ("1,2,4" if cpu else "1,2,4,8,16,32")
    args.batches = args.batches or ("1,2" if cpu else "1,16")
    args.contexts = args.contexts or ("32" if cpu else "416,1024")
    args.steps = args.steps or (3 if cpu else 50)
    args.dtype = "float32" if cpu else "bfloat16"
    if not cpu and not torch.cuda.is_available():
        print("bench/layer_sweep.py needs a CUDA GPU (--device cpu checks the premise only)", file=sys.stderr)
        return 2
    if cpu:
        plans = {"reference": Plan(name="reference")}
    else:
        plans = {Path(p).stem: load_plan(Path(p).read_text()) for p in (args.plans or PLANS).split(",")}
    rows, ran = sweep(args, plans, args.device)
    asked = [int(k) for k in args.layers.split(",")]
    full = PRESETS[args.shape]["num_hidden_layers"]
    per_layer_named = all(
        {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= set(r["per_op_ms"] or {}) for r in rows
        if "per_op_ms" in r and not plans[r["plan"]].fusions)
    ok = premise_holds(
        "each engine ran the layers asked, and its profile names every projection",
        all(ran[k] == min(k, full) for k in asked) and per_layer_named and all("median_ms" in r for r in rows),
        f"layers asked {asked}, run {ran}; errors: {[r['error'] for r in rows if 'error' in r][:3]}")
    if not ok:
        return 1
    bw = None if cpu else copy_bandwidth_gbps()
    fits = analyse(args, rows, plans, bw, "cpu" if cpu else torch.cuda.get_device_name())
    if cpu:
        return 0
    write_probe(f"layer-sweep-{args.shape}", args.out, torch.device("cuda"), reps=args.steps, rows=rows,
                copy_gbps=bw, fits=fits, fast_layers=args.fast_layers, shape=args.shape, dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
