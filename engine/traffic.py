"""TrafficShape: what a deployment serves, as data (torch-free).

A shape is written by hand (presets ``chat``, ``rag``, ``agentic``, ``batch``, or a YAML/JSON file),
read from Prometheus (``anneal.operator.traffic_reader``), compared for drift
(``anneal.operator.drift``) and turned into a synthetic workload (``anneal.engine.workload``) that
the engine replays while the compiler measures candidates.

Lengths are histograms over half-open integer buckets ``[edges[i], edges[i+1])`` with weights;
a length is drawn by picking a bucket by weight, then a uniform integer inside it.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PRESET_NAMES = ("chat", "rag", "agentic", "batch")


class TrafficShapeError(ValueError):
    """A traffic spec that cannot be used; the message says which field and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthHistogram(_Strict):
    """A token-length distribution: bucket i holds lengths in ``[edges[i], edges[i+1])``."""

    edges: list[int] = Field(description="n+1 strictly increasing bucket edges, first >= 1")
    weights: list[float] = Field(description="n non-negative bucket weights (any scale, sum > 0)")

    @model_validator(mode="after")
    def _check(self) -> "LengthHistogram":
        if len(self.edges) < 2:
            raise ValueError("edges needs at least 2 values (one bucket)")
        if len(self.weights) != len(self.edges) - 1:
            raise ValueError(
                f"weights has {len(self.weights)} values but edges define "
                f"{len(self.edges) - 1} buckets (need len(edges) - 1)"
            )
        if self.edges[0] < 1:
            raise ValueError(f"edges[0] must be >= 1 token, got {self.edges[0]}")
        for i in range(1, len(self.edges)):
            if self.edges[i] <= self.edges[i - 1]:
                raise ValueError(
                    f"edges must be strictly increasing: edges[{i}]={self.edges[i]} "
                    f"<= edges[{i - 1}]={self.edges[i - 1]}"
                )
        for i, w in enumerate(self.weights):
            if not (w >= 0 and math.isfinite(w)):
                raise ValueError(f"weights[{i}]={w} must be a finite number >= 0")
        if sum(self.weights) <= 0:
            raise ValueError("weights must not all be zero")
        return self

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_samples(cls, samples: Iterable[int], edges: Sequence[int]) -> "LengthHistogram":
        """Count integer samples into ``edges``; samples outside the edges are an error."""
        edges = [int(e) for e in edges]
        counts = [0.0] * (len(edges) - 1)
        for s in samples:
            i = bisect.bisect_right(edges, s) - 1
            if i < 0 or i >= len(counts):
                raise ValueError(f"sample {s} outside [{edges[0]}, {edges[-1]})")
            counts[i] += 1
        return cls(edges=edges, weights=counts)

    @classmethod
    def from_cumulative(
        cls, buckets: Sequence[tuple[float, float]], inf_upper: int | None = None
    ) -> "LengthHistogram | None":
        """From Prometheus-style cumulative buckets ``[(le, count_le), ...]`` (``le`` may be inf).

        Token counts are integers, so bucket ``(le_prev, le]`` is ``[floor(le_prev)+1, floor(le)+1)``.
        The ``+Inf`` bucket has no upper bound; ``inf_upper`` (default twice the last finite ``le``)
        closes it. Counts are made monotone (``increase()`` extrapolates each series separately)
        and leading/trailing empty buckets are dropped. Returns None when there are no counts.
        """
        pts = sorted((float(le), max(0.0, float(c))) for le, c in buckets)
        if not pts:
            return None
        edges: list[int] = []
        weights: list[float] = []
        prev_le, prev_count = 0.0, 0.0
        for le, count in pts:
            count = max(count, prev_count)  # cumulative counts never decrease
            if math.isinf(le):
                if prev_le <= 0:
                    return None  # only a +Inf bucket: no length information
                upper = inf_upper if inf_upper is not None else 2 * int(prev_le)
                hi = max(int(upper), int(math.floor(prev_le)) + 2)
            else:
                hi = int(math.floor(le)) + 1
            lo = max(1, int(math.floor(prev_le)) + 1)
            if hi > lo:
                if not edges:
                    edges.append(lo)
                elif edges[-1] != lo:
                    edges.append(lo)
                    weights.append(0.0)
                edges.append(hi)
                weights.append(count - prev_count)
            prev_le, prev_count = le, count
        while weights and weights[-1] <= 0:
            weights.pop()
            edges.pop()
        while weights and weights[0] <= 0:
            weights.pop(0)
            edges.pop(0)
        if not weights:
            return None
        return cls(edges=edges, weights=weights)

    # -- statistics -----------------------------------------------------------------------------

    def probabilities(self) -> list[float]:
        total = sum(self.weights)
        return [w / total for w in self.weights]

    def mean(self) -> float:
        """Exact mean of the bucketed distribution (uniform integers inside each bucket)."""
        return sum(p * (lo + hi - 1) / 2 for p, lo, hi in self._buckets())

    def cdf(self, x: float) -> float:
        """P(length <= x), treating each bucket as continuous uniform on ``[lo, hi)``."""
        acc = 0.0
        for p, lo, hi in self._buckets():
            if x >= hi:
                acc += p
            elif x > lo:
                acc += p * (x - lo) / (hi - lo)
        return min(1.0, acc)

    def quantile(self, q: float) -> float:
        """Inverse of :meth:`cdf` (continuous approximation inside a bucket)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must be in [0, 1], got {q}")
        acc = 0.0
        buckets = [b for b in self._buckets() if b[0] > 0]
        for p, lo, hi in buckets:
            if acc + p >= q:
                return lo + (hi - lo) * (q - acc) / p
            acc += p
        return float(buckets[-1][2])

    def sample(self, rng: random.Random) -> int:
        """One length: a bucket by weight, then a uniform integer in ``[lo, hi)``."""
        i = rng.choices(range(len(self.weights)), weights=self.weights)[0]
        return rng.randrange(self.edges[i], self.edges[i + 1])

    @property
    def max_len(self) -> int:
        """The largest length the histogram can produce."""
        last = max(i for i, w in enumerate(self.weights) if w > 0)
        return self.edges[last + 1] - 1

    def _buckets(self) -> list[tuple[float, int, int]]:
        return list(zip(self.probabilities(), self.edges[:-1], self.edges[1:]))

    # -- transformations ------------------------------------------------------------------------

    def clamped(self, max_len: int) -> "LengthHistogram":
        """Lengths above ``max_len`` become ``max_len`` (mass moves to a one-token bucket)."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if self.max_len <= max_len:
            return self
        edges: list[int] = []
        weights: list[float] = []
        overflow = 0.0
        for w, lo, hi in zip(self.weights, self.edges[:-1], self.edges[1:]):
            if lo >= max_len:
                overflow += w
                continue
            top = min(hi, max_len)  # [lo, top) keeps its share, the rest is clipped to max_len
            share = w * (top - lo) / (hi - lo)
            if not edges:
                edges.append(lo)
            edges.append(top)
            weights.append(share)
            overflow += w - share
        if not edges:
            edges.append(max_len)
        elif edges[-1] < max_len:
            edges.append(max_len)
            weights.append(0.0)
        edges.append(max_len + 1)
        weights.append(overflow)
        return LengthHistogram(edges=edges, weights=weights)

    def scaled(self, factor: float) -> "LengthHistogram":
        """Every length times ``factor`` (buckets that collapse onto one edge are merged)."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")
        edges: list[int] = [max(1, round(self.edges[0] * factor))]
        weights: list[float] = []
        for w, hi in zip(self.weights, self.edges[1:]):
            new_hi = round(hi * factor)
            if new_hi <= edges[-1]:
                if weights:  # collapsed onto the previous bucket: merge
                    weights[-1] += w
                    continue
                new_hi = edges[-1] + 1
            edges.append(new_hi)
            weights.append(w)
        return LengthHistogram(edges=edges, weights=weights)


class PrefixSharing(_Strict):
    """How much of the prompt a prefix cache can serve.

    ``ratio`` is the fraction of all prompt tokens expected to hit the prefix cache (what the
    engine's ``prefix_cache_hit / prefix_cache_queried`` counters measure). The synthetic workload
    realizes it with ``num_prefixes`` shared prefixes (system prompts, conversations, documents):
    each request starts with the leading tokens of one of them, and the prefix lengths are chosen
    so that the realized hit fraction matches ``ratio``.
    """

    ratio: float = Field(0.0, ge=0.0, lt=1.0, description="fraction of prompt tokens hitting the cache")
    num_prefixes: int = Field(8, ge=1, le=1_000_000, description="distinct shared prefixes")


class TrafficShape(_Strict):
    """Prompt/output length distributions, load, and prefix sharing of one deployment's traffic."""

    name: str | None = Field(None, description="preset name or a label, informational")
    description: str = ""
    prompt_len: LengthHistogram
    output_len: LengthHistogram
    concurrency: float | None = Field(None, gt=0, description="mean requests in flight")
    arrival_rate: float | None = Field(None, gt=0, description="requests per second")
    prefix: PrefixSharing = Field(default_factory=PrefixSharing)

    @model_validator(mode="after")
    def _load_given(self) -> "TrafficShape":
        if self.concurrency is None and self.arrival_rate is None:
            raise ValueError("give concurrency (requests in flight) or arrival_rate (requests/s), or both")
        return self

    @property
    def max_total_len(self) -> int:
        return self.prompt_len.max_len + self.output_len.max_len

    def clamped(self, max_model_len: int) -> "TrafficShape":
        """Clip lengths to ``max_model_len``: prompts to ``max_model_len - 1`` (room for one output
        token), outputs to what the shortest prompt leaves. The workload generator then trims each
        request's ``max_tokens`` so that its own prompt + output fits."""
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        prompt = self.prompt_len.clamped(max_model_len - 1)
        output = self.output_len.clamped(max(1, max_model_len - prompt.edges[0]))
        return self.model_copy(update={"prompt_len": prompt, "output_len": output})

    def scaled(self, max_model_len: int) -> "TrafficShape":
        """Shrink all lengths by one factor so the longest prompt + output fits ``max_model_len``.

        Unlike :meth:`clamped`, relative shape survives: a scaled ``agentic`` is still much longer
        than a scaled ``chat`` on a small model, which is what drift tests on tiny models need.
        A shape that already fits is returned unchanged.
        """
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        total = self.max_total_len
        if total <= max_model_len:
            return self
        factor = max_model_len / total
        shape = self.model_copy(
            update={"prompt_len": self.prompt_len.scaled(factor), "output_len": self.output_len.scaled(factor)}
        )
        return shape.clamped(max_model_len)  # rounding may leave a token or two over

    def to_bench_pairs(self, quantiles: Sequence[float] = (0.1, 0.5, 0.9)) -> list[tuple[int, int]]:
        """Representative (ISL, OSL) pairs: matching quantiles of prompt and output length."""
        return [
            (max(1, round(self.prompt_len.quantile(q))), max(1, round(self.output_len.quantile(q))))
            for q in quantiles
        ]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


# -- presets ------------------------------------------------------------------------------------


def _h(edges: list[int], weights: list[float]) -> LengthHistogram:
    return LengthHistogram(edges=edges, weights=weights)


_PRESETS: dict[str, TrafficShape] = {
    "chat": TrafficShape(
        name="chat",
        description="interactive chat: short prompts (~100-1k), outputs ~100-500, shared system prompts",
        prompt_len=_h([32, 100, 200, 400, 700, 1024, 2048], [0.05, 0.3, 0.3, 0.2, 0.1, 0.05]),
        output_len=_h([16, 100, 200, 300, 500, 1000], [0.05, 0.35, 0.3, 0.22, 0.08]),
        concurrency=16,
        arrival_rate=4.0,
        prefix=PrefixSharing(ratio=0.3, num_prefixes=8),
    ),
    "rag": TrafficShape(
        name="rag",
        description="retrieval-augmented: long prompts (2k-8k) of retrieved documents, short answers",
        prompt_len=_h([2048, 3072, 4096, 6144, 8192], [0.25, 0.3, 0.3, 0.15]),
        output_len=_h([16, 64, 128, 256, 512], [0.15, 0.35, 0.35, 0.15]),
        concurrency=8,
        arrival_rate=2.0,
        prefix=PrefixSharing(ratio=0.15, num_prefixes=4),
    ),
    "agentic": TrafficShape(
        name="agentic",
        description="long multi-turn agents: prompts 4k-32k that mostly repeat the conversation so far",
        prompt_len=_h([4096, 8192, 12288, 16384, 24576, 32768], [0.2, 0.25, 0.2, 0.2, 0.15]),
        output_len=_h([100, 200, 400, 700, 1024], [0.3, 0.3, 0.25, 0.15]),
        concurrency=8,
        arrival_rate=0.5,
        prefix=PrefixSharing(ratio=0.8, num_prefixes=16),
    ),
    "batch": TrafficShape(
        name="batch",
        description="offline batch: medium prompts, long outputs, many requests in flight",
        prompt_len=_h([256, 512, 1024, 2048], [0.3, 0.4, 0.3]),
        output_len=_h([512, 1024, 2048, 4096], [0.3, 0.4, 0.3]),
        concurrency=128,
        prefix=PrefixSharing(ratio=0.1, num_prefixes=4),
    ),
}


def preset(name: str) -> TrafficShape:
    """A copy of a named preset."""
    if name not in _PRESETS:
        raise TrafficShapeError(f"unknown traffic preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    return _PRESETS[name].model_copy(deep=True)


# -- loading ------------------------------------------------------------------------------------


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_traffic(data: Any, source: str = "traffic shape") -> TrafficShape:
    """Validate a mapping (already parsed YAML/JSON) as a TrafficShape, with field-level errors.

    ``preset: NAME`` starts from that preset; the other keys override its fields (``prefix`` is
    merged key by key), e.g. ``{preset: agentic, concurrency: 32}``.
    """
    if not isinstance(data, dict):
        raise TrafficShapeError(
            f"{source}: expected a mapping with prompt_len, output_len, concurrency/arrival_rate, "
            f"got {type(data).__name__}"
        )
    if "preset" in data:
        base = data["preset"]
        if base not in _PRESETS:
            raise TrafficShapeError(f"{source}: preset: unknown preset {base!r}; presets: {', '.join(PRESET_NAMES)}")
        merged = _PRESETS[base].model_dump(mode="json")
        for key, value in data.items():
            if key == "preset":
                continue
            if key == "prefix" and isinstance(value, dict):
                merged["prefix"] = {**merged["prefix"], **value}
            else:
                merged[key] = value
        data = merged
    try:
        return TrafficShape.model_validate(data)
    except ValidationError as err:
        raise TrafficShapeError(f"{source}: invalid traffic shape\n{_format_errors(err)}") from None


def load_traffic(spec: str | Path) -> TrafficShape:
    """A preset name (``chat``, ``rag``, ``agentic``, ``batch``) or a YAML/JSON TrafficShape file."""
    if isinstance(spec, str) and spec in _PRESETS:
        return preset(spec)
    path = Path(spec)
    if not path.is_file():
        raise TrafficShapeError(
            f"traffic {str(spec)!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor an existing file"
        )
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise TrafficShapeError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'}: {err}") from None
    return parse_traffic(data, source=str(path))


def dump_traffic(shape: TrafficShape, path: str | Path) -> None:
    """Write a shape as YAML (or JSON when the path ends in ``.json``)."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(shape.model_dump(mode="json", exclude_none=True), indent=2) + "\n"
    else:
        text = shape.to_yaml()
    path.write_text(text, encoding="utf-8")


def __getattr__(name: str) -> Any:
    # The workload generator lives in its own module; keep `traffic.make_workload` working.
    if name in ("make_workload", "Workload", "SyntheticRequest"):
        from anneal.engine import workload

        return getattr(workload, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
