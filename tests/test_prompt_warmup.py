"""The prompt-step warm-up: which eager steps it runs, that they touch nothing the engine serves
with, and who runs them (engine/prompt_warmup.py, ModelRunner.ahead_passes / capture).

Whether the warm-up leaves nothing to compile for a real prompt step is a GPU question:
tests/test_engine_gpu.py::test_a_prompt_step_after_an_apply_compiles_no_kernel."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.llm import Engine, EngineArgs
from anneal.engine.prompt_warmup import ROW_LADDER, prompt_step_layouts


def _classes(n: int) -> tuple:
    """What Triton specializes an integer argument on, and a fused GEMV's row tile (16 .. 128)."""
    return (n == 1, n % 16 == 0, min(128, max(16, 1 << (n - 1).bit_length())))


def test_the_ladder_has_every_row_class_up_to_its_top():
    seen = {_classes(m) for m in ROW_LADDER}
    assert seen >= {_classes(m) for m in range(1, max(ROW_LADDER) + 1)}


def test_layouts_cover_prompts_mixed_rows_and_block_table_widths():
    layouts = prompt_step_layouts(max_len=4096, max_seqs=64, largest_graph=32)
    prompts = [lay.rows[0][0] for lay in layouts if len(lay.rows) == 1 and not lay.decode_only]
    assert prompts == list(ROW_LADDER)
    mixed = [len(lay.rows) for lay in layouts if len(lay.rows) > 1 and not lay.decode_only]
    assert mixed == [m for m in ROW_LADDER if 1 < m <= 64]  # one-token rows: never more than max_num_seqs
    eager_decode = [len(lay.rows) for lay in layouts if lay.decode_only]
    assert eager_decode == list(range(33, 65))  # every batch no graph holds (the split count follows it)
    widths = {max(-(-ctx // 16) for _, ctx in lay.rows) for lay in layouts}
    assert {w == 1 for w in widths} == {True, False} and any(w % 16 == 0 for w in widths)
    for lay in layouts:
        assert all(0 < n <= ctx for n, ctx in lay.rows)


def test_layouts_stay_inside_the_engine_and_the_plan():
    layouts = prompt_step_layouts(max_len=40, max_seqs=4, largest_graph=0)
    assert max(ctx for lay in layouts for _, ctx in lay.rows) <= 40
    assert max(len(lay.rows) for lay in layouts) <= 4
    assert [len(lay.rows) for lay in layouts if lay.decode_only] == [1, 2, 3, 4]  # no graphs: every decode step is eager


@pytest.mark.parametrize("flags, warms", [([], True), (["--layers", "1"], False),
                                          (["--no-warm-prompt-steps"], False), (["--layers", "1", "--warm-prompt-steps"], True)])
def test_serving_engines_warm_prompt_steps_and_fast_tiers_do_not(flags, warms):
    """`anneal serve`: on for the whole model, off for a --layers tier, either way when asked."""
    import argparse

    from anneal.engine.server import add_serve_args, build_engine

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--model", "random:tiny", "--device", "cpu", "--max-model-len", "64", "--num-kv-blocks", "16", *flags])
    assert build_engine(args).runner.warm_prompt_steps is warms


def test_the_prompt_passes_run_every_layout_and_leave_the_engine_kv_cache_alone():
    """On the CPU (reference ops, which really store K/V): every layout runs through the two-layer
    view, and the engine's cache is bit-identical afterwards."""
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=300, num_kv_blocks=64))
    before = eng.runner.kv.clone()
    max_seqs = eng.plan.scheduler.max_num_seqs
    passes = eng.runner.ahead_passes(eng.runner.ops, [1, 2], max_seqs)
    assert len(passes) == 2 + len(prompt_step_layouts(300, max_seqs, 2))
    for p in passes:
        p()
    assert torch.equal(eng.runner.kv, before)
    eng.runner.warm_prompt_steps = False
    assert len(eng.runner.ahead_passes(eng.runner.ops, [1, 2], max_seqs)) == 2  # decode passes only
