"""The traffic reader against a real Prometheus server (Debian package `prometheus`).

A tiny HTTP exporter (prometheus_client) publishes the histograms, gauges and counters of three
engine families — Anneal's names, vLLM's and SGLang's — fed with known synthetic workloads; a real
Prometheus scrapes it every second; the reader must give back the shapes that were sent.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from anneal.engine import metric_names as mn
from anneal.engine.traffic import LengthHistogram, preset
from anneal.engine.workload import make_workload
from prometheus_server import PROMETHEUS, free_port, running_prometheus

from anneal.operator.traffic_reader import (
    FLAVORS,
    Prometheus,
    PrometheusQueryError,
    format_selector,
    query_scalar,
    read_traffic,
)

SGLANG_BUCKETS = [100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 8000, 10000, 15000, 20000, 40000]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, PrometheusQueryError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Exporter:
    """Series of all three flavors; `feed` observes a workload as if an engine had served it."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        tb = mn.TOKEN_BUCKETS
        self.anneal = {
            "prompt": Histogram(mn.PROMPT_TOKENS, "prompt", ["pod"], buckets=tb, registry=reg),
            "output": Histogram(mn.GENERATION_TOKENS, "output", ["pod"], buckets=tb, registry=reg),
            "running": Gauge(mn.NUM_RUNNING, "running", ["pod"], registry=reg),
            "hit": Counter(mn.PREFIX_HIT, "hit", ["pod"], registry=reg),
            "queried": Counter(mn.PREFIX_QUERIED, "queried", ["pod"], registry=reg),
        }
        self.vllm = {
            "prompt": Histogram("vllm:request_prompt_tokens", "p", ["engine"], buckets=tb, registry=reg),
            "output": Histogram("vllm:request_generation_tokens", "o", ["engine"], buckets=tb, registry=reg),
            "running": Gauge("vllm:num_requests_running", "r", ["engine"], registry=reg),
            "hit": Counter("vllm:prefix_cache_hits", "h", ["engine"], registry=reg),
            "queried": Counter("vllm:prefix_cache_queries", "q", ["engine"], registry=reg),
        }
        self.sglang = {
            "prompt": Histogram("sglang:prompt_tokens_histogram", "p", ["model_name"], buckets=SGLANG_BUCKETS, registry=reg),
            "output": Histogram("sglang:generation_tokens_histogram", "o", ["model_name"], buckets=SGLANG_BUCKETS, registry=reg),
            "running": Gauge("sglang:num_running_reqs", "r", ["model_name"], registry=reg),
            "hit": Counter("sglang:cached_tokens", "c", ["model_name"], registry=reg),
            "queried": Counter("sglang:prompt_tokens", "p", ["model_name"], registry=reg),
        }
        # every series exists (at zero) before the first scrape, as on a freshly started engine
        self.series = [(self.anneal, {"pod": "a"}), (self.anneal, {"pod": "b"}),
                       (self.vllm, {"engine": "0"}), (self.sglang, {"model_name": "m"})]
        for family, labels in self.series:
            for metric in family.values():
                metric.labels(**labels)

    def add_underscored_vllm(self) -> None:
        """vLLM's names as an OpenMetrics-speaking prometheus_client spells them (`:` -> `_`)."""
        reg, tb = self.registry, mn.TOKEN_BUCKETS
        self.vllm_us = {
            "prompt": Histogram("vllm_request_prompt_tokens", "p", ["engine"], buckets=tb, registry=reg),
            "output": Histogram("vllm_request_generation_tokens", "o", ["engine"], buckets=tb, registry=reg),
            "running": Gauge("vllm_num_requests_running", "r", ["engine"], registry=reg),
            "hit": Counter("vllm_prefix_cache_hits", "h", ["engine"], registry=reg),
            "queried": Counter("vllm_prefix_cache_queries", "q", ["engine"], registry=reg),
        }
        for metric in self.vllm_us.values():
            metric.labels(engine="1")

    def serve(self, port: int) -> ThreadingHTTPServer:
        """Serve the classic text format whatever the scraper asks for, as vLLM and SGLang have
        long done, so names keep their colons (prometheus_client's OpenMetrics output would
        rewrite `vllm:x` to `vllm_x`)."""
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def set_running(self, family, labels, value: float) -> None:
        family["running"].labels(**labels).set(value)

    def feed(self, family, labels, workload) -> None:
        for r in workload.requests:
            family["prompt"].labels(**labels).observe(len(r.prompt_token_ids))
            family["output"].labels(**labels).observe(r.max_tokens)
        hits = round(workload.prefix_hit_ratio(block_size=16) * sum(workload.prompt_lens()))
        family["hit"].labels(**labels).inc(hits)
        family["queried"].labels(**labels).inc(sum(workload.prompt_lens()))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(Prometheus client, exporter, workloads fed, evaluation time) with everything scraped."""
    if PROMETHEUS is None:
        pytest.skip("the `prometheus` binary is not installed (Debian: apt-get install -y prometheus)")
    tmp: Path = tmp_path_factory.mktemp("prom")
    exporter = Exporter()
    exp_port = free_port()
    exporter.add_underscored_vllm()
    server = exporter.serve(exp_port)
    # constant gauges, set before the first scrape so the window average is exact
    exporter.set_running(exporter.anneal, {"pod": "a"}, 12)
    exporter.set_running(exporter.anneal, {"pod": "b"}, 5)
    exporter.set_running(exporter.vllm, {"engine": "0"}, 7)
    exporter.set_running(exporter.sglang, {"model_name": "m"}, 64)
    with running_prometheus(tmp, [f"127.0.0.1:{exp_port}"]) as url:
        prom = Prometheus(url, timeout=5)
        try:
            yield from _fed_stack(prom, exporter)
        finally:
            prom.close()
            server.shutdown()
            server.server_close()


def _fed_stack(prom, exporter):
    """Feed the workloads once Prometheus has scraped the zeros; yield what the tests read."""
    # scrapes at zero, so increase() starts from the true zero (and an idle window exists)
    zero_scrapes = f'min(count_over_time({mn.PROMPT_TOKENS}_count[1m]))'
    _wait(lambda: (prom.query_scalar(zero_scrapes) or 0) >= 4, 60, "four scrapes at zero")
    t_idle = time.time()
    fed = {
        "a": make_workload(preset("chat"), 300, seed=1),
        "b": make_workload(preset("rag"), 200, seed=2),
        "vllm": make_workload(preset("agentic"), 120, seed=3),
        "sglang": make_workload(preset("batch"), 150, seed=4),
    }
    exporter.feed(exporter.anneal, {"pod": "a"}, fed["a"])
    exporter.feed(exporter.anneal, {"pod": "b"}, fed["b"])
    exporter.feed(exporter.vllm, {"engine": "0"}, fed["vllm"])
    exporter.feed(exporter.sglang, {"model_name": "m"}, fed["sglang"])
    exporter.feed(exporter.vllm_us, {"engine": "1"}, fed["vllm"])
    _wait(lambda: prom.query_scalar(f"sum({mn.PROMPT_TOKENS}_count)") == 500, 30, "the fed samples scraped")
    time.sleep(2.5)
    # evaluate at the last scrape, so increase() needs no extrapolation at the window's end
    at = prom.query_scalar(f"max(timestamp({mn.PROMPT_TOKENS}_count))")
    yield prom, exporter, fed, at, t_idle


def _expected(lens, les) -> LengthHistogram:
    """The histogram the reader should build from `lens` observed into buckets `les`."""
    les = sorted(les) + [float("inf")]
    return LengthHistogram.from_cumulative([(le, sum(x <= le for x in lens)) for le in les])


def _assert_same(got: LengthHistogram, want: LengthHistogram):
    assert got.edges == want.edges
    assert got.probabilities() == pytest.approx(want.probabilities(), abs=1e-9)


def test_anneal_metrics_give_back_the_shape_that_was_served(stack):
    prom, _, fed, at, _ = stack
    obs = prom.read_traffic({"pod": "a"}, window_seconds=60, at=at)
    w = fed["a"]
    assert obs.flavor == "anneal" and obs.missing == [] and obs.reason == ""
    assert obs.requests == pytest.approx(300)
    _assert_same(obs.shape.prompt_len, _expected(w.prompt_lens(), mn.TOKEN_BUCKETS))
    _assert_same(obs.shape.output_len, _expected(w.output_lens(), mn.TOKEN_BUCKETS))
    # power-of-two buckets are coarse, but the mean survives within a bucket's resolution
    assert obs.shape.prompt_len.mean() == pytest.approx(sum(w.prompt_lens()) / 300, rel=0.2)
    assert obs.shape.concurrency == pytest.approx(12)
    assert obs.shape.arrival_rate == pytest.approx(300 / 60)
    assert obs.shape.prefix.ratio == pytest.approx(w.prefix_hit_ratio(block_size=16), abs=1e-3)
    assert obs.shape.prefix.ratio > 0.2  # chat shares system prompts


def test_selectors_pick_series(stack):
    prom, _, fed, at, _ = stack
    both = prom.read_traffic(None, window_seconds=60, at=at, flavor="anneal")
    assert both.requests == pytest.approx(500)
    assert both.shape.concurrency == pytest.approx(17)  # summed over pods
    lens = fed["a"].prompt_lens() + fed["b"].prompt_lens()
    _assert_same(both.shape.prompt_len, _expected(lens, mn.TOKEN_BUCKETS))
    regex = prom.read_traffic('pod=~"b|c"', window_seconds=60, at=at, flavor="anneal")
    assert regex.requests == pytest.approx(200)
    assert regex.shape.prompt_len.quantile(0.05) > 1024  # rag: long prompts


def test_vllm_and_sglang_names(stack):
    prom, _, fed, at, _ = stack
    v = prom.read_traffic({"engine": "0"}, window_seconds=60, at=at)  # auto-detected
    assert v.flavor == "vllm" and v.requests == pytest.approx(120)
    _assert_same(v.shape.prompt_len, _expected(fed["vllm"].prompt_lens(), mn.TOKEN_BUCKETS))
    assert v.shape.concurrency == pytest.approx(7)
    assert v.shape.prefix.ratio == pytest.approx(fed["vllm"].prefix_hit_ratio(block_size=16), abs=1e-3)
    assert v.shape.prefix.ratio > 0.6  # agentic reuse
    # the same series stored under OpenMetrics-escaped names are found too
    us = prom.read_traffic({"engine": "1"}, window_seconds=60, at=at)
    assert us.flavor == "vllm" and us.requests == pytest.approx(120)
    assert us.shape.prompt_len == v.shape.prompt_len and us.shape.output_len == v.shape.output_len
    assert us.shape.prefix == v.shape.prefix
    assert us.shape.concurrency is None  # its running gauge stayed at 0: idle, not a concurrency
    s = prom.read_traffic({"model_name": "m"}, window_seconds=60, at=at, flavor="sglang")
    assert s.flavor == "sglang" and s.requests == pytest.approx(150)
    _assert_same(s.shape.output_len, _expected(fed["sglang"].output_lens(), SGLANG_BUCKETS))
    assert s.shape.concurrency == pytest.approx(64)


def test_missing_metrics_are_no_data_not_evidence(stack):
    prom, _, _, at, t_idle = stack
    none = prom.read_traffic({"pod": "nope"}, window_seconds=60, at=at)
    assert none.shape is None and not none.has_data and "no prompt-length histogram" in none.reason
    wrong = prom.read_traffic({"pod": "a"}, window_seconds=60, at=at, flavor="vllm")
    assert wrong.shape is None and wrong.missing == ["prompt_len", "output_len"]
    # series exist but nothing happened in the window: zero requests, still no shape
    before = prom.read_traffic({"pod": "a"}, window_seconds=3, at=t_idle)
    assert before.shape is None and "no requests finished" in before.reason
    closed = Prometheus(f"http://127.0.0.1:{free_port()}", timeout=1)
    down = closed.read_traffic({"pod": "a"}, window_seconds=60)
    assert down.shape is None and down.reason.startswith("prometheus unavailable")
    assert closed.query_scalar("vector(1)") is None
    with pytest.raises(ValueError, match="unknown metric flavor 'tgi'"):
        prom.read_traffic({"pod": "a"}, flavor="tgi")


def test_query_scalar_for_canary_gates(stack):
    prom, _, _, at, _ = stack
    url = prom.url
    assert query_scalar(url, f'sum({mn.PROMPT_TOKENS}_count{{pod="a"}})', at=at) == 300
    assert query_scalar(url, f'{mn.PROMPT_TOKENS}_count{{pod="nope"}}', at=at) is None
    assert query_scalar(url, "0/0") is None  # NaN: hold
    assert query_scalar(url, "scalar(vector(2.5))") == 2.5
    with pytest.raises(PrometheusQueryError, match="matched 2 series"):
        query_scalar(url, f"{mn.PROMPT_TOKENS}_count", at=at)
    with pytest.raises(PrometheusQueryError, match="rejected"):
        query_scalar(url, "sum(rate(")
    assert read_traffic(url, {"pod": "b"}, 60, at=at).requests == pytest.approx(200)


def test_selector_formatting_escapes_values():
    assert format_selector({"namespace": "ml", "pod": 'we"ird\\'}) == '{namespace="ml",pod="we\\"ird\\\\"}'
    assert format_selector('pod=~"web-.*"') == '{pod=~"web-.*"}'
    assert format_selector(None) == ""
    assert set(FLAVORS) == {"anneal", "vllm", "sglang"}


def test_read_shapes_feed_the_drift_score(stack):
    """End to end on the real series: what was served as chat scores as chat; rag does not."""
    from anneal.operator.drift import drift_score

    prom, _, _, at, _ = stack
    chat = prom.read_traffic({"pod": "a"}, window_seconds=60, at=at)
    rag = prom.read_traffic({"pod": "b"}, window_seconds=60, at=at)
    compiled_for = preset("chat").model_copy(update={"concurrency": 12.0})
    same = drift_score(compiled_for, chat.shape, unknown=chat.missing)
    moved = drift_score(compiled_for, rag.shape, unknown=rag.missing)
    assert same.score < 0.5, same
    assert moved.score > 2 and moved.dominant == "prompt_len_log2", moved


def test_http_failures_map_to_hold_or_error():
    """Without a server: how each kind of answer is classified (httpx.MockTransport)."""

    def answer(status, body):
        return Prometheus("http://prom", client=httpx.Client(transport=httpx.MockTransport(
            lambda request: httpx.Response(status, **body))))

    assert answer(503, {"text": "overloaded"}).query_scalar("up") is None  # hold
    assert answer(200, {"text": "<html>proxy login</html>"}).query_scalar("up") is None
    assert answer(503, {"text": "x"}).read_traffic({"pod": "a"}).reason.startswith("prometheus unavailable")
    bad = {"json": {"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}}
    with pytest.raises(PrometheusQueryError, match="bad_data: parse error"):
        answer(400, bad).query_scalar("sum(")
    matrix = {"json": {"status": "success", "data": {"resultType": "matrix", "result": []}}}
    with pytest.raises(PrometheusQueryError, match="expected an instant vector"):
        answer(200, matrix).query_scalar("up[5m]")
