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
