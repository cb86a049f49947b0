"""The LLM kernel writer, with the real `anthropic` SDK talking to a local fake Messages API.

The fake returns canned kernel sources (a broken one, then a correct one); the engine's kernel
endpoint checks each; the rejection's reason must reach the next prompt, and only the passing
kernel becomes a candidate plan (carrying its source).
"""

from __future__ import annotations

import math

import pytest

from fake_anthropic import FakeAnthropic
from fakes.fake_engine import FakeEngine, serve_in_thread
from fakes.kernels import SILU_MUL_BROKEN, SILU_MUL_OK
from anneal.agents.board import Board
from anneal.agents.setting import make_setting
from anneal.agents.engine_client import EngineClient
from anneal.agents.lab import Lab
from anneal.agents.ledger import Ledger
from anneal.agents.llm_writer import LLMKernelWriter, api_key, extract_code, maybe_writer


def test_key_from_env_or_secret_file(tmp_path, monkeypatch):
    assert api_key({"ANTHROPIC_API_KEY": " sk-env \n"}) == "sk-env"
    f = tmp_path / "key"
    f.write_text("sk-file\n")
    assert api_key({"ANTHROPIC_API_KEY_FILE": str(f)}) == "sk-file"
    assert api_key({"ANTHROPIC_API_KEY_FILE": str(tmp_path / "missing")}) is None
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY_FILE", str(tmp_path / "missing"))
    assert maybe_writer() is None  # no key: the agent is off


def test_extract_code():
    assert extract_code("Here:\n```python\ndef build():\n    pass\n```\nbye") == "def build():\n    pass\n"
    assert extract_code("no code at all") is None


@pytest.fixture
def engine():
    srv, url = serve_in_thread(FakeEngine(token="tok"))  # FAKE numbers; kernels checked for real
    client = EngineClient(url, "tok")
    yield client
    client.close()
    srv.shutdown()


def test_writer_feeds_failures_back_and_only_passing_kernels_become_candidates(tmp_path, engine):
    fake = FakeAnthropic([
        f"A first try:\n```python\n{SILU_MUL_BROKEN}```",
        "Sorry, I cannot help with that.",
        f"Fixed:\n```python\n{SILU_MUL_OK}```",
    ])
    try:
        from anneal.engine.traffic import load_traffic

        state = engine.state()
        setting, traffic = make_setting(state, load_traffic("chat"), seed=0, max_len=256, num_requests=4)
        ledger = Ledger(tmp_path / "l.sqlite")
        lab = Lab(ledger=ledger, engines={"fast": engine})
        board = Board()
        writer = LLMKernelWriter("sk-test", base_url=fake.url, ops=["silu_and_mul"], attempts_per_op=3)
        writer.run(lab, setting, board)

        # Three real Messages API calls, each carrying the op's reference source.
        assert len(fake.requests) == 3
        first = fake.requests[0]["messages"][0]["content"]
        assert "def silu_and_mul" in first and "F.silu(gate) * up" in first
        assert "Target: cpu, dtype float32, model random:tiny" in first
        # The broken kernel's check failure reaches the second prompt; the no-code reply the third.
        second = fake.requests[1]["messages"][0]["content"]
        assert "REJECTED at check" in second and "max_rel_err" in second
        assert "REJECTED at parse" in fake.requests[2]["messages"][0]["content"]

        rows = ledger.experiments(kind="kernel")
        assert [r.verdict.status for r in rows] == ["rejected", "registered"]
        assert "max_rel_err" in rows[0].verdict.reason
        # Only the passing kernel was measured, as a plan that carries its source.
        bench = ledger.experiments(kind="benchmark")
        assert len(bench) == 1 and bench[0].agent == "llm-writer"
        plan = bench[0].plan
        assert plan.choice("silu_and_mul").impl == "llm_silu_and_mul_2"
        assert plan.kernels[0].source.strip() == SILU_MUL_OK.strip()
        assert math.isfinite(board.best_ms)
        assert "silu_and_mul/llm_silu_and_mul_2" in board.kernels
        assert board.composite(setting.base).kernels[0].impl == "llm_silu_and_mul_2"
        ledger.close()
    finally:
        fake.close()


def test_wrong_key_is_reported_not_fatal(tmp_path, engine):
    fake = FakeAnthropic([f"```python\n{SILU_MUL_OK}```"], key="sk-right")
    try:
        from anneal.engine.traffic import load_traffic

        setting, _ = make_setting(engine.state(), load_traffic("chat"), seed=0, max_len=256, num_requests=4)
        ledger = Ledger(tmp_path / "l.sqlite")
        board = Board()
        LLMKernelWriter("sk-wrong", base_url=fake.url, ops=["silu_and_mul"]).run(
            Lab(ledger=ledger, engines={"fast": engine}), setting, board)
        assert any("API call failed" in n and "401" in n for n in board.notes)
        assert len(ledger) == 0
        ledger.close()
    finally:
        fake.close()


def test_compile_runs_the_writer_when_a_key_is_set(tmp_path, monkeypatch):
    """`anneal compile` picks the writer up from the environment (key + base URL), nothing else."""
    import argparse

    from anneal.agents.compile import add_compile_args, run_compile

    fake = FakeAnthropic([f"```python\n{SILU_MUL_OK}```"] * 4)
    f_srv, f_url = serve_in_thread(FakeEngine(token="tok", layers=1))  # FAKE numbers
    s_srv, s_url = serve_in_thread(FakeEngine(token="tok", layers=4))
    try:
        monkeypatch.setenv("ANNEAL_ADMIN_TOKEN", "tok")
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
        out = tmp_path / "out"
        args = add_compile_args(argparse.ArgumentParser()).parse_args(
            ["--model", "random:tiny", "--traffic", "chat", "--budget", "20", "--out", str(out),
             "--engines", f"{f_url},{s_url}", "--quiet", "--agents", "kernel-tuner,llm-writer"])
        assert run_compile(args) == 0
        assert fake.requests, "the writer never called the Messages API"
        led = Ledger(out / "ledger.sqlite")
        kern = [r for r in led.experiments(kind="kernel") if r.agent == "llm-writer"]
        assert kern and kern[0].verdict.status == "registered"
        assert any(r.agent == "llm-writer" for r in led.experiments(kind="benchmark"))
        led.close()
    finally:
        fake.close()
        f_srv.shutdown()
        s_srv.shutdown()
