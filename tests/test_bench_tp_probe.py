"""bench/tp_probe.py's premise on the CPU (gloo, two processes): the engine's decoder on each rank's
shard of the weights (engine/tensor_parallel.py: all-reduces after o_proj and down_proj, the
logits gathered) computes the whole model's decode step. On a 2-GPU host it then times both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_ranks_compute_the_whole_step():
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(ROOT / "bench" / "tp_probe.py"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "degree 2 computes degree 1's step: tokens equal True" in r.stderr
    assert "every rank True" in r.stderr
