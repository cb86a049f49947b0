"""bench/profile_step.py --mixed: one eager step of a prefill chunk with decode rows riding along,
run through the engine's runner (on the CPU: the step and its bookkeeping; kernels are the GPU's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_step as bench  # noqa: E402

from anneal.engine.llm import Engine, EngineArgs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_mixed_step_runs_and_gives_its_blocks_back():
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=256, num_kv_blocks=128))
    free = eng.blocks.num_free_blocks
    r = bench.profile_mixed(eng, bs=3, context=40, prompt=70, reps=2)
    assert r["prompt_tokens"] == 70 and r["decode_rows"] == 3 and r["wall_us_median"] > 0
    assert eng.blocks.num_free_blocks == free  # nothing left allocated for the next plan
