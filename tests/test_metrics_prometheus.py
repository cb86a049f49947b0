"""A real Prometheus server scrapes a live `anneal serve`, and PromQL sees the traffic that was sent.

Needs the `prometheus` binary (Debian package `prometheus`); skipped when it is not installed.
"""

from __future__ import annotations

import time

import httpx
import pytest

from live_server import LiveServer
from prometheus_server import PROMETHEUS, running_prometheus

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (apt-get install prometheus)")

# Prompt lengths sent (token-id prompts, so lengths are exact) and the buckets they fall in.
LENGTHS = [3, 3, 3, 12, 12, 100, 700]
EXPECTED_CUMULATIVE = {"2": 0, "4": 3, "8": 3, "16": 5, "64": 5, "128": 6, "512": 6, "1024": 7, "+Inf": 7}


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-model-len", "1024", "--num-kv-blocks", "256").wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").assert_no_leaked_blocks()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{server.port}"],
                            job_name="anneal") as url:
        yield url


def query(prom: str, promql: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params={"query": promql}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(prom: str, promql: str, predicate, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        result = query(prom, promql)
        if predicate(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_promql_sees_the_prompt_length_distribution_that_was_sent(server, prometheus):
    for i, n in enumerate(LENGTHS):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "random:tiny", "prompt": [(i * 7 + j) % 250 for j in range(n)], "max_tokens": 2,
            "ignore_eos": True,
        })
        assert r.status_code == 200, r.text
    count = wait_for(prometheus, "sum(anneal_request_prompt_tokens_count)",
                     lambda res: res and float(res[0]["value"][1]) == len(LENGTHS))
    assert float(count[0]["value"][1]) == len(LENGTHS)

    buckets = query(prometheus, "sum by (le) (anneal_request_prompt_tokens_bucket)")
    seen = {b["metric"]["le"]: float(b["value"][1]) for b in buckets}
    for le, n in EXPECTED_CUMULATIVE.items():
        key = le if le == "+Inf" else f"{float(le)}"
        assert seen[key] == n, (le, seen)
    total = query(prometheus, "sum(anneal_request_prompt_tokens_sum)")
    assert float(total[0]["value"][1]) == sum(LENGTHS)
    # The generation side and the token counters agree with what was asked for.
    gen = query(prometheus, "sum(anneal_generation_tokens_total)")
    assert float(gen[0]["value"][1]) == 2 * len(LENGTHS)
    median = query(prometheus, "histogram_quantile(0.5, sum by (le) (anneal_request_prompt_tokens_bucket))")
    assert 8 <= float(median[0]["value"][1]) <= 16  # the 4th of 7 prompts has 12 tokens


def test_promql_sees_the_plan_hash(server, prometheus):
    plan_hash = server.health()["plan_hash"]
    result = wait_for(prometheus, "anneal_plan_info == 1", lambda res: bool(res))
    assert [r["metric"]["plan_hash"] for r in result] == [plan_hash]
