"""bench/serving.py: statistics, and a real sweep against a live server plus the HF baseline."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serving as bench  # noqa: E402

from live_server import LiveServer  # noqa: E402


def test_percentiles_interpolate_and_ignore_missing_values():
    xs = [float(x) for x in range(1, 101)]
    assert bench.percentile(xs, 50) == pytest.approx(50.5)
    assert bench.percentile(xs, 99) == pytest.approx(99.01)
    assert bench.percentile([3.0, math.nan], 90) == 3.0
    assert math.isnan(bench.percentile([], 50))
    d = bench.dist([0.001, 0.002, 0.003])
    assert d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0)


def test_level_summary_counts_failures_and_derives_tpot():
    ok = bench.RequestResult(ok=True, prompt_tokens=10, output_tokens=11, ttft=0.1, latency=1.1,
                             itls=[0.1] * 10)
    failed = bench.RequestResult(ok=False, error="HTTP 429")
    s = bench.summarize_level([ok, ok, failed], duration=2.0, num_gpus=2)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 429"])
    assert s["output_throughput_per_gpu"] == pytest.approx(22 / 2.0 / 2)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["tokens_per_s_per_user"] == pytest.approx(10.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)


def test_pair_and_list_parsing_reject_nonsense():
    assert bench.parse_pairs("1024/1024, 8192/1024") == [(1024, 1024), (8192, 1024)]
    for bad in ("1024", "a/b", "0/5"):
        with pytest.raises(Exception, match="ISL/OSL"):
            bench.parse_pairs(bad)
    with pytest.raises(Exception):
        bench.parse_ints("1,0")


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-model-len", "512", "--num-kv-blocks", "256").wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").assert_no_leaked_blocks()


def run_bench(tmp_path, *argv):
    code = bench.main([*argv, "--out", str(tmp_path), "--name", "t", "--vocab-size", "512"])
    files = sorted(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".json", ".png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return code, json.loads(files[0].read_text())


@pytest.mark.slow
def test_sweep_against_a_live_server_and_the_hf_baseline(server, tmp_path):
    code, report = run_bench(
        tmp_path, "--base-url", server.base_url, "--pairs", "24/12,64/8", "--concurrency", "1,3",
        "--hf-baseline", "--hf-device", "cpu",
    )
    assert code == 0
    rows = report["results"]
    assert [(r["system"], r["isl"], r["osl"], r["concurrency"]) for r in rows] == [
        ("anneal", 24, 12, 1), ("anneal", 24, 12, 3), ("anneal", 64, 8, 1), ("anneal", 64, 8, 3),
        ("hf-static", 24, 12, 1), ("hf-static", 24, 12, 3), ("hf-static", 64, 8, 1), ("hf-static", 64, 8, 3),
    ]
    for r in rows:
        n = r["requests"]
        assert r["completed"] == n and r["failed"] == 0
        assert n == (max(2 * r["concurrency"], 4) if r["system"] == "anneal" else r["concurrency"])
        assert r["input_tokens"] == n * r["isl"] and r["output_tokens"] == n * r["osl"]
        assert r["output_throughput_per_gpu"] > 0 and r["tokens_per_s_per_user"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d = r[metric]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"], (metric, d)
        assert r["ttft_ms"]["p50"] <= r["e2el_ms"]["p50"]
    assert report["server"]["model"] == "random:tiny"


def test_text_prompts_report_the_servers_token_counts(server, tmp_path):
    code, report = run_bench(tmp_path, "--base-url", server.base_url, "--pairs", "20/3",
                             "--concurrency", "2", "--prompt-mode", "text")
    (row,) = report["results"]
    assert code == 0 and row["completed"] == 4
    assert row["input_tokens"] > 4 * 20  # words are several byte-level tokens each


def test_traffic_preset_workload(server, tmp_path):
    code, report = run_bench(tmp_path, "--base-url", server.base_url, "--traffic", "chat",
                             "--concurrency", "2", "--min-requests", "3", "--extra-body",
                             '{"ignore_eos": true}')
    (row,) = report["results"]
    assert code == 0 and row["traffic"] == "chat" and row["completed"] == 4
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0


def test_requests_the_server_refuses_are_counted_as_failures(server, tmp_path):
    code, report = run_bench(tmp_path, "--base-url", server.base_url, "--pairs", "8/2",
                             "--concurrency", "1", "--extra-body", '{"n": 2}', "--no-warmup")
    (row,) = report["results"]
    assert code == 1
    assert row["completed"] == 0 and row["failed"] == 4
    assert row["errors"] and row["errors"][0].startswith("HTTP 400")
