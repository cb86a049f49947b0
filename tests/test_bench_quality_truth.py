"""bench/quality_truth.py: each plan's logits against the fp32 truth on the same weights, beside
verification's distance from the reference plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_reference_plan_sits_at_bf16_rounding_from_the_truth_and_an_equal_plan_beside_it(tmp_path):
    overlap = tmp_path / "overlap.json"
    overlap.write_text(json.dumps({"name": "overlap", "scheduler": {"overlap": True}}))
    script = Path(__file__).parent.parent / "bench" / "quality_truth.py"
    subprocess.run([sys.executable, str(script), "--model", "random:tiny", "--plans", f"reference,{overlap}",
                    "--num-prompts", "3", "--steps", "6", "--max-prompt-len", "40", "--device", "cpu",
                    "--name", "q", "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    result = json.loads(next(tmp_path.glob("q-*.json")).read_text())
    ref, ov = result["results"]["reference"], result["results"]["overlap"]
    # bf16 rounding shows against fp32 on the same weights, well inside the tolerance
    assert 0 < ref["vs_truth"]["max_rel_err"] < result["tolerance"] / 2
    assert ref["vs_reference"]["max_rel_err"] == 0 and ref["vs_reference"]["bit_identical"]
    # a scheduler knob computes the same logits: the same distance from the truth
    assert ov["vs_truth"]["max_rel_err"] == ref["vs_truth"]["max_rel_err"]
    assert ov["vs_truth"]["decisive_positions"] > 0 and ov["vs_truth"]["argmax_agreement"] == 1.0
    # verification's quality check, judged against the same truth
    assert ref["quality"]["passed"] and ov["quality"]["passed"]
    assert ov["quality"]["truth_rel_err"] == ref["vs_truth"]["max_rel_err"]


def test_fp8_weights_sit_several_times_further_from_the_truth(tmp_path):
    """--fp8-weights rounds the layers' projections to float8_e4m3 after the truth was taken: the
    plan's distance from the served weights' truth grows several-fold (whether the gate refuses it
    depends on the model: on the tiny one it lands near the dtype's floor of 0.05)."""
    script = Path(__file__).parent.parent / "bench" / "quality_truth.py"
    subprocess.run([sys.executable, str(script), "--model", "random:tiny", "--plans", "reference", "--dtype",
                    "bfloat16", "--fp8-weights", "--num-prompts", "3", "--steps", "6", "--max-prompt-len", "40",
                    "--device", "cpu", "--name", "q", "--out", str(tmp_path)], check=True, capture_output=True,
                   timeout=300)
    result = json.loads(next(tmp_path.glob("q-*.json")).read_text())
    ref, fp8 = result["results"]["reference"], result["results"]["reference+fp8-weights"]
    assert not ref["fp8_weights"] and fp8["fp8_weights"] and result["fp8_weights"]
    assert fp8["vs_truth"]["max_rel_err"] > 4 * ref["vs_truth"]["max_rel_err"]
    assert fp8["quality"]["truth_rel_err"] == fp8["vs_truth"]["max_rel_err"]
    assert fp8["quality"]["reference_truth_rel_err"] == ref["vs_truth"]["max_rel_err"]
