"""Drift score and decision on recorded histograms (what Prometheus would hold), pure Python."""

from __future__ import annotations

import functools
import json
import random

import pytest

from anneal.engine import metric_names as mn
from anneal.engine.traffic import LengthHistogram, PrefixSharing, TrafficShape, preset
from anneal.engine.workload import make_workload
from anneal.operator.drift import (
    DriftDetector,
    DriftPolicy,
    decide,
    drift_score,
    status_parts,
    wasserstein_log2,
)
from anneal.operator.traffic_reader import TrafficObservation

T0 = 1_800_000_000.0
WINDOW = 300.0
POLICY = DriftPolicy(consecutive_windows=3, min_requests=100, min_window_seconds=300, cooldown_seconds=3600)


def _recorded(lens: list[int]) -> LengthHistogram:
    """Lengths as a Prometheus histogram with Anneal's power-of-two buckets records them."""
    les = list(mn.TOKEN_BUCKETS) + [float("inf")]
    return LengthHistogram.from_cumulative([(le, sum(x <= le for x in lens)) for le in les])


@functools.lru_cache(maxsize=None)
def _recorded_shape(name: str, n: int, seed: int) -> TrafficShape:
    """What Prometheus holds after `n` requests drawn from preset `name` (load jittered +-20%)."""
    shape = preset(name)
    w = make_workload(shape, n, seed=seed)
    rng = random.Random(seed)
    return TrafficShape(
        prompt_len=_recorded(w.prompt_lens()),
        output_len=_recorded(w.output_lens()),
        concurrency=shape.concurrency * (1 + rng.uniform(-0.2, 0.2)),
        arrival_rate=shape.arrival_rate,
        prefix=PrefixSharing(ratio=w.prefix_hit_ratio(block_size=16)),
    )


def observe(name: str, k: int, n: int = 200, window: float = WINDOW) -> TrafficObservation:
    """Window k (ending at T0 + (k+1) * window) of traffic drawn from preset `name`, resampled
    with a different seed per window (agentic repeats every 4 windows, to keep this fast)."""
    distinct = k % 4 if name == "agentic" else k
    shape = _recorded_shape(name, n, seed=distinct * 7919 + sum(map(ord, name)) + n)
    return TrafficObservation(at=T0 + (k + 1) * window, window_seconds=window, requests=n, shape=shape)


def outage(k: int) -> TrafficObservation:
    return TrafficObservation(at=T0 + (k + 1) * WINDOW, window_seconds=WINDOW, reason="prometheus unavailable: refused")


def run(history, compiled="chat", policy=POLICY, last_compiled_at=None) -> list:
    """The decision after each window, as the operator's timer would take it."""
    return [
        decide(preset(compiled), history[: i + 1], policy, now=history[i].at + 1, last_compiled_at=last_compiled_at)
        for i in range(len(history))
    ]


def test_wasserstein_is_in_doublings():
    h = preset("chat").prompt_len
    doubled = LengthHistogram(edges=[2 * e for e in h.edges], weights=h.weights)
    assert wasserstein_log2(h, h) == pytest.approx(0.0, abs=1e-12)
    assert wasserstein_log2(h, doubled) == pytest.approx(1.0, abs=2e-3)
    assert wasserstein_log2(doubled, h) == pytest.approx(wasserstein_log2(h, doubled))
    # it keeps growing with distance where a divergence would saturate
    rag, agentic = preset("rag").prompt_len, preset("agentic").prompt_len
    assert wasserstein_log2(h, agentic) > wasserstein_log2(h, rag) > 2.5


def test_score_parts_and_dominant_cause():
    chat = preset("chat")
    s = drift_score(chat, preset("agentic"))
    assert s.dominant == "prompt_len_log2" and s.score == pytest.approx(s.parts.prompt_len_log2)
    assert s.parts.load_log2 == pytest.approx(1.0)  # 16 -> 8 in flight
    assert s.parts.prefix_hit == pytest.approx(0.5)
    more_reuse = chat.model_copy(update={"prefix": PrefixSharing(ratio=0.8)})
    s = drift_score(chat, more_reuse)
    assert s.dominant == "prefix_hit" and s.score == pytest.approx(0.5 / 0.25)
    assert s.parts.prompt_len_log2 == 0 and s.parts.load_log2 == 0
    # a part the metrics did not give is left out, not read as "no prefix reuse"
    s = drift_score(chat, more_reuse, unknown=["prefix_hit_ratio"])
    assert s.parts.prefix_hit is None and s.score == 0
    busy = chat.model_copy(update={"concurrency": 64.0})
    assert drift_score(chat, busy).parts.load_log2 == pytest.approx(2.0)
    json.loads(s.model_dump_json())


def test_no_trigger_on_noise():
    history = [observe("chat", k) for k in range(12)]
    decisions = run(history)
    assert not any(d.trigger for d in decisions)
    assert max(d.score for d in decisions) < POLICY.exit_threshold
    assert decisions[-1].reason.startswith("within policy")


def test_no_trigger_on_a_short_burst():
    history = [observe("chat", k) for k in range(4)] + [observe("agentic", 4)] + [observe("chat", k) for k in range(5, 9)]
    decisions = run(history)
    assert decisions[4].score > 3 and decisions[4].reason.startswith("drift building")
    assert decisions[4].streak == 1
    assert not any(d.trigger for d in decisions)
    assert decisions[-1].streak == 0


