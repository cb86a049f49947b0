"""bench/ on sys.path (the bench scripts and several tests put it first) shadows nothing that our
dependencies import. Session 28: a fresh machine's transformers (5.25) imports Hugging Face's
optional ``kernels`` package when it finds one, found ``bench/kernels.py`` instead, and every later
test building a transformers model in the same pytest process failed with an ImportError."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

_BUILD_HF_MODEL = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, transformers
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
model = transformers.LlamaForCausalLM(cfg)
model(torch.zeros(1, 4, dtype=torch.long))
"""


def test_a_transformers_model_runs_with_bench_first_on_the_path():
    r = subprocess.run([sys.executable, "-c", _BUILD_HF_MODEL, str(BENCH)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_no_bench_module_is_named_like_an_importable_module():
    """A bench script named like the standard library or an installed package would shadow it."""
    specs = {p.stem: importlib.util.find_spec(p.stem) for p in BENCH.glob("*.py")}
    taken = [name for name, spec in specs.items() if spec is not None and not str(spec.origin).startswith(str(BENCH))]
    assert not taken, f"bench modules shadowing importable modules: {taken}"
