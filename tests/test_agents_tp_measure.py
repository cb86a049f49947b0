"""`anneal compile --measure-tp`: the compiled plan served at each tensor-parallel degree by a real
engine of its own (gloo on the CPU), its decode step beside the cost model's prediction in the
report and the ledger; a degree the model does not split is reported, not fatal."""

from __future__ import annotations

import argparse
import json
import sqlite3

from anneal.agents.compile import add_compile_args, run_compile
from anneal.agents.tp_measure import at_degree, degrees_to_measure
from anneal.engine.plan import Plan, load_plan


def test_each_degree_is_served_and_measured_beside_its_prediction(tmp_path):
    out = tmp_path / "out"
    args = ["--model", "random:tiny", "--traffic", "chat", "--budget", "8", "--out", str(out), "--quiet",
            "--measure-tp", "1,2,3"]
    assert run_compile(add_compile_args(argparse.ArgumentParser()).parse_args(args)) == 0
    with sqlite3.connect(out / "ledger.sqlite") as db:
        (raw,) = db.execute("SELECT value FROM meta WHERE name = 'tp_measured'").fetchone()
    rows = {r["degree"]: r for r in json.loads(raw)}
    assert rows[1]["measured_ms"] > 0 and rows[1]["measured_ratio"] == 1.0 and rows[1]["predicted_ms"] > 0
    assert rows[2]["measured_ms"] > 0 and rows[2]["measured_ratio"] > 0
    assert rows[2]["predicted_ms"] is None  # the CPU has no interconnect figures to predict with
    assert "do not split 3 ways" in rows[3]["error"] and "measured_ms" not in rows[3]
    served = load_plan((out / "tp2" / "plan.json").read_text())
    assert served.parallelism.tensor_parallel == 2 and served.hash == rows[2]["plan_hash"]
    report = (out / "report.md").read_text()
    assert "### Tensor-parallel degrees, measured" in report
    assert "| 3 | - | not run: tensor_parallel=3:" in report


def test_a_split_plan_leaves_out_the_fusions_that_add_the_residual_inside_o_and_down():
    plan = Plan.model_validate({"fusions": {"folded_norm": True, "lm_head_argmax": True}})
    split = at_degree(plan, 2)
    assert split.parallelism.tensor_parallel == 2 and set(split.fusions) == {"lm_head_argmax"}


def test_auto_measures_only_when_another_degree_is_recommended():
    assert degrees_to_measure(None, 1) == [] and degrees_to_measure(None, None) == []
    assert degrees_to_measure(None, 4) == [1, 4]
    assert degrees_to_measure([2, 1, 2], 1) == [1, 2] and degrees_to_measure([], 4) == []
