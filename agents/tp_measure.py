"""The tensor-parallel choice, measured: the compiled plan served whole at each degree, its decode step
beside the cost model's prediction (issue 5: "its predictions are logged beside the measurements").

Why a fresh engine per degree: the degree is fixed when an engine starts (its weights and KV cache
are split then), so the tiers, which run degree 1, cannot measure another. Each degree's engine is
a local `anneal serve` of every layer with the plan at that degree, started after the tiers have
stopped (on a GPU they hold its memory), measured on the compile's decode spec, and stopped. The
plan is measured without the fusions that a split model refuses (they add the residual inside
o/down, before its all-reduce), as the cost model predicts it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from anneal.agents.engine_client import EngineError
from anneal.agents.local_engines import LocalEngines
from anneal.agents.types import BenchSpec
from anneal.agents.space import normalized
from anneal.engine.config import ModelConfig
from anneal.engine.plan import Plan


def at_degree(plan: Plan, degree: int) -> Plan:
    """``plan`` split ``degree`` ways: its fusions a split model refuses left out (``normalized``
    drops what ``plan.fusion_blockers`` names)."""
    return normalized(plan.with_tensor_parallel(degree))


def degrees_to_measure(asked: list[int] | None, recommended: int | None) -> list[int]:
    """``asked`` (``--measure-tp``), else degree 1 and the recommended one when it is not 1."""
    if asked is not None:
        return sorted(set(asked))
    return [1, recommended] if recommended and recommended > 1 else []


def measure_degrees(model: str, device: str, out: Path, plan: Plan, spec: BenchSpec,
                    predict: Callable[[Plan, int], float], degrees: list[int],
                    say: Callable[[str], None] = lambda _m: None,
                    config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per degree: the predicted and measured decode-step ms (or why it could not run),
    and both as ratios to degree 1's when it was measured. ``config`` (the served model's, as the
    tiers report it): a degree the model does not split is reported without starting an engine."""
    cfg = _model_config(config)
    rows = []
    for d in degrees:
        p = at_degree(plan, d)
        refused = cfg.split_error(d) if cfg is not None else None
        if refused:
            say(f"tensor-parallel degree {d} not measured: {refused}")
            rows.append({"degree": d, "plan_hash": p.hash, "predicted_ms": None, "error": refused})
            continue
        predicted = predict(p, d)  # inf where the hardware has no link figures (a GPU without a data sheet)
        row: dict[str, Any] = {"degree": d, "plan_hash": p.hash,
                               "predicted_ms": round(predicted, 4) if math.isfinite(predicted) else None}
        folder = out / f"tp{d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(p.model_dump_json(indent=2))
        say(f"measuring the plan at tensor-parallel degree {d} (a whole-model engine of its own) ...")
        engines = LocalEngines(model, folder, fast_layers=None, device=device, plan=str(folder / "plan.json"))
        try:
            client = engines.start()["slow"]
            try:
                m = client.benchmark(None, spec)
            finally:
                client.close()
            row.update(measured_ms=round(m.median_ms, 4), spread=round(m.spread, 4))
        except EngineError as e:  # a degree this host cannot run (too few GPUs, a model that does not split)
            lines = str(e).splitlines()
            row["error"] = next((ln.split("cannot start: ", 1)[1] for ln in lines if "cannot start: " in ln),
                                lines[0])[:300]
        finally:
            engines.stop()
        rows.append(row)
    base = next((r for r in rows if r["degree"] == 1 and "measured_ms" in r), None)
    for r in rows:
        if base is not None and "measured_ms" in r:
            r["measured_ratio"] = round(r["measured_ms"] / base["measured_ms"], 4)
            if r["predicted_ms"] is not None and base["predicted_ms"]:
                r["predicted_ratio"] = round(r["predicted_ms"] / base["predicted_ms"], 4)
                r["ratio_error"] = round(r["predicted_ratio"] - r["measured_ratio"], 4)
    return rows


def _model_config(config: dict[str, Any] | None) -> ModelConfig | None:
    """The tiers' reported config as a ModelConfig; None when absent or of another shape (the engine
    then says why a degree cannot start, as before)."""
    try:
        return ModelConfig.model_validate(config) if config else None
    except ValueError:
        return None
