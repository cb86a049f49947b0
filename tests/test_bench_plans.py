"""The hand-set plans in bench/plans/ are what GPU calls load: each must validate and resolve
against the op registry for the GPU here, on the CPU, so a bad parameter costs no device time
(session 8 lost a device call's measurements to ``max_m=16`` before 16 was an option)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from anneal.engine.op_table import OpTable
from anneal.engine.plan import Plan

PLANS = sorted((Path(__file__).parent.parent / "bench" / "plans").glob("*.json"))


def test_there_are_hand_set_plans():
    assert len(PLANS) >= 5


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_hand_set_plan_resolves_for_the_gpu(path):
    plan = Plan.model_validate(json.loads(path.read_text()))
    choices = OpTable.resolve(plan, "cuda")
    assert set(plan.ops) <= set(choices)


def test_the_cuda_default_plan_is_the_measured_hand_set_plan():
    """What `anneal serve` and the operator serve on CUDA when no plan is named is
    bench/plans/triton-overlap.json, so its measured figures (bench/plans/README.md) apply to it; off
    CUDA the default is the reference plan (the Triton variants need CUDA)."""
    from anneal.engine.plan import default_plan, load_plan

    measured = load_plan((Path(__file__).parent.parent / "bench" / "plans" / "triton-overlap.json").read_text())
    for device in ("cuda", "cuda:1"):
        assert default_plan(device).hash == measured.hash
    OpTable.resolve(default_plan("cuda"), "cuda")
    assert default_plan("cpu").hash == Plan().hash


def test_serve_and_generate_without_a_plan_take_the_devices_default():
    import argparse

    from anneal.engine.plan import default_plan
    from anneal.engine.server import _plan_from_args

    args = argparse.Namespace(plan=None, max_num_seqs=None, max_num_batched_tokens=None)
    assert _plan_from_args(args, "cuda").hash == default_plan("cuda").hash
    assert _plan_from_args(args, "cpu").hash == Plan().hash
    args.max_num_seqs = 12  # the knob flags apply to the default too
    assert _plan_from_args(args, "cuda").scheduler.max_num_seqs == 12
    assert _plan_from_args(args, "cuda").scheduler.overlap


def test_one_change_variants_of_the_best_plans_resolve(tmp_path):
    """``bench/h200.sh variants`` sweeps these on the GPU: a bad change would cost its whole stage."""
    script = Path(__file__).parent.parent / "bench" / "plan_variants.py"
    for base in ("gemv-pdl-rope-gu-prefetch-downdot-o8", "gemv-pdl-rope-gu-prefetch-down2"):
        out = tmp_path / base
        subprocess.run([sys.executable, str(script), str(script.parent / "plans" / f"{base}.json"), "--out", str(out)],
                       check=True, capture_output=True)
        variants = sorted(out.glob("*.json"))
        assert len(variants) >= 30
        for path in variants:
            plan = Plan.model_validate(json.loads(path.read_text()))
            OpTable.resolve(plan, "cuda")
        assert any(Plan.model_validate(json.loads(p.read_text())).fusions.get("silu_mul_down") for p in variants)


def test_fused_tile_variants_put_each_fused_projection_on_the_gemv_with_one_change(tmp_path):
    """``bench/h200.sh fused-tiles``: the compiled chat plan's fused GEMVs run at their projections'
    params; every variant must resolve, change one projection only, and the sweep needs its control."""
    script = Path(__file__).parent.parent / "bench" / "plan_variants.py"
    base_path = script.parent / "plans" / "chat-s23-compiled.json"
    base = Plan.model_validate(json.loads(base_path.read_text()))
    out = subprocess.run([sys.executable, str(script), str(base_path), "--fused-tiles", "--out", str(tmp_path)],
                         check=True, capture_output=True, text=True).stdout.strip().split(",")
    assert len(out) == 4 * 15  # norm_stats runs all four projections: a control + 14 changes each
    controls = 0
    for path in out:
        plan = Plan.model_validate(json.loads(Path(path).read_text()))
        OpTable.resolve(plan, "cuda")
        changed = [op for op in plan.ops if plan.choice(op) != base.choice(op)]
        assert len(changed) == 1 and plan.choice(changed[0]).impl == "triton_gemv_splitk", (path, changed)
        assert plan.fusions == base.fusions and plan.scheduler == base.scheduler
        params = plan.choice(changed[0]).params
        assert params["max_m"] == 64 and len(params) <= 2
        controls += params == {"max_m": 64}
    assert controls == 4
    refused = subprocess.run([sys.executable, str(script), str(script.parent / "plans" / "triton.json"), "--fused-tiles",
                              "--out", str(tmp_path / "none")], capture_output=True, text=True)
    assert refused.returncode != 0 and "no GEMV fusion" in refused.stderr


@pytest.mark.parametrize("engine", ["in-process", "served"])
def test_bench_plans_replays_side_by_side_in_process_and_over_the_admin_api(tmp_path, engine):
    """Both places a replay can run (the served one is where `anneal compile` measures) give a
    result for every plan, paired against the first, and with --verify the verification suite's
    report for every plan but the reference. A plan the engine cannot apply (here: two tensor-parallel
    ranks on a one-rank engine) is left out with its reason, and the others are measured."""
    overlap = tmp_path / "overlap.json"
    overlap.write_text(json.dumps({"name": "overlap", "scheduler": {"overlap": True}}))
    tp2 = tmp_path / "tp2.json"
    tp2.write_text(json.dumps({"name": "tp2", "parallelism": {"tensor_parallel": 2}}))
    script = Path(__file__).parent.parent / "bench" / "plans.py"
    subprocess.run([sys.executable, str(script), "--model", "random:tiny", "--plans", f"reference,{overlap},{tp2}",
                    "--traffic", "chat", "--rounds", "1", "--engine", engine, "--name", "t", "--out", str(tmp_path),
                    "--verify"],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(next(tmp_path.glob("t-*.json")).read_text())
    assert result["engine"] == engine
    chat = result["results"]["chat"]
    assert set(chat) == {"reference", "overlap"}
    assert chat["overlap"]["x_vs_reference"] > 0 and chat["overlap"]["rounds"][0]["time_split"]["decode_steps"] > 0
    assert set(result["verification"]) == {"overlap", "tp2"}
    assert result["verification"]["tp2"]["passed"] is False and "tensor" in result["verification"]["tp2"]["error"]
    assert set(result["failed"]) == {"tp2"} and "tensor" in result["failed"]["tp2"]
    report = result["verification"]["overlap"]
    assert report["passed"] and chat["overlap"]["verified"] is True
    assert {c["name"] for c in report["checks"]} >= {"quality", "kv_contamination", "determinism"}