def test_trigger_on_a_sustained_shift():
    history = [observe("chat", k) for k in range(4)] + [observe("agentic", k) for k in range(4, 8)]
    decisions = run(history)
    assert [d.trigger for d in decisions] == [False] * 6 + [True, True]
    d = decisions[6]
    assert d.streak == 3 and d.dominant == "prompt_len_log2" and d.score > 3
    assert "sustained drift: prompt lengths moved" in d.reason
    assert d.parts.prefix_hit > 0.3  # agentic reuses far more of its prompts
    json.loads(d.model_dump_json())  # goes into status as is
    parts = status_parts(d.parts)
    assert set(parts) == {"promptLength", "outputLength", "concurrency", "prefixReuse"}
    assert parts["promptLength"] == pytest.approx(d.parts.prompt_len_log2, abs=1e-4)
    assert status_parts(None) == {}


def test_cooldown_and_windows_before_the_last_compilation():
    history = [observe("agentic", k) for k in range(8)]
    # compiled (for chat, say) just before window 3 began: windows 0-2 are not evidence against it
    compiled_at = history[2].at
    cool = DriftPolicy(**{**POLICY.model_dump(), "cooldown_seconds": 1500})
    decisions = run(history, policy=cool, last_compiled_at=compiled_at)
    # windows 3..7 end 300..1500 s after the compilation; cooldown blocks until 1500 s have passed
    assert all(not d.trigger and d.reason.startswith("cooldown") for d in decisions[3:7])
    assert decisions[3].streak == 1  # counting starts with the first window after compiling
    assert decisions[7].trigger and decisions[7].streak == 5
    # same history without the cooldown: the old windows would have triggered at window 2
    assert run(history)[2].trigger


def test_too_little_evidence_never_triggers():
    few = [observe("agentic", k, n=20) for k in range(6)]
    decisions = run(few)
    assert not any(d.trigger for d in decisions)
    assert decisions[-1].reason == "insufficient evidence: 20 requests < min_requests 100"
    short = [observe("agentic", k, window=60) for k in range(10)]
    decisions = run(short)
    assert not any(d.trigger for d in decisions)
    assert "window 60s < min_window_seconds 300s" in decisions[-1].reason


def test_an_outage_is_not_evidence():
    only_outages = [outage(k) for k in range(5)]
    d = run(only_outages)[-1]
    assert not d.trigger and d.reason == "no data: prometheus unavailable: refused" and d.score is None
    # an outage in the middle of a sustained shift neither resets nor advances the streak
    history = [observe("agentic", 0), outage(1), observe("agentic", 2), outage(3), outage(4)]
    decisions = run(history)
    assert [d.streak for d in decisions] == [1, 1, 2, 2, 2]
    history.append(observe("agentic", 5))
    assert run(history)[-1].trigger


def test_stale_evidence_does_not_trigger():
    history = [observe("agentic", k) for k in range(3)]
    assert decide(preset("chat"), history, POLICY, now=history[-1].at + 10).trigger
    d = decide(preset("chat"), history, POLICY, now=history[-1].at + 2 * POLICY.max_staleness_seconds)
    assert not d.trigger and d.reason.startswith("no fresh evidence")


def _shifted(k: int, doublings: float) -> TrafficObservation:
    """Chat with prompt lengths moved by exactly `doublings` (a score of `doublings`)."""
    chat = preset("chat")
    f = 2**doublings
    prompt = LengthHistogram(edges=[round(e * f) for e in chat.prompt_len.edges], weights=chat.prompt_len.weights)
    return TrafficObservation(
        at=T0 + (k + 1) * WINDOW, window_seconds=WINDOW, requests=500, shape=chat.model_copy(update={"prompt_len": prompt})
    )


def test_hysteresis_enter_and_exit_thresholds():
    # 0.85 is below enter (1.0) but above exit (0.7): it keeps a streak alive, it cannot start one
    keep = [_shifted(0, 1.5), _shifted(1, 0.85), _shifted(2, 1.5)]
    assert [d.streak for d in run(keep)] == [1, 2, 3] and run(keep)[-1].trigger
    start = [_shifted(0, 0.85), _shifted(1, 0.85), _shifted(2, 0.85), _shifted(3, 0.85)]
    assert not any(d.trigger for d in run(start)) and run(start)[-1].streak == 0
    broken = [_shifted(0, 1.5), _shifted(1, 0.5), _shifted(2, 1.5), _shifted(3, 1.5)]
    assert [d.streak for d in run(broken)] == [1, 0, 1, 2] and not run(broken)[-1].trigger


def test_overlapping_windows_are_not_independent_evidence():
    # a 300 s window read every 60 s: five reads of one burst must not count as five windows
    burst = [
        TrafficObservation(at=T0 + 300 + 60 * i, window_seconds=300, requests=400,
                           shape=observe("agentic", 0).shape)
        for i in range(5)
    ]
    decisions = run(burst)
    assert not any(d.trigger for d in decisions) and decisions[-1].streak == 1
    # it keeps going long enough for three disjoint windows: now it is sustained
    longer = burst + [
        TrafficObservation(at=T0 + 300 + 60 * i, window_seconds=300, requests=400,
                           shape=observe("agentic", 0).shape)
        for i in range(5, 11)
    ]
    assert run(longer)[-1].trigger and run(longer)[-1].streak == 3


def test_policy_validation_and_detector():
    with pytest.raises(ValueError, match="exit_threshold .* must be <= enter_threshold"):
        DriftPolicy(enter_threshold=0.5, exit_threshold=0.8)
    with pytest.raises(ValueError):
        DriftPolicy(consecutive_windows=0)
    detector = DriftDetector(preset("chat"), POLICY)
    history = [observe("agentic", k) for k in range(3)]
    assert detector.decide(history, now=history[-1].at + 1).trigger
    assert not detector.decide(history[:2], now=history[1].at + 1).trigger
