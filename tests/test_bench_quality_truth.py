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
