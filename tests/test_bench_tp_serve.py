"""bench/tp_serve.py's premise on the CPU: the engine at degree 2 (gloo, two processes) serves
degree 1's greedy tokens; on a host with 2+ GPUs it then times both side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_degree_two_serves_degree_ones_tokens():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "tp_serve.py"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "degree 2 serves degree 1's greedy tokens: True" in r.stderr
    assert "tp2 " in r.stdout and "equal_tokens=1 " in r.stdout
