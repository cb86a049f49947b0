"""Every op in the registry has an input generator (agent-written kernels for any op are checked in
isolation on these inputs), and the reference runs on what it generates."""

from __future__ import annotations

import pytest
import torch

from anneal.engine.op_inputs import compare, make_inputs
from anneal.engine.ops.registry import all_ops, get_op
from anneal.engine.presets import preset_config


@pytest.mark.parametrize("op", sorted(all_ops()))
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_every_op_has_inputs_the_reference_takes(op, preset):
    cfg = preset_config(preset)
    args = make_inputs(op, cfg, tokens=3, context=40)
    assert compare(op, get_op(op).reference, args, torch.float32)["ok"]  # the reference agrees with itself
