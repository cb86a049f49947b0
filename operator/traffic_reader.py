"""Read the TrafficShape a deployment is serving from Prometheus (PromQL over a window, httpx).

Works on Anneal's own metric names and on vLLM's and SGLang's, so drift can be watched on engines
that are not ours yet. Missing metrics or an unreachable Prometheus give an observation *without*
a shape and a reason: a monitoring outage is not evidence, neither of drift nor of its absence.

PromQL used, for a histogram ``H``, selector ``S`` and window ``W``:

- lengths: ``sum by (le) (increase(H_bucket{S}[W]))`` -> cumulative buckets -> LengthHistogram;
  the ``+Inf`` bucket is the number of requests in the window (the evidence);
- concurrency: ``sum(avg_over_time(RUNNING{S}[W]))`` (mean requests in flight, all pods);
- prefix-cache hit ratio: ``sum(increase(HIT{S}[W])) / sum(increase(QUERIED{S}[W]))`` (token
  counters), else the engine's own hit-rate gauge averaged over the window;
- arrival rate: requests / W.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Mapping

import httpx
from pydantic import BaseModel, ConfigDict, Field

from anneal.engine import metric_names as m
from anneal.engine.traffic import LengthHistogram, PrefixSharing, TrafficShape

log = logging.getLogger(__name__)


class MetricFlavor(BaseModel):
    """Where one engine family keeps the series a TrafficShape is made of."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    prompt_hist: str = Field(description="per-request prompt-token histogram (without _bucket)")
    output_hist: str = Field(description="per-request generation-token histogram (without _bucket)")
    running: str | None = Field(None, description="gauge: requests running")
    prefix_hit: str | None = Field(None, description="counter: prompt tokens served from the prefix cache")
    prefix_queried: str | None = Field(None, description="counter: prompt tokens looked up (or all prompt tokens)")
    hit_ratio_gauge: str | None = Field(None, description="gauge fallback: hit ratio in [0, 1]")


FLAVORS: dict[str, MetricFlavor] = {
    "anneal": MetricFlavor(
        name="anneal",
        prompt_hist=m.PROMPT_TOKENS,
        output_hist=m.GENERATION_TOKENS,
        running=m.NUM_RUNNING,
        prefix_hit=m.PREFIX_HIT + "_total",
        prefix_queried=m.PREFIX_QUERIED + "_total",
    ),
    # vLLM (V1 engine): token counters for the prefix cache; V0 exported only a hit-rate gauge.
    "vllm": MetricFlavor(
        name="vllm",
        prompt_hist="vllm:request_prompt_tokens",
        output_hist="vllm:request_generation_tokens",
        running="vllm:num_requests_running",
        prefix_hit="vllm:prefix_cache_hits_total",
        prefix_queried="vllm:prefix_cache_queries_total",
        hit_ratio_gauge="vllm:gpu_prefix_cache_hit_rate",
    ),
    # SGLang: the token histograms exist only with `--collect-tokens-histogram`; cached prompt
    # tokens over all prompt tokens is its prefix (radix) cache hit ratio.
    "sglang": MetricFlavor(
        name="sglang",
        prompt_hist="sglang:prompt_tokens_histogram",
        output_hist="sglang:generation_tokens_histogram",
        running="sglang:num_running_reqs",
        prefix_hit="sglang:cached_tokens_total",
        prefix_queried="sglang:prompt_tokens_total",
        hit_ratio_gauge="sglang:cache_hit_rate",
    ),
}


class PrometheusUnavailable(RuntimeError):
    """Prometheus could not be reached or failed (5xx): no evidence either way."""


class PrometheusQueryError(ValueError):
    """Prometheus rejected the query (bad PromQL, bad selector): a configuration error to fix."""


class TrafficObservation(BaseModel):
    """What one window of metrics says; ``shape`` is None when the metrics do not say enough."""

    model_config = ConfigDict(extra="forbid")

    at: float = Field(description="evaluation time, unix seconds (end of the window)")
    window_seconds: float
    requests: float = Field(0.0, description="requests finished in the window (the evidence)")
    shape: TrafficShape | None = None
    flavor: str | None = None
    missing: list[str] = Field(default_factory=list, description="parts the metrics did not give")
    reason: str = Field("", description="why there is no shape, when there is none")

    @property
    def has_data(self) -> bool:
        return self.shape is not None


