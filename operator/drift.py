"""Drift: has the traffic moved far enough, for long enough, to compile again? (pure, torch-free)

Score. Each part is measured in units a user can read, then divided by its scale from the policy;
the score is the largest scaled part (so the reason names one dominant cause):

- prompt / output length: Wasserstein-1 distance between the two length distributions on a
  log2 axis, i.e. "by how many doublings did lengths move, on average". Earth-mover distance,
  unlike Jensen-Shannon or KL, keeps growing with *how far* mass moved (chat -> rag and
  chat -> 32k agentic are different amounts of drift, while JS saturates once the supports stop
  overlapping) and needs no common binning, so Anneal's power-of-two buckets compare directly
  with SGLang's or a hand-written shape's. Log length because the costs that a plan tunes for
  (prefill chunking, attention splits, KV blocks) scale multiplicatively with length.
- load: |log2(observed / compiled)| of concurrency (arrival rate when either side lacks it):
  1.0 = doubled or halved.
- prefix-cache hit ratio: absolute difference of the two ratios (already in [0, 1]).

Decision. Windows without a shape (no data: outage, missing metrics) or with too little evidence
(requests, window length) are skipped: they neither count towards a trigger nor reset one.
Hysteresis: a streak starts at ``score >= enter_threshold`` and continues while
``score >= exit_threshold``; it triggers after ``consecutive_windows`` non-overlapping windows,
never within ``cooldown_seconds`` of the last compilation, and only on windows that began after it.
"""

from __future__ import annotations

import math
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from anneal.engine.traffic import LengthHistogram, TrafficShape
from anneal.operator.traffic_reader import TrafficObservation

_SUBDIVISIONS = 16  # integration points per bucket edge interval (error well below 1e-3 doublings)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DriftScales(_Strict):
    """How much of each part counts as a score of 1.0."""

    prompt_len_log2: float = Field(1.0, gt=0, description="doublings of prompt length")
    output_len_log2: float = Field(1.0, gt=0, description="doublings of output length")
    load_log2: float = Field(1.0, gt=0, description="doublings (or halvings) of concurrency")
    prefix_hit: float = Field(0.25, gt=0, description="absolute change of the prefix-cache hit ratio")


class DriftPolicy(_Strict):
    """Thresholds, evidence and pacing of automatic recompilation."""

    enter_threshold: float = Field(1.0, gt=0, description="score that starts a drift streak")
    exit_threshold: float = Field(0.7, gt=0, description="score below which a streak ends")
    consecutive_windows: int = Field(3, ge=1, description="non-overlapping windows a streak needs")
    min_requests: int = Field(100, ge=1, description="requests a window needs to count")
    min_window_seconds: float = Field(300, gt=0, description="shortest window that counts")
    cooldown_seconds: float = Field(3600, ge=0, description="quiet time after a compilation")
    max_staleness_seconds: float = Field(1800, gt=0, description="newest counted window must end this recently")
    scales: DriftScales = Field(default_factory=DriftScales)

    @model_validator(mode="after")
    def _check(self) -> "DriftPolicy":
        if self.exit_threshold > self.enter_threshold:
            raise ValueError(
                f"exit_threshold ({self.exit_threshold}) must be <= enter_threshold ({self.enter_threshold})"
            )
        return self


class DriftParts(_Strict):
    """The raw parts of a score, in their own units (None: not comparable, e.g. no metric)."""

    prompt_len_log2: float
    output_len_log2: float
    load_log2: float | None = None
    prefix_hit: float | None = None


# The keys InferenceDeployment status and policy use for the parts (camelCase, as in the CRD).
STATUS_PART_NAMES = {
    "prompt_len_log2": "promptLength",
    "output_len_log2": "outputLength",
    "load_log2": "concurrency",
    "prefix_hit": "prefixReuse",
}


def status_parts(parts: DriftParts | None) -> dict[str, float]:
    """``{promptLength: .., outputLength: .., concurrency: .., prefixReuse: ..}`` for status,
    leaving out the parts that could not be measured."""
    if parts is None:
        return {}
    return {STATUS_PART_NAMES[k]: round(v, 4) for k, v in parts.model_dump().items() if v is not None}


class DriftScore(_Strict):
    score: float = Field(description="max over parts of part / scale; >= enter_threshold is drift")
    dominant: str = Field(description="the part that sets the score")
    parts: DriftParts


class DriftDecision(_Strict):
    """What to write into status: trigger or not, why, and the evidence."""

    trigger: bool
    reason: str
    score: float | None = None
    dominant: str | None = None
    parts: DriftParts | None = None
    streak: int = Field(0, description="counted windows in the current drift streak")
    windows_needed: int = 0
    requests: float | None = Field(None, description="requests in the newest counted window")
    observed_at: float | None = None


def wasserstein_log2(a: LengthHistogram, b: LengthHistogram) -> float:
    """W1 between two length distributions on a log2-length axis (units: doublings).

    ``integral |F_a(2^u) - F_b(2^u)| du``, with each bucket uniform in length (as sampled), by the
    trapezoid rule on the union of both histograms' edges, each interval subdivided.
    """
    edges = sorted({math.log2(e) for e in a.edges} | {math.log2(e) for e in b.edges})
    total = 0.0
    for u0, u1 in zip(edges, edges[1:]):
        step = (u1 - u0) / _SUBDIVISIONS
        prev = abs(a.cdf(2**u0) - b.cdf(2**u0))
        for k in range(1, _SUBDIVISIONS + 1):
            x = 2 ** (u0 + k * step)
            cur = abs(a.cdf(x) - b.cdf(x))
            total += (prev + cur) / 2 * step
            prev = cur
    return total


