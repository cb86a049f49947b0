"""Canary gates: PromQL over the canary pod's own series against the other replicas' (torch-free).

Built-in gates, each comparing the canary with the stable replicas over the same window:

- ``throughput``: generated tokens/s of the canary >= ``min_throughput_ratio`` x the mean per
  stable replica (skipped when the stable replicas generate nothing: no load is no evidence);
- ``ttft-p90`` and ``itl-p90``: the canary's p90 time to first token / inter-token latency <=
  the stable replicas' pooled p90 x (1 + ``max_latency_regression``);
- ``error-rate``: failed / all requests of the canary <= the stable replicas' rate +
  ``max_error_rate_increase`` (with no stable replica: <= ``max_error_rate_increase`` absolute);

plus the user's ``gates`` (``{{pod}}`` and ``{{namespace}}`` substituted, ``min``/``max`` bounds).
With no stable replica to compare with (one replica), the relative gates are left out.

A value Prometheus does not have (no series, NaN, unreachable) makes its gate ``missing``; an
analysis with a failing gate fails, else one with a missing gate is inconclusive: the rollout
*holds* (a monitoring outage is not evidence, neither for the plan nor against it).

Series are selected by the ``pod`` and ``namespace`` labels (what Prometheus' Kubernetes service
discovery relabelling conventionally produces), plus the deployment's extra selector.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from anneal.engine import metric_names as m
from anneal.operator.api.inference_deployment import CanaryAnalysis, MetricGate
from anneal.operator.traffic_reader import PrometheusQueryError

Outcome = Literal["pass", "fail", "missing"]
Verdict = Literal["passed", "failed", "inconclusive"]
Query = Callable[[str], "float | None"]  # query_scalar: None = no value = hold

GENERATED_TOKENS = m.GENERATION_TOKENS_TOTAL + "_total"
REQUESTS = m.REQUESTS + "_total"


@dataclass(frozen=True)
class GateTarget:
    """Whose series a gate compares: the canary pod vs the other (stable) pods."""

    namespace: str
    canary_pod: str
    stable_pods: tuple[str, ...] = ()
    extra_selector: str = ""  # raw matchers, e.g. cluster="eu-1"
    pod_label: str = "pod"
    namespace_label: str = "namespace"


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def selector(target: GateTarget, pods: Sequence[str], *extra: str) -> str:
    """``{namespace="ns",pod="a"}`` for one pod, ``pod=~"a|b"`` for several (names escaped)."""
    matchers = [f"{target.namespace_label}={_quote(target.namespace)}"]
    if len(pods) == 1:
        matchers.append(f"{target.pod_label}={_quote(pods[0])}")
    else:
        matchers.append(f"{target.pod_label}=~{_quote('|'.join(re.escape(p) for p in pods))}")
    user = target.extra_selector.strip().removeprefix("{").removesuffix("}").strip()
    if user:
        matchers.append(user)
    matchers.extend(extra)
    return "{" + ",".join(matchers) + "}"


def throughput_query(sel: str, window: str) -> str:
    """Generated tokens/s per pod, averaged over the pods the selector matches."""
    return f"avg(sum by (pod) (rate({GENERATED_TOKENS}{sel}[{window}])))"


def quantile_query(histogram: str, q: float, sel: str, window: str) -> str:
    """The q-quantile of a latency histogram, pooled over the pods the selector matches."""
    return f"histogram_quantile({q:g}, sum by (le) (rate({histogram}_bucket{sel}[{window}])))"


def error_rate_query(target: GateTarget, pods: Sequence[str], window: str) -> str:
    """Failed / all requests; no error series yet counts as zero errors, no requests as no value."""
    errors = selector(target, pods, 'status="error"')
    every = selector(target, pods)
    return f"(sum(rate({REQUESTS}{errors}[{window}])) or vector(0)) / sum(rate({REQUESTS}{every}[{window}]))"


def custom_query(gate: MetricGate, target: GateTarget) -> str:
    return gate.query.replace("{{pod}}", target.canary_pod).replace("{{namespace}}", target.namespace)


@dataclass(frozen=True)
class GateResult:
    name: str
    outcome: Outcome
    canary: float | None = None
    baseline: float | None = None
    limit: float | None = None
    message: str = ""

    def wire(self) -> dict:
        out: dict = {"name": self.name, "outcome": self.outcome, "message": self.message}
        for key in ("canary", "baseline", "limit"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(value, 6)
        return out


@dataclass(frozen=True)
class Analysis:
    results: tuple[GateResult, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> Verdict:
        outcomes = {r.outcome for r in self.results}
        if "fail" in outcomes:
            return "failed"
        if "missing" in outcomes or not self.results:
            return "inconclusive"
        return "passed"

    def summary(self) -> str:
        picked = [r for r in self.results if r.outcome == "fail"] or [r for r in self.results if r.outcome == "missing"]
        if not picked:
            return f"all {len(self.results)} gates passed"
        return "; ".join(f"{r.name}: {r.message}" for r in picked)


def _safe(query: Query, promql: str) -> tuple[float | None, str]:
    try:
        return query(promql), ""
    except PrometheusQueryError as err:  # a gate written wrong: say so, but it is no evidence either
        return None, f"invalid query: {err}"


def _at_least(name: str, canary: float | None, baseline: float | None, limit_of: Callable[[float], float],
              unit: str) -> GateResult:
    if canary is None or baseline is None:
        side = "canary" if canary is None else "stable replicas"
        return GateResult(name, "missing", canary, baseline, message=f"no data for the {side}")
    limit = limit_of(baseline)
    ok = canary >= limit
    return GateResult(name, "pass" if ok else "fail", canary, baseline, limit,
                      f"canary {canary:.4g}{unit} {'>=' if ok else '<'} {limit:.4g}{unit} (stable {baseline:.4g}{unit})")


def _at_most(name: str, canary: float | None, baseline: float | None, limit_of: Callable[[float], float],
             unit: str) -> GateResult:
    if canary is None or baseline is None:
        side = "canary" if canary is None else "stable replicas"
        return GateResult(name, "missing", canary, baseline, message=f"no data for the {side}")
    limit = limit_of(baseline)
    ok = canary <= limit
    return GateResult(name, "pass" if ok else "fail", canary, baseline, limit,
                      f"canary {canary:.4g}{unit} {'<=' if ok else '>'} {limit:.4g}{unit} (stable {baseline:.4g}{unit})")


def analysis_window(cfg: CanaryAnalysis, interval_seconds: float, serving_seconds: float | None = None) -> str:
    """The rate() window of one analysis: the analysis interval, at least 30 s (a few scrapes), but
    never reaching back before the canary served the plan (``serving_seconds`` ago): the canary
    pod's samples from before are the old plan's, and would dilute a regression (with an
    ``initialDelay`` under 30 s, a third or more of the first window). Too short a window for
    rate() gives no value: the analysis holds until it is long enough."""
    window = max(30.0, interval_seconds)
    if serving_seconds is not None:
        window = min(window, serving_seconds)
    return f"{max(1, int(window))}s"


def evaluate(query: Query, target: GateTarget, cfg: CanaryAnalysis, window: str,
             min_throughput_ratio: float | None = None, latency_quantile: float = 0.9) -> Analysis:
    """Run every gate once; ``query`` is ``Prometheus.query_scalar`` (bound to one instant)."""
    ratio = cfg.min_throughput_ratio if min_throughput_ratio is None else min_throughput_ratio
    canary = selector(target, [target.canary_pod])
    results: list[GateResult] = []
    if target.stable_pods:
        stable = selector(target, target.stable_pods)
        c, err_c = _safe(query, throughput_query(canary, window))
        s, err_s = _safe(query, throughput_query(stable, window))
        if s is not None and s <= 0:
            results.append(GateResult("throughput", "missing", c, s, message="stable replicas generate no tokens: no load to compare"))
        else:
            r = _at_least("throughput", c, s, lambda b: b * ratio, " tok/s")
            results.append(r if not (err_c or err_s) else GateResult("throughput", "missing", message=err_c or err_s))
        for name, hist in ((f"ttft-p{latency_quantile * 100:g}", m.TTFT), (f"itl-p{latency_quantile * 100:g}", m.ITL)):
            c, err_c = _safe(query, quantile_query(hist, latency_quantile, canary, window))
            s, err_s = _safe(query, quantile_query(hist, latency_quantile, stable, window))
            r = _at_most(name, c, s, lambda b: b * (1.0 + cfg.max_latency_regression), " s")
            results.append(r if not (err_c or err_s) else GateResult(name, "missing", message=err_c or err_s))
        c, _ = _safe(query, error_rate_query(target, [target.canary_pod], window))
        s, _ = _safe(query, error_rate_query(target, target.stable_pods, window))
        results.append(_at_most("error-rate", c, s, lambda b: b + cfg.max_error_rate_increase, ""))
    else:
        c, _ = _safe(query, error_rate_query(target, [target.canary_pod], window))
        results.append(_at_most("error-rate", c, 0.0 if c is not None else None,
                                lambda _b: cfg.max_error_rate_increase, ""))
    for gate in cfg.gates:
        value, err = _safe(query, custom_query(gate, target))
        if value is None:
            results.append(GateResult(gate.name, "missing", message=err or "no data"))
            continue
        low = gate.min is not None and value < gate.min
        high = gate.max is not None and value > gate.max
        bound = f"[{'' if gate.min is None else f'{gate.min:g}'}, {'' if gate.max is None else f'{gate.max:g}'}]"
        results.append(GateResult(gate.name, "fail" if low or high else "pass", value,
                                  limit=gate.min if low else gate.max,
                                  message=f"{value:.4g} {'outside' if low or high else 'within'} {bound}"))
    return Analysis(tuple(results))