def underscored(flavor: MetricFlavor) -> MetricFlavor:
    """The same flavor with ``:`` spelled ``_`` in metric names.

    Exporters built on recent prometheus_client versions answer a scraper that asks for
    OpenMetrics with ``vllm_request_prompt_tokens`` instead of ``vllm:request_prompt_tokens``, so
    Prometheus may hold either spelling depending on versions; the reader tries both.
    """
    names = {k: v.replace(":", "_") for k, v in flavor.model_dump().items() if k != "name" and isinstance(v, str)}
    return flavor.model_copy(update=names)


def format_selector(selector: Mapping[str, str] | str | None) -> str:
    """``{"namespace": "ml", "pod": "web-0"}`` -> ``{namespace="ml",pod="web-0"}``; a string of raw
    matchers (``pod=~"web-.*"``) is used as is."""
    if not selector:
        return ""
    if isinstance(selector, str):
        inner = selector.strip().removeprefix("{").removesuffix("}")
        return "{" + inner + "}"
    parts = []
    for k, v in selector.items():
        escaped = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{k}="{escaped}"')
    return "{" + ",".join(parts) + "}"


def _series(name: str, sel: str) -> str:
    return name + sel


class Prometheus:
    """A small Prometheus HTTP API client: instant queries only."""

    def __init__(self, url: str, timeout: float = 10.0, headers: Mapping[str, str] | None = None,
                 client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self._client = client or httpx.Client(timeout=timeout, headers=dict(headers or {}))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def query(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """Instant query -> ``[(labels, value)]`` (a scalar result has empty labels)."""
        params: dict[str, str] = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        try:
            r = self._client.get(f"{self.url}/api/v1/query", params=params)
        except httpx.HTTPError as err:
            raise PrometheusUnavailable(f"cannot reach Prometheus at {self.url}: {err}") from err
        if r.status_code >= 500:
            raise PrometheusUnavailable(f"Prometheus at {self.url} answered {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except ValueError:
            raise PrometheusUnavailable(
                f"Prometheus at {self.url} answered {r.status_code} with non-JSON: {r.text[:200]}"
            ) from None
        if r.status_code >= 400 or body.get("status") != "success":
            raise PrometheusQueryError(
                f"Prometheus rejected {promql!r}: {body.get('errorType', r.status_code)}: {body.get('error', r.text[:200])}"
            )
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise PrometheusQueryError(f"{promql!r} gave a {data['resultType']}, expected an instant vector")
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def query_scalar(self, promql: str, at: float | None = None) -> float | None:
        """One number, or None when there is none (no series, NaN, Prometheus unreachable).

        For canary gates: None means *hold*. A query that matches several series is a gate
        written wrong (aggregate it with ``sum``/``max``/``histogram_quantile``) and raises
        PrometheusQueryError, as does invalid PromQL.
        """
        try:
            result = self.query(promql, at)
        except PrometheusUnavailable as err:
            log.warning("no value for %s: %s", promql, err)
            return None
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusQueryError(
                f"{promql!r} matched {len(result)} series; aggregate it (sum, max, histogram_quantile) to one"
            )
        value = result[0][1]
        return None if math.isnan(value) or math.isinf(value) else value

    # -- traffic -------------------------------------------------------------------------------

    def detect_flavor(
        self, selector: Mapping[str, str] | str | None = None, at: float | None = None, flavor: str = "auto"
    ) -> MetricFlavor | None:
        """The first flavor (anneal, vllm, sglang; or only ``flavor``) whose prompt-length
        histogram has series, in the spelling Prometheus stored it under (see :func:`underscored`)."""
        sel = format_selector(selector)
        candidates = FLAVORS.values() if flavor == "auto" else [FLAVORS[flavor]]
        for fl in candidates:
            for variant in dict.fromkeys((fl, underscored(fl))):
                if self.query(f"count({_series(variant.prompt_hist + '_bucket', sel)})", at):
                    return variant
        return None

    def _histogram(self, name: str, sel: str, window: str, at: float | None) -> list[tuple[float, float]]:
        rows = self.query(f"sum by (le) (increase({_series(name + '_bucket', sel)}[{window}]))", at)
        return [(float(labels["le"]), v) for labels, v in rows if "le" in labels and not math.isnan(v)]

    def read_traffic(
        self,
        selector: Mapping[str, str] | str | None = None,
        window_seconds: float = 600,
        flavor: str = "auto",
        at: float | None = None,
        num_prefixes: int = 8,
    ) -> TrafficObservation:
        """The shape served over ``[at - window, at]`` by the series matching ``selector``.

        ``num_prefixes`` fills the shape's prefix count, which no engine exports.
        """
        if window_seconds < 1:
            raise ValueError(f"window_seconds must be >= 1, got {window_seconds}")
        if flavor != "auto" and flavor not in FLAVORS:
            raise ValueError(f"unknown metric flavor {flavor!r}; known: auto, {', '.join(FLAVORS)}")
        at = time.time() if at is None else at  # one evaluation time for every query below
        obs = TrafficObservation(at=at, window_seconds=window_seconds)
        sel = format_selector(selector)
        window = f"{int(round(window_seconds))}s"
        try:
            fl = self.detect_flavor(selector, at, flavor)
            if fl is None:
                engines = ", ".join(FLAVORS) if flavor == "auto" else flavor
                obs.reason = f"no prompt-length histogram of {engines} matches {sel or 'any series'}"
                obs.missing = ["prompt_len", "output_len"]
                return obs
            name = obs.flavor = fl.name
            prompt_b = self._histogram(fl.prompt_hist, sel, window, at)
            output_b = self._histogram(fl.output_hist, sel, window, at)
            for part, buckets in (("prompt_len", prompt_b), ("output_len", output_b)):
                if not buckets:
                    obs.missing.append(part)
            if obs.missing:
                obs.reason = f"no {' or '.join(obs.missing)} histogram series for {name} matching {sel or 'any series'}"
                return obs
            obs.requests = max(0.0, max(v for _, v in prompt_b))  # the +Inf bucket: every request
            prompt = LengthHistogram.from_cumulative(prompt_b)
            output = LengthHistogram.from_cumulative(output_b)
            if obs.requests < 0.5 or prompt is None or output is None:
                obs.reason = f"no requests finished in the last {window}"
                return obs
            concurrency = self._concurrency(fl, sel, window, at)
            hit_ratio = self._hit_ratio(fl, sel, window, at)
        except PrometheusUnavailable as err:
            obs.reason = f"prometheus unavailable: {err}"
            return obs
        if concurrency is None:
            obs.missing.append("concurrency")
        if hit_ratio is None:
            obs.missing.append("prefix_hit_ratio")
        obs.shape = TrafficShape(
            name=f"observed:{name}",
            description=f"{name} metrics {sel or '(all series)'} over {window}",
            prompt_len=prompt,
            output_len=output,
            concurrency=concurrency if concurrency and concurrency > 0 else None,
            arrival_rate=obs.requests / window_seconds,
            prefix=PrefixSharing(ratio=min(max(hit_ratio or 0.0, 0.0), 0.999), num_prefixes=num_prefixes),
        )
        return obs

    def _concurrency(self, fl: MetricFlavor, sel: str, window: str, at: float | None) -> float | None:
        if not fl.running:
            return None
        rows = self.query(f"sum(avg_over_time({_series(fl.running, sel)}[{window}]))", at)
        return rows[0][1] if rows and not math.isnan(rows[0][1]) else None

    def _hit_ratio(self, fl: MetricFlavor, sel: str, window: str, at: float | None) -> float | None:
        if fl.prefix_hit and fl.prefix_queried:
            hit = self.query(f"sum(increase({_series(fl.prefix_hit, sel)}[{window}]))", at)
            queried = self.query(f"sum(increase({_series(fl.prefix_queried, sel)}[{window}]))", at)
            if hit and queried and queried[0][1] > 0 and not math.isnan(hit[0][1]):
                return hit[0][1] / queried[0][1]
        if fl.hit_ratio_gauge:
            rows = self.query(f"avg(avg_over_time({_series(fl.hit_ratio_gauge, sel)}[{window}]))", at)
            if rows and not math.isnan(rows[0][1]):
                return rows[0][1]
        return None


def read_traffic(prometheus_url: str, selector: Mapping[str, str] | str | None = None,
                 window_seconds: float = 600, flavor: str = "auto", at: float | None = None) -> TrafficObservation:
    """One-shot :meth:`Prometheus.read_traffic` against ``prometheus_url``."""
    with Prometheus(prometheus_url) as prom:
        return prom.read_traffic(selector, window_seconds, flavor, at)


def query_scalar(prometheus_url: str, promql: str, at: float | None = None) -> float | None:
    """One-shot :meth:`Prometheus.query_scalar` against ``prometheus_url`` (None means hold)."""
    with Prometheus(prometheus_url) as prom:
        return prom.query_scalar(promql, at)
