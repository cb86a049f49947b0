"""SIGTERM drains a live server: in-flight requests finish (or are aborted after the timeout), exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from live_server import LiveServer

BODY = {"model": "random:tiny", "prompt": "bye", "ignore_eos": True, "stream": True}


def stream_in_thread(server, max_tokens, started: threading.Event, result: dict):
    def run():
        chunks = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={**BODY, "max_tokens": max_tokens}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        started.set()
        except httpx.HTTPError as e:
            result["error"] = e
        result["chunks"] = chunks
        started.set()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_sigterm_lets_in_flight_requests_finish_and_exits_0():
    server = LiveServer("--shutdown-timeout", "30", cli=True).wait_ready()  # `anneal serve`
    try:
        started, result = threading.Event(), {}
        t = stream_in_thread(server, 200, started, result)
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    chunks = result["chunks"]
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "error" not in result
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def test_sigterm_aborts_what_outlives_the_shutdown_timeout():
    server = LiveServer("--shutdown-timeout", "1", "--max-model-len", "4096").wait_ready()
    try:
        started, result = threading.Event(), {}
        t = stream_in_thread(server, 4000, started, result)
        assert started.wait(30)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
        t.join(30)
    finally:
        server.stop()
    assert "[DONE]" not in result["chunks"]  # cut off, not completed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "random:tiny", "--plan", "/nonexistent/plan.json"], "No such file"),
        (["--model", "random:no-such-preset"], "unknown random preset"),
        (["--model", "random:tiny", "--max-num-seqs", "0"], "max_num_seqs"),
    ],
    ids=["missing-plan", "unknown-preset", "bad-knob"],
)
def test_bad_flags_fail_fast_with_a_message_and_exit_2(args, message):
    import subprocess
    import sys
    from pathlib import Path

    anneal = str(Path(sys.executable).with_name("anneal"))
    r = subprocess.run([anneal, "serve", *args, "--device", "cpu", "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot start" in r.stderr and message in r.stderr


def test_the_engine_is_built_off_the_main_thread_and_its_errors_reach_the_caller(monkeypatch):
    """The event loop's thread must never run torch's CPU thread pool (server.py: the engine's own
    thread then stepped ~2.3x slower on the CPU); a failed load is still the caller's error."""
    from anneal.engine import server

    built_on = []
    monkeypatch.setattr(server, "build_engine", lambda args: built_on.append(threading.current_thread()) or "engine")
    assert server.build_engine_off_the_main_thread(None) == "engine"
    assert built_on and built_on[0] is not threading.main_thread()

    def broken(args):
        raise OSError("no such model folder")

    monkeypatch.setattr(server, "build_engine", broken)
    with pytest.raises(OSError, match="no such model folder"):
        server.build_engine_off_the_main_thread(None)


@pytest.mark.parametrize("flag, value, message", [
    ("--port", "99999", "port 99999 is outside 0-65535"),
    ("--admin-port", "-1", "port -1 is outside 0-65535"),
    ("--port", "http", "not a port number: 'http'"),
])
def test_a_bad_port_is_a_usage_error_not_a_bind_traceback(flag, value, message, capsys):
    import argparse

    from anneal.engine.server import add_serve_args

    with pytest.raises(SystemExit) as exit_:
        add_serve_args(argparse.ArgumentParser()).parse_args(["--model", "random:tiny", flag, value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert add_serve_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--port", "0"]).port == 0


def test_the_log_says_where_the_start_went_and_on_cuda_which_kernel_cache(monkeypatch, tmp_path):
    """A pod's log shows whether a kept Triton cache (spec.kernelCache) works: a short warm-up."""
    from anneal.engine.server import startup_summary

    server = LiveServer("--log-level", "info").wait_ready()
    try:
        line = next(ln for ln in server.logs().splitlines() if "engine ready in" in ln)
    finally:
        server.stop()
    assert "weights" in line and "warm-up" in line and "graphs" in line and "Triton" not in line  # CPU engine
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "kernels"))
    phases = {"config_s": 0.5, "weights_s": 11.0, "kv_cache_s": 0.4, "warmup_s": 4.7, "capture_s": 0.2}
    line = startup_summary(phases, "cuda")
    assert line.startswith("engine ready in 16.8 s: weights 11.0 s, KV cache 0.4 s, warm-up 4.7 s, graphs 0.2 s")
    assert str(tmp_path / "kernels") in line


def test_an_unwritable_kernel_cache_costs_the_cache_not_the_start(monkeypatch, tmp_path, caplog):
    """Triton raises on its first compile into a folder it cannot create or write; the engine moves to
    a folder of its own first and says why (checked before a CUDA engine is built)."""
    import os

    from anneal.engine import kernel_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "kernels"))
    assert kernel_cache.ensure_writable() == str(tmp_path / "kernels") and (tmp_path / "kernels").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kernels") and not caplog.records
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a-file" / "triton"))  # not a folder it can make
    with caplog.at_level("WARNING", logger="anneal.kernel_cache"):
        used = kernel_cache.ensure_writable()
    assert used != str(tmp_path / "a-file" / "triton") and os.path.isdir(used)
    assert os.environ["TRITON_CACHE_DIR"] == used == kernel_cache.cache_dir()
    assert "cannot be written" in caplog.text and "a-file" in caplog.text
    os.rmdir(used)
