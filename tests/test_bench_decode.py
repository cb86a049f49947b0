"""bench/decode.py's greedy margins: the reference's greedy stream with how near a tie each step
was, so a plan's divergence can be read as a flipped near-tie or a wrong result (CPU, tiny model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode as bench  # noqa: E402

from anneal.engine.llm import Engine, EngineArgs  # noqa: E402
from anneal.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_greedy_margins_follow_the_greedy_stream():
    eng = Engine(EngineArgs(model="random:tiny", device="cpu", max_model_len=128, num_kv_blocks=64))
    prompt = list(range(3, 20))
    plain = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    toks, margins = bench.greedy_margins(eng, prompt, 12)
    assert toks == plain  # asking for log-probabilities does not change the greedy choice
    assert len(margins) == 12 and all(m >= 0 for m in margins)
    assert not eng.has_unfinished_requests()


def test_a_plan_on_weight_copies_is_held_to_the_bytes_it_reads():
    """A decode step of a plan on bf12 (fp8) projections reads 1.5 (1) bytes a projection weight, not
    bf16's 2: its roofline counts those (session 44's bf12 8B step read "102.7%" against bf16 bytes)."""
    from anneal.engine.plan import OpChoice, Plan

    eng = Engine(EngineArgs(model="random:tiny", device="cpu", dtype="bfloat16", max_model_len=64, num_kv_blocks=16))
    projections = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
    proj = sum(getattr(L, f).numel() for L in eng.weights.layers for f in projections.values())
    rows = sum(getattr(L, f).shape[0] for L in eng.weights.layers for f in projections.values())
    total = eng.weights.nbytes()
    assert bench.plan_weight_bytes(eng, Plan()) == total
    bf12 = Plan(ops={op: OpChoice(impl="triton_gemv_bf12") for op in projections})
    assert bench.plan_weight_bytes(eng, bf12) == total - 2 * proj + proj * 3 // 2 + 4 * rows
    fp8 = Plan(ops={"o_proj": OpChoice(impl="triton_gemv_fp8")})
    o = [L.o for L in eng.weights.layers]
    assert bench.plan_weight_bytes(eng, fp8) == total - sum(t.numel() - 4 * t.shape[0] for t in o)
