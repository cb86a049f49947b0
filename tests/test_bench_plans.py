"""The hand-set plans in bench/plans/ are what GPU calls load: each must validate and resolve
against the op registry for the GPU here, on the CPU, so a bad parameter costs no device time
(session 8 lost a device call's measurements to ``max_m=16`` before 16 was an option)."""

import json
from pathlib import Path

import pytest

from anneal.engine.op_table import OpTable
from anneal.engine.plan import Plan

PLANS = sorted((Path(__file__).parent.parent / "bench" / "plans").glob("*.json"))


def test_there_are_hand_set_plans():
    assert len(PLANS) >= 5


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_hand_set_plan_resolves_for_the_gpu(path):
    plan = Plan.model_validate(json.loads(path.read_text()))
    choices = OpTable.resolve(plan, "cuda")
    assert set(plan.ops) <= set(choices)
