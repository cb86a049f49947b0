"""The experiment ledger: rows round-trip, WAL, concurrent writers, and a killed compile resumes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from anneal.engine.plan import OpChoice, Plan
from anneal.agents.lab import WARMUP_SEED
from anneal.agents.ledger import Ledger, experiment_key, restore
from anneal.agents.types import BenchSpec, Experiment, Measurement, Prediction, Verdict

HERE = Path(__file__).parent
PY = sys.executable


def _exp(plan: Plan, ms: float | None, status: str = "measured", reason: str = "") -> Experiment:
    spec = BenchSpec(batch_size=4)
    return Experiment(
        run_id="r1", key=experiment_key(plan.hash, "fast", "benchmark", spec), plan=plan,
        plan_hash=plan.hash, agent="test", spec=spec,
        prediction=Prediction(ms=1.5, per_op_ms={"rmsnorm": 0.5}),
        measurement=Measurement(median_ms=ms, p10_ms=ms * 0.9, p90_ms=ms * 1.2, samples_ms=[ms]) if ms else None,
        verdict=Verdict(status=status, reason=reason), started_at=time.time(),
    )


def test_round_trip_and_lookup(tmp_path):
    plan = Plan().with_ops(rmsnorm=OpChoice(impl="triton", params={"block": 128}))
    with Ledger(tmp_path / "l.sqlite") as led:
        rec = led.record(_exp(plan, 2.0))
        led.record(_exp(Plan(), None, "rejected", "kv_contamination: stale block"))
        assert rec.id == 1 and len(led) == 2
        got = led.lookup(rec.key)
        assert got.plan == plan and got.plan_hash == plan.hash
        assert got.measurement.median_ms == 2.0 and got.measurement.spread == pytest.approx(0.3)
        assert got.prediction.ms == 1.5 and got.spec == BenchSpec(batch_size=4)
        assert led.lookup("no-such-key") is None
        bad = led.experiments()[1]
        assert bad.verdict.status == "rejected" and "stale block" in bad.verdict.reason
    # The columns a person queries with sqlite3 directly are there and filled.
    db = sqlite3.connect(tmp_path / "l.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    row = db.execute("SELECT plan_hash, tier, agent, predicted_ms, median_ms, spread, verdict FROM experiments"
                     " WHERE id = 1").fetchone()
    assert row == (plan.hash, "fast", "test", 1.5, 2.0, pytest.approx(0.3), "measured")
    assert json.loads(db.execute("SELECT plan_json FROM experiments WHERE id=1").fetchone()[0])["ops"]


def test_a_snapshot_taken_mid_run_restores_every_row_and_the_budget_spent(tmp_path):
    """What a restarted coordinator resumes from: the rows still in the WAL are in it too."""
    led = Ledger(tmp_path / "l.sqlite")
    plans = [Plan().with_ops(rmsnorm=OpChoice(impl="triton", params={"block": 2 ** i})) for i in range(5, 10)]
    for i, plan in enumerate(plans):
        led.record(_exp(plan, 1.0 + i))
    led.set_meta("run_starts", {"r1": 100.0})
    data, dropped = led.snapshot()
    assert dropped == 0 and data[:2] == b"\x1f\x8b"
    led.close()
    restore(tmp_path / "new" / "ledger.sqlite", data)
    with Ledger(tmp_path / "new" / "ledger.sqlite") as again:
        assert [e.plan_hash for e in again] == [p.hash for p in plans]
        assert again.get_meta("run_starts") == {"r1": 100.0}
        assert again.lookup(experiment_key(plans[2].hash, "fast", "benchmark", BenchSpec(batch_size=4))).measurement.median_ms == 3.0


def test_a_snapshot_over_its_size_drops_the_oldest_rows_but_never_a_died_one(tmp_path):
    import random

    rnd = random.Random(0)
    with Ledger(tmp_path / "l.sqlite") as led:
        died = led.record(_exp(Plan(), None, "failed", "the engine died measuring it: device-side assert"))
        for i in range(300):  # plans that do not compress away: random tile sizes
            plan = Plan().with_ops(rmsnorm=OpChoice(impl="triton", params={"block": rnd.getrandbits(60)}))
            led.record(_exp(plan, 1.0 + i).model_copy(update={"note": f"{rnd.getrandbits(256):x}"}))
        whole, _ = led.snapshot()
        data, dropped = led.snapshot(len(whole) // 3, keep="the engine died measuring it")
        last = led.experiments()[-1]
    assert len(data) <= len(whole) // 3 and 0 < dropped < 301
    restore(tmp_path / "small.sqlite", data)
    with Ledger(tmp_path / "small.sqlite") as small:
        rows = small.experiments()
        assert len(rows) == 301 - dropped
        assert rows[0].id == died.id and rows[0].verdict.reason.startswith("the engine died")
        assert rows[-1].id == last.id  # a run's last row: what its budget spent is read from
        assert [r.id for r in rows[1:]] == sorted(r.id for r in rows[1:]) and rows[1].id > 1 + dropped // 2


def test_concurrent_writers(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    plans = [Plan().model_copy(update={"cuda_graph_batch_sizes": [i + 1]}) for i in range(40)]

    def write(chunk):
        for p in chunk:
            led.record(_exp(p, 1.0))

    threads = [threading.Thread(target=write, args=(plans[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(led) == 40
    assert {e.plan_hash for e in led} == {p.hash for p in plans}
    led.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_fake(layers: int, delay: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([PY, str(HERE / "fakes" / "fake_engine.py"), "--port", str(port), "--token", "tok",
                             "--layers", str(layers), "--delay", str(delay)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/fake/calls", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("fake engine did not start")


def _rows(path: Path) -> int:
    try:
        db = sqlite3.connect(path, timeout=5)
        n = db.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]
        db.close()
        return n
    except sqlite3.Error:
        return 0


def test_killed_compile_resumes_without_remeasuring(tmp_path):
    """SIGKILL a compile mid-search; the rerun reuses every finished experiment and measures none twice."""
    fast, fast_url = _start_fake(1, delay=0.03)  # fake numbers; the ledger logic is what is tested
    slow, slow_url = _start_fake(4, delay=0.0)
    out = tmp_path / "out"
    cmd = [PY, "-m", "anneal.agents.compile", "--model", "random:tiny", "--traffic", "chat",
           "--budget", "60", "--out", str(out), "--engines", f"{fast_url},{slow_url}", "--quiet",
           "--agents", "kernel-tuner,plan-search,scheduler-tuner"]
    env = {**os.environ, "ANNEAL_ADMIN_TOKEN": "tok"}
    try:
        run1 = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while _rows(out / "ledger.sqlite") < 25 and time.time() < deadline and run1.poll() is None:
            time.sleep(0.1)
        assert run1.poll() is None, run1.stdout.read().decode()
        os.kill(run1.pid, signal.SIGKILL)
        run1.wait()
        first = _rows(out / "ledger.sqlite")
        assert first >= 25
        assert not (out / "plan.json").exists()  # killed before the end: no artifact
        calls1 = httpx.get(fast_url + "/fake/calls").json()

        r2 = subprocess.run([*cmd[:cmd.index("--budget") + 1], "8", *cmd[cmd.index("--budget") + 2:]],
                            env=env, capture_output=True, text=True, timeout=120)
        assert r2.returncode == 0, r2.stdout + r2.stderr
        calls2 = httpx.get(fast_url + "/fake/calls").json()
        led = Ledger(out / "ledger.sqlite")
        rows = led.experiments()
        run1_id = rows[0].run_id
        recorded1 = {f"{r.plan_hash}|{r.spec.mode}|b{r.spec.batch_size}|c{r.spec.context_len}|s{r.spec.seed}"
                     for r in rows if r.run_id == run1_id and r.kind == "benchmark" and r.spec}
        # Every experiment finished before the kill was reused, not measured again; only the one
        # in flight when the process died (measured by the engine, never recorded) may run twice.
        twice = {k for k, v in calls2.items() if v > 1 and not k.endswith(f"|s{WARMUP_SEED}")}
        assert len(twice) <= 1 and not (twice & recorded1), f"re-measured after resume: {twice}"
        assert set(calls1) <= set(calls2)
        assert len(rows) > first
        assert len({r.run_id for r in rows}) == 2
        keys = [r.key for r in rows if r.kind == "benchmark"]
        assert len(keys) == len(set(keys)), "an experiment was recorded twice"
        assert (out / "plan.json").exists() and (out / "report.md").exists()
        led.close()
    finally:
        for p in (fast, slow):
            p.kill()
            p.wait()


def test_sigterm_mid_measurement_exits_at_once_and_records_nothing_half_done(tmp_path):
    """SIGTERM while a fast-tier measurement is in flight: the compile exits in a few seconds, not
    when the measurement ends (a device's time limit killed one at +20 s, session 26), and the
    abandoned measurement is not recorded: a resumed run measures it again."""
    delay = 6.0  # each fake benchmark: longer than the exit may take
    fast, fast_url = _start_fake(1, delay=delay)
    slow, slow_url = _start_fake(4, delay=0.0)
    out = tmp_path / "out"
    cmd = [PY, "-m", "anneal.agents.compile", "--model", "random:tiny", "--traffic", "chat",
           "--budget", "300", "--out", str(out), "--engines", f"{fast_url},{slow_url}", "--quiet",
           "--agents", "kernel-tuner"]
    try:
        run = subprocess.Popen(cmd, env={**os.environ, "ANNEAL_ADMIN_TOKEN": "tok"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while _rows(out / "ledger.sqlite") < 1 and time.time() < deadline and run.poll() is None:
            time.sleep(0.05)
        assert run.poll() is None, run.stdout.read().decode()
        time.sleep(1.0)  # the next measurement is now in flight on the fast tier
        rows = _rows(out / "ledger.sqlite")
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        rc = run.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in (fast, slow):
            p.kill()
            p.wait()
    assert rc == 128 + signal.SIGTERM, run.stdout.read().decode()[-2000:]
    assert took < delay - 2.0, f"exit took {took:.1f} s: it waited for the measurement in flight"
    assert _rows(out / "ledger.sqlite") == rows  # the cut-short measurement left no row


def test_resume_retries_transient_failures_but_not_refusals(tmp_path):
    """A 400 (the engine refused the plan) is final; no answer or a 5xx is retried on resume."""
    from anneal.agents.lab import Lab
    from anneal.agents.types import Candidate

    spec = BenchSpec()
    plans = [Plan().model_copy(update={"cuda_graph_batch_sizes": [i]}) for i in (1, 2, 3)]
    reasons = ["fast-tier engine: POST /admin/benchmark -> 400: x/y does not run on cpu",
               "fast-tier engine: POST /admin/benchmark -> 500: CUDA error",
               "fast-tier engine: POST /admin/benchmark failed: connection refused"]
    with Ledger(tmp_path / "l.sqlite") as led:
        for p, why in zip(plans, reasons):
            led.record(Experiment(key=experiment_key(p.hash, "fast", "benchmark", spec), plan=p,
                                  plan_hash=p.hash, spec=spec, verdict=Verdict(status="failed", reason=why)))
        srv, url = _fake_in_thread()
        try:
            from anneal.agents.engine_client import EngineClient

            with EngineClient(url, "tok") as c:
                lab = Lab(ledger=led, engines={"fast": c})
                got = [lab.measure(Candidate(plan=p, agent="t"), spec) for p in plans]
        finally:
            srv.shutdown()
    assert got[0].verdict.status == "failed" and lab.reused == 1
    assert [g.verdict.status for g in got[1:]] == ["measured", "measured"]


def _fake_in_thread():
    from fakes.fake_engine import FakeEngine, serve_in_thread

    return serve_in_thread(FakeEngine(token="tok"))


def test_a_rerun_spends_what_the_earlier_runs_left_of_the_budget(tmp_path):
    """The budget counts over the runs in one --out: a finished compile rerun with the same budget
    has none left, so it measures nothing new on the fast tier (everything it asks is reused) and
    says what the earlier run spent; raised, the budget buys more search."""
    from anneal.agents.compile import budget_spent

    fast, fast_url = _start_fake(1, delay=0.02)
    slow, slow_url = _start_fake(4, delay=0.0)
    out = tmp_path / "out"

    def compile_(budget: str) -> subprocess.CompletedProcess:
        cmd = [PY, "-m", "anneal.agents.compile", "--model", "random:tiny", "--traffic", "chat", "--budget", budget,
               "--out", str(out), "--engines", f"{fast_url},{slow_url}",
               "--agents", "kernel-tuner,plan-search,scheduler-tuner"]
        r = subprocess.run(cmd, env={**os.environ, "ANNEAL_ADMIN_TOKEN": "tok"}, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    def new_fast_measurements(before: dict, after: dict) -> set[str]:
        return {k for k, n in after.items() if n > before.get(k, 0) and not k.endswith(f"|s{WARMUP_SEED}")}

    try:
        compile_("4")
        with Ledger(out / "ledger.sqlite") as led:
            spent1 = budget_spent(led)
        assert 4 * 0.55 <= spent1 <= 60, spent1  # at least the search share, at most the whole run
        calls1 = httpx.get(fast_url + "/fake/calls").json()

        r2 = compile_("4")
        calls2 = httpx.get(fast_url + "/fake/calls").json()
        assert not new_fast_measurements(calls1, calls2), "a rerun with no budget left measured new candidates"
        assert f"{spent1:.0f} of the 4 s budget spent by earlier runs" in r2.stderr, r2.stderr[-2000:]

        compile_("40")
        calls3 = httpx.get(fast_url + "/fake/calls").json()
        assert new_fast_measurements(calls2, calls3), "a raised budget searched no further"
        with Ledger(out / "ledger.sqlite") as led:
            assert len({e.run_id for e in led.experiments()}) >= 2
            assert budget_spent(led) > spent1
    finally:
        for p in (fast, slow):
            p.kill()
            p.wait()


def test_no_reachable_cluster_means_a_fresh_ledger_and_unsaved_checkpoints_not_a_failed_compile(tmp_path, monkeypatch, capsys):
    """`--report-to` with the API server down: the coordinator starts a fresh ledger and goes on
    searching; its checkpoints fail with a message each (a status write must never end a search)."""
    from anneal.agents.job_report import LedgerCheckpoints, restore_ledger
    from anneal.operator import progress

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(progress, "_client", None)
    path = tmp_path / "out" / "ledger.sqlite"
    assert restore_ledger("ml/job1", path) is None and not path.exists()
    assert "no ledger from ml/job1" in capsys.readouterr().err
    with Ledger(path) as led:
        led.record(_exp(Plan(), 1.0))
        saver = LedgerCheckpoints("ml/job1", led, every_s=3600)
        assert saver.save() is False
        saver.close()
        assert len(led) == 1
    assert "ledger checkpoint to ml/job1 failed" in capsys.readouterr().err