def _load_log2(compiled: TrafficShape, observed: TrafficShape) -> float | None:
    for field in ("concurrency", "arrival_rate"):
        ref, now = getattr(compiled, field), getattr(observed, field)
        if ref and now:
            return abs(math.log2(now / ref))
    return None


def drift_score(
    compiled_for: TrafficShape,
    observed: TrafficShape,
    scales: DriftScales | None = None,
    unknown: Sequence[str] = (),
) -> DriftScore:
    """Score ``observed`` against the shape the current plan was compiled for.

    ``unknown`` names parts the observation could not measure (``TrafficObservation.missing``:
    ``concurrency``, ``prefix_hit_ratio``); they are left out rather than read as zero.
    """
    scales = scales or DriftScales()
    load = _load_log2(compiled_for, observed)  # an unmeasured concurrency is None on the shape
    parts = DriftParts(
        prompt_len_log2=wasserstein_log2(compiled_for.prompt_len, observed.prompt_len),
        output_len_log2=wasserstein_log2(compiled_for.output_len, observed.output_len),
        load_log2=load,
        prefix_hit=None if "prefix_hit_ratio" in unknown else abs(observed.prefix.ratio - compiled_for.prefix.ratio),
    )
    scaled = {
        name: value / getattr(scales, name)
        for name, value in parts.model_dump().items()
        if value is not None
    }
    dominant = max(scaled, key=scaled.get)
    return DriftScore(score=scaled[dominant], dominant=dominant, parts=parts)


_DESCRIBE = {
    "prompt_len_log2": "prompt lengths moved {:.2f} doublings",
    "output_len_log2": "output lengths moved {:.2f} doublings",
    "load_log2": "load changed by {:.2f} doublings",
    "prefix_hit": "prefix-cache hit ratio changed by {:.2f}",
}


def _describe(s: DriftScore) -> str:
    return _DESCRIBE[s.dominant].format(getattr(s.parts, s.dominant))


def _skip_reason(obs: TrafficObservation, policy: DriftPolicy) -> str | None:
    if obs.shape is None:
        return f"no data: {obs.reason or 'no shape'}"
    if obs.window_seconds < policy.min_window_seconds:
        return f"insufficient evidence: window {obs.window_seconds:.0f}s < min_window_seconds {policy.min_window_seconds:.0f}s"
    if obs.requests < policy.min_requests:
        return f"insufficient evidence: {obs.requests:.0f} requests < min_requests {policy.min_requests}"
    return None


def decide(
    compiled_for: TrafficShape,
    history: Sequence[TrafficObservation],
    policy: DriftPolicy,
    now: float,
    last_compiled_at: float | None = None,
) -> DriftDecision:
    """Trigger a compilation or not, from the observations so far (any order), with the reason."""
    need = policy.consecutive_windows
    since = last_compiled_at if last_compiled_at is not None else -math.inf
    windows = sorted(
        (o for o in history if o.at - o.window_seconds >= since and o.at <= now), key=lambda o: o.at
    )
    streak, in_drift, last_counted_end = 0, False, -math.inf
    latest: tuple[TrafficObservation, DriftScore] | None = None
    skip = None
    for obs in windows:
        skip = _skip_reason(obs, policy)
        if skip:
            continue  # no evidence either way
        s = drift_score(compiled_for, obs.shape, policy.scales, obs.missing)
        latest = (obs, s)
        if s.score >= policy.enter_threshold or (in_drift and s.score >= policy.exit_threshold):
            if not in_drift or obs.at - obs.window_seconds >= last_counted_end - 1e-6:
                streak += 1  # an overlapping window keeps a streak alive but adds no new evidence
                last_counted_end = obs.at
            in_drift = True
        else:
            streak, in_drift, last_counted_end = 0, False, -math.inf

    def result(trigger: bool, reason: str) -> DriftDecision:
        extra = {}
        if latest:
            obs, s = latest
            extra = dict(score=s.score, dominant=s.dominant, parts=s.parts, requests=obs.requests, observed_at=obs.at)
        return DriftDecision(trigger=trigger, reason=reason, streak=streak, windows_needed=need, **extra)

    if last_compiled_at is not None and now - last_compiled_at < policy.cooldown_seconds:
        left = policy.cooldown_seconds - (now - last_compiled_at)
        return result(False, f"cooldown: {left:.0f}s left since the last compilation")
    if latest is None:
        if not windows:
            return result(False, "no observations since the last compilation")
        return result(False, skip or "no usable window")
    obs, s = latest
    if now - obs.at > policy.max_staleness_seconds:
        return result(False, f"no fresh evidence: newest usable window ended {now - obs.at:.0f}s ago")
    if streak >= need:
        return result(
            True,
            f"sustained drift: {_describe(s)} (score {s.score:.2f} >= {policy.enter_threshold:g} "
            f"for {streak} windows)",
        )
    if in_drift:
        return result(False, f"drift building: {_describe(s)} (score {s.score:.2f}), {streak}/{need} windows")
    return result(
        False, f"within policy: score {s.score:.2f} < {policy.enter_threshold:g} ({_describe(s)})"
    )


class DriftDetector:
    """A policy bound to the shape the current plan was compiled for: ``decide(history, now)``."""

    def __init__(self, compiled_for: TrafficShape, policy: DriftPolicy | None = None,
                 last_compiled_at: float | None = None) -> None:
        self.compiled_for = compiled_for
        self.policy = policy or DriftPolicy()
        self.last_compiled_at = last_compiled_at

    def decide(self, history: Sequence[TrafficObservation], now: float) -> DriftDecision:
        return decide(self.compiled_for, history, self.policy, now, self.last_compiled_at)
