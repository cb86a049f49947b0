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
    own = [h["own_us_per_step"] for h in r["host_functions"]]
    assert own and own == sorted(own, reverse=True)  # the step's host functions, costliest first


def test_the_host_profile_counts_calls_per_step():
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=256, num_kv_blocks=128))
    items = bench.decode_items(eng, 2, 30, seed=1)
    rows = bench.host_profile(lambda: eng.runner.run(items, decode_only=True), reps=3, top=10_000)
    fwd = [h for h in rows if h["function"].startswith("transformer.py") and h["function"].endswith("(forward)")]
    assert len(fwd) == 1 and fwd[0]["calls_per_step"] == 1.0  # one forward pass a step, over 3 steps
    assert fwd[0]["cum_us_per_step"] >= fwd[0]["own_us_per_step"] > 0
    for s, _ in items:
        eng.blocks.free(s)


def test_the_kernel_table_sums_each_kernel_per_step():
    steps = [[("a", 0.0, 2.0), ("b", 2.0, 1.0), ("a", 3.0, 4.0)], [("a", 0.0, 2.0), ("b", 2.0, 3.0), ("a", 3.0, 4.0)]]
    table = bench.kernel_table(steps)
    assert [r["kernel"] for r in table] == ["a", "b"]
    assert table[0] == {"kernel": "a", "calls_per_step": 2.0, "mean_us": 3.0, "total_us_per_step": 6.0,
                        "advance_us_per_step": 5.0}  # (2 + 4) and (2 + 2: its end passes b's by 2)
    assert table[1] == {"kernel": "b", "calls_per_step": 1.0, "mean_us": 2.0, "total_us_per_step": 2.0,
                        "advance_us_per_step": 2.0}


def test_advances_charge_an_early_launched_kernel_only_for_what_it_adds_to_the_span():
    # b starts (dependent launch) while a runs and waits for it: 9 µs long, but it ends 1 µs after a.
    step = [("a", 0.0, 10.0), ("b", 2.0, 9.0), ("c", 5.0, 3.0), ("d", 11.0, 2.0)]
    assert bench.advances(step) == [10.0, 1.0, 0.0, 2.0]
    assert sum(bench.advances(step)) == 13.0  # the span
