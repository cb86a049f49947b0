"""bench/op_trials.py on the CPU: one engine on one layer, a tuned op tried B T B at each batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from anneal.engine.plan import OpChoice, Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import op_trials  # noqa: E402


def test_the_probe_tries_each_op_the_tuned_plan_changes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the engine subprocess runs the Triton norm on the CPU
    base, tuned = tmp_path / "base.json", tmp_path / "tuned.json"
    base.write_text(Plan().model_dump_json())
    tuned.write_text(Plan().with_ops(rmsnorm=OpChoice(impl="triton")).model_dump_json())
    rc = op_trials.main(["--model", "random:tiny", "--device", "cpu", "--layers", "1", "--base", str(base),
                         "--tuned", str(tuned), "--repeats", "1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ops"] == ["rmsnorm"] and len(out["kept"]) == 1
    # B T B at three batches and on a prompt step, the B before shared; a near-tie twice
    assert out["trials"] in (2 * 4 + 4, 2 * 2 * 4 + 4)
    same = tmp_path / "same.json"
    same.write_text(Plan().model_dump_json())
    assert op_trials.main(["--device", "cpu", "--base", str(base), "--tuned", str(same)]) == 1
