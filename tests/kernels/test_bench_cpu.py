"""bench/kernel_sweep.py runs its CPU-side logic (cases, sweeps, checks, JSON) under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_kernels_tiny_cpu(tmp_path):
    out = tmp_path / "k.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernel_sweep.py"), "--device", "cpu", "--tiny",
         "--only", "attention_decode,lm_head_argmax,rmsnorm", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    ops = {rec["op"] for rec in data["results"]}
    assert ops == {"attention_decode", "lm_head_argmax", "rmsnorm"}
    for rec in data["results"]:
        assert "median_ms" in rec["impls"]["reference"], rec
        assert rec["best"]["params"] is not None
        for entry in rec["sweep"]:
            assert "error" not in entry, entry
            assert entry[rec["err_metric"]] <= (0.0 if rec["op"] == "lm_head_argmax" else 0.1), entry


@pytest.mark.parametrize("script, says", [
    ("attention_layout.py", "NHD vs HND, same values: max |diff| 0"),
    ("attention_stages.py", "depths of one (split, block_n) against each other, same inputs: max |diff| 0"),
    ("attention_floor.py", "every rung sums the tokens the engine kernel's splits read"),
    ("blas_backend.py", "every setting computes F.linear"),
    ("prefill_attention.py", "kernel, SDPA and reference on one shape: max |diff|"),
    ("persistent_chain.py", "every variant computes the reference chain"),
    ("pdl_batch.py", "every variant computes the fp32 chain"),
    ("attention_oproj.py", "the fused kernel computes attention then o_proj"),
    ("layer_sweep.py", "each engine ran the layers asked, and its profile names every projection"),
    ("fp8_gemv.py", "the fp8 and bf12 GEMVs compute their references"),
])
def test_gpu_probes_check_their_premise_on_the_cpu(script, says):
    """The device probes' CPU mode: the two cache layouts give the same attention, so do the
    pipeline depths of one split and tile size, every BLAS
    setting computes the same linear, and the paged prefill kernel, SDPA with a bottom-right causal
    mask and the reference agree (so on the GPU only their timings differ)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert says in r.stderr
