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
    # the prediction beside it (whether degree 2 reads slower depends on this machine's CPU timings, as
    # fitted: the collectives' part is checked in test_agents_cost_model.py)
    assert rows[2]["predicted_ms"] > 0
    assert rows[2]["predicted_ratio"] == round(rows[2]["predicted_ms"] / rows[1]["predicted_ms"], 4)
    assert rows[2]["ratio_error"] == round(rows[2]["predicted_ratio"] - rows[2]["measured_ratio"], 4)
    assert "do not split 3 ways" in rows[3]["error"] and "measured_ms" not in rows[3]
    assert not (out / "tp3").exists()  # refused from the tiers' config, no engine started for it
    served = load_plan((out / "tp2" / "plan.json").read_text())
    assert served.parallelism.tensor_parallel == 2 and served.hash == rows[2]["plan_hash"]
    report = (out / "report.md").read_text()
    assert "### Tensor-parallel degrees, measured" in report
    assert "| not run: tensor_parallel=3: num_attention_heads=4" in report


def test_a_split_plan_leaves_out_the_fusions_that_add_the_residual_inside_o_and_down():
    plan = Plan.model_validate({"fusions": {"folded_norm": True, "lm_head_argmax": True}})
    split = at_degree(plan, 2)
    assert split.parallelism.tensor_parallel == 2 and set(split.fusions) == {"lm_head_argmax"}


def test_auto_measures_only_when_another_degree_is_recommended():
    assert degrees_to_measure(None, 1) == [] and degrees_to_measure(None, None) == []
    assert degrees_to_measure(None, 4) == [1, 4]
    assert degrees_to_measure([2, 1, 2], 1) == [1, 2] and degrees_to_measure([], 4) == []


def test_a_compile_at_degree_two_searches_and_verifies_split_plans(tmp_path):
    """A baseline at tensor_parallel 2 starts both tiers split (gloo on the CPU); the candidates keep
    the degree, the winner is verified at it, and a seed plan of degree 1 runs at the tiers' degree."""
    (tmp_path / "tp2.json").write_text('{"parallelism": {"tensor_parallel": 2}}')
    (tmp_path / "seed.json").write_text('{"scheduler": {"max_num_seqs": 8}}')
    out = tmp_path / "out"
    args = ["--model", "random:tiny", "--traffic", "chat", "--budget", "15", "--out", str(out), "--quiet",
            "--baseline-plan", str(tmp_path / "tp2.json"), "--seed-plans", str(tmp_path / "seed.json"),
            "--measure-tp", "off"]
    assert run_compile(add_compile_args(argparse.ArgumentParser()).parse_args(args)) == 0
    compiled = json.loads((out / "plan.json").read_text())
    assert compiled["plan"]["parallelism"]["tensor_parallel"] == 2 and compiled["verification"]["passed"]
    with sqlite3.connect(out / "ledger.sqlite") as db:
        plans = [json.loads(p) for (p,) in db.execute("SELECT plan_json FROM experiments")]
    assert plans and all(p["parallelism"]["tensor_parallel"] == 2 for p in plans)
    report = (out / "report.md").read_text()
    assert "the search ran at degree 2" in report and "Tensor-parallel degrees, measured" not in report
