"""Canary gates against a real Prometheus (Debian package `prometheus`) scraping a live exporter.

The exporter publishes Anneal's serving metrics (generated tokens, requests by status, TTFT and
inter-token latency histograms) for pods in several namespaces, one scenario each, fed
continuously by a background thread while Prometheus scrapes every second:

- ``good``: the canary behaves like the two stable replicas -> every gate passes;
- ``slow``: the canary's latencies are 4x and its throughput half -> throughput, TTFT, ITL fail;
- ``errors``: a fifth of the canary's requests fail -> only the error-rate gate fails;
- ``quiet``: the canary exports nothing -> the gates are missing and the analysis holds;
- ``solo``: a single replica -> relative gates are left out, absolute error rate only.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import Counter, CollectorRegistry, Histogram

from anneal.engine import metric_names as mn
from anneal.operator.api.inference_deployment import CanaryAnalysis
from anneal.operator.canary_gates import (
    GateTarget,
    analysis_window,
    error_rate_query,
    evaluate,
    selector,
)
from anneal.operator.traffic_reader import Prometheus

from prometheus_server import PROMETHEUS, free_port, running_prometheus
from test_traffic_reader import Exporter as _TrafficExporter, _wait

WINDOW = "30s"

# namespace -> {pod: (tokens per tick, ttft seconds, itl seconds, error fraction)}
SCENARIOS = {
    "good": {"llama-c": (40, 0.05, 0.01, 0.0), "llama-s1": (40, 0.05, 0.01, 0.0), "llama-s2": (40, 0.05, 0.01, 0.0)},
    "slow": {"llama-c": (20, 0.2, 0.04, 0.0), "llama-s1": (40, 0.05, 0.01, 0.0), "llama-s2": (40, 0.05, 0.01, 0.0)},
    "errors": {"llama-c": (40, 0.05, 0.01, 0.2), "llama-s1": (40, 0.05, 0.01, 0.0), "llama-s2": (40, 0.05, 0.01, 0.0)},
    "quiet": {"llama-s1": (40, 0.05, 0.01, 0.0), "llama-s2": (40, 0.05, 0.01, 0.0)},
    "solo": {"llama-c": (40, 0.05, 0.01, 0.0)},
}


class ServingExporter:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        labels = ["namespace", "pod"]
        self.tokens = Counter(mn.GENERATION_TOKENS_TOTAL, "generated", labels, registry=reg)
        self.requests = Counter(mn.REQUESTS, "requests", labels + ["status", "finish_reason"], registry=reg)
        self.ttft = Histogram(mn.TTFT, "ttft", labels, buckets=mn.LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(mn.ITL, "itl", labels, buckets=mn.LATENCY_BUCKETS, registry=reg)
        self.stop = threading.Event()
        self.rng = random.Random(0)
        for ns, pods in SCENARIOS.items():
            for pod in pods:
                self.tokens.labels(ns, pod)
                self.requests.labels(ns, pod, "success", "length")

    def tick(self) -> None:
        for ns, pods in SCENARIOS.items():
            for pod, (tokens, ttft, itl, err) in pods.items():
                self.tokens.labels(ns, pod).inc(tokens)
                for _ in range(10):  # ten requests per tick
                    failed = self.rng.random() < err
                    self.requests.labels(ns, pod, "error" if failed else "success", "" if failed else "length").inc()
                    self.ttft.labels(ns, pod).observe(ttft * self.rng.uniform(0.9, 1.1))
                    for _ in range(4):
                        self.itl.labels(ns, pod).observe(itl * self.rng.uniform(0.9, 1.1))

    def run(self) -> None:
        while not self.stop.is_set():
            self.tick()
            time.sleep(0.25)


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("the `prometheus` binary is not installed (Debian: apt-get install -y prometheus)")
    tmp: Path = tmp_path_factory.mktemp("prom-gates")
    exporter = ServingExporter()
    # reuse the traffic reader test's classic-text-format HTTP handler
    shim = _TrafficExporter.__new__(_TrafficExporter)
    shim.registry = exporter.registry
    exp_port = free_port()
    server = shim.serve(exp_port)
    feeder = threading.Thread(target=exporter.run, daemon=True)
    feeder.start()
    with running_prometheus(tmp, [f"127.0.0.1:{exp_port}"], honor_labels=True) as url:
        client = Prometheus(url, timeout=5)
        try:
            # enough scrapes for rate() over the window
            _wait(lambda: (client.query_scalar(
                f"min(count_over_time({mn.GENERATION_TOKENS_TOTAL}_total[1m]))") or 0) >= 8,
                90, "eight scrapes")
            yield client
        finally:
            exporter.stop.set()
            client.close()
            server.shutdown()
            server.server_close()


def target(ns: str) -> GateTarget:
    pods = SCENARIOS[ns]
    stable = tuple(p for p in ("llama-s1", "llama-s2") if p in pods)
    return GateTarget(namespace=ns, canary_pod="llama-c", stable_pods=stable)


def results(analysis):
    return {r.name: r for r in analysis.results}


CFG = CanaryAnalysis(maxLatencyRegression=0.5, maxErrorRateIncrease=0.05, minThroughputRatio=0.8)


def test_a_canary_like_its_peers_passes_every_gate(prom):
    a = evaluate(prom.query_scalar, target("good"), CFG, WINDOW)
    r = results(a)
    assert set(r) == {"throughput", "ttft-p90", "itl-p90", "error-rate"}
    assert a.verdict == "passed", a.summary()
    assert r["throughput"].canary == pytest.approx(r["throughput"].baseline, rel=0.1)
    assert 0.04 < r["ttft-p90"].canary < 0.07 and r["error-rate"].canary == 0


def test_a_slow_canary_fails_throughput_and_latency_gates(prom):
    a = evaluate(prom.query_scalar, target("slow"), CFG, WINDOW)
    r = results(a)
    assert a.verdict == "failed"
    assert {n for n, g in r.items() if g.outcome == "fail"} == {"throughput", "ttft-p90", "itl-p90"}
    assert r["throughput"].canary == pytest.approx(r["throughput"].baseline / 2, rel=0.15)
    assert r["ttft-p90"].canary > 3 * r["ttft-p90"].baseline
    assert r["error-rate"].outcome == "pass"


def test_a_failing_canary_fails_only_the_error_rate_gate(prom):
    a = evaluate(prom.query_scalar, target("errors"), CFG, WINDOW)
    r = results(a)
    assert a.verdict == "failed"
    assert [n for n, g in r.items() if g.outcome == "fail"] == ["error-rate"]
    assert 0.1 < r["error-rate"].canary < 0.3 and r["error-rate"].baseline == 0


def test_missing_canary_series_hold_instead_of_judging(prom):
    a = evaluate(prom.query_scalar, target("quiet"), CFG, WINDOW)
    assert a.verdict == "inconclusive"
    assert {g.outcome for g in a.results} == {"missing"}
    assert "no data for the canary" in a.summary()


def test_an_unreachable_prometheus_holds(prom):
    down = Prometheus(f"http://127.0.0.1:{free_port()}", timeout=1)
    a = evaluate(down.query_scalar, target("good"), CFG, WINDOW)
    assert a.verdict == "inconclusive" and {g.outcome for g in a.results} == {"missing"}


def test_a_single_replica_is_held_to_the_absolute_error_rate_and_custom_gates(prom):
    cfg = CanaryAnalysis.model_validate({
        "maxErrorRateIncrease": 0.05,
        "gates": [
            {"name": "tokens", "query": f'sum(rate({mn.GENERATION_TOKENS_TOTAL}_total{{namespace="{{{{namespace}}}}",pod="{{{{pod}}}}"}}[30s]))', "min": 5},
            {"name": "too-fast", "query": f'sum(rate({mn.GENERATION_TOKENS_TOTAL}_total{{pod="{{{{pod}}}}",namespace="{{{{namespace}}}}"}}[30s]))', "max": 1},
            {"name": "absent", "query": 'sum(rate(no_such_metric_total{pod="{{pod}}"}[30s]))', "max": 1},
        ],
    })
    a = evaluate(prom.query_scalar, GateTarget(namespace="solo", canary_pod="llama-c"), cfg, WINDOW)
    r = results(a)
    assert set(r) == {"error-rate", "tokens", "too-fast", "absent"}
    assert r["error-rate"].outcome == "pass" and r["tokens"].outcome == "pass", r["tokens"]
    assert r["too-fast"].outcome == "fail" and r["absent"].outcome == "missing"
    assert a.verdict == "failed"


def test_selectors_escape_pod_names_and_keep_extra_matchers():
    t = GateTarget(namespace='n"s', canary_pod="a.b", stable_pods=("c.d", "e"), extra_selector='{cluster="eu"}')
    assert selector(t, ["a.b"]) == '{namespace="n\\"s",pod="a.b",cluster="eu"}'
    assert selector(t, ["c.d", "e"]) == '{namespace="n\\"s",pod=~"c\\\\.d|e",cluster="eu"}'
    q = error_rate_query(t, ["a.b"], "1m")
    assert 'status="error"' in q and "or vector(0)" in q


def test_the_analysis_window_never_reaches_back_before_the_canary_served_the_plan():
    cfg = CanaryAnalysis()
    assert analysis_window(cfg, 10) == "30s" and analysis_window(cfg, 60) == "60s"  # a few scrapes at least
    # the first analysis after a 20 s initial delay: 20 s of the new plan, not 10 s of the old one too
    assert analysis_window(cfg, 10, serving_seconds=20.7) == "20s"
    assert analysis_window(cfg, 60, serving_seconds=45) == "45s"
    assert analysis_window(cfg, 10, serving_seconds=300) == "30s"
    assert analysis_window(cfg, 10, serving_seconds=0.2) == "1s"  # no value from rate(): the analysis holds
