"""The compiler against real `anneal serve` processes (CPU, random:tiny): admin client, planted
faulty kernels rejected with their reason, the LLM writer's kernels through the real checks, and
`anneal compile` end to end as the README runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from fake_anthropic import FakeAnthropic
from fakes.kernels import EVASIVE, FAULTY, LOSES_THE_DEVICE, SILU_MUL_BROKEN, SILU_MUL_OK
from anneal.engine.plan import CompiledPlan, KernelSource, OpChoice, Plan
from anneal.agents.lab import Lab
from anneal.agents.ledger import Ledger
from anneal.agents.local_engines import LocalEngines
from anneal.agents.types import BenchSpec, Candidate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("anneal.engine.admin") is None, reason="the engine's admin API is not built yet"
)

# The verification check that must fail for each planted fault, and a word its reason must carry.
CAUGHT_BY = {
    "stale_kv_block": ("kv_contamination", "recycled blocks"),
    "wrong_at_batch": ("batch_invariance", "relative error"),
    "nan_past_context": ("quality", "non-finite"),
    "side_stream": ("quality", "non-finite"),
    "nondeterministic": ("determinism", "nondeterministic"),
}
CASES = [
    pytest.param(f, kind)
    for kind, faults in (("plain", FAULTY), ("evasive", EVASIVE)) for f in sorted(faults)
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("engines")
    local = LocalEngines("random:tiny", out, fast_layers=1, device="cpu")
    clients = local.start(timeout_s=300)
    yield clients
    for c in clients.values():
        c.close()
    local.stop()


def test_admin_client_against_a_real_engine(engines):
    fast, slow = engines["fast"], engines["slow"]
    st = fast.state()
    assert st.model == "random:tiny" and st.num_layers_loaded == 1
    assert slow.state().num_layers_loaded == slow.state().num_layers_total
    assert "reference" in st.variants["attention_decode"]
    m = fast.benchmark(None, BenchSpec(batch_size=2, context_len=32, steps=2, warmup=1, repeats=3))
    assert m.median_ms > 0 and m.p10_ms <= m.median_ms <= m.p90_ms
    rep = slow.verify(Plan(), num_prompts=2, steps=4)
    assert rep.passed, rep.reason()


@pytest.fixture(scope="module")
def reference_verifies(engines):
    """Precondition: the reference plan passes verification, so a rejection means the kernel."""
    rep = engines["slow"].verify(Plan())
    assert rep.passed, f"the engine's verification rejects the reference plan itself: {rep.reason()}"
    return rep


@pytest.mark.parametrize("fault,kind", CASES)
def test_planted_faulty_kernel_is_rejected_with_its_reason(fault, kind, engines, reference_verifies, tmp_path):
    """Plain faults may already fail the isolated kernel check; evasive ones (honest for the
    first calls) pass it, and the engine's verification suite must catch them by name."""
    slow = engines["slow"]
    before = slow.state()
    op, source = (FAULTY if kind == "plain" else EVASIVE)[fault]
    impl = f"planted_{kind}_{fault}"
    led = Ledger(tmp_path / "ledger.sqlite")
    lab = Lab(ledger=led, engines=engines)
    res, kexp = lab.register_kernel("test", op, impl, source, {}, tier="slow")
    if kind == "evasive" or fault == "nondeterministic":
        assert res.ok, f"the isolated check was expected to miss this one: {res.error}"
    if res.ok:
        plan = Plan().with_ops(**{op: OpChoice(impl=impl)})
        plan = plan.model_copy(update={"kernels": [KernelSource(op=op, impl=impl, source=source)]})
        rep, row = lab.verify(Candidate(plan=plan, agent="test", note=fault), "slow")
        assert not rep.passed
        check, word = CAUGHT_BY[fault]
        failed = {c.name: c.detail for c in rep.failures()}
        assert check in failed, failed
        assert word in failed[check] and f"{check}: " in row.verdict.reason, row.verdict.reason
    else:
        row = kexp
        assert res.stage in ("check", "crash", "timeout") and res.error
    # The rejection and its reason are in the ledger.
    stored = next(r for r in led.experiments() if r.id == row.id)
    assert stored.verdict.status == "rejected" and stored.verdict.reason == row.verdict.reason
    assert stored.verdict.reason
    led.close()
    # The engine keeps serving its previous plan.
    after = slow.state()
    assert after.plan_hash == before.plan_hash
    m = slow.benchmark(None, BenchSpec(batch_size=1, context_len=16, steps=1, warmup=0, repeats=1))
    assert m.median_ms > 0


def test_llm_writer_kernels_pass_the_real_checks(engines, tmp_path):
    """A wrong kernel fails the isolated check, a nondeterministic one the verification suite;
    both reasons go back to the model; only the correct one is timed."""
    from anneal.engine.traffic import load_traffic
    from anneal.agents.board import Board
    from anneal.agents.setting import make_setting
    from anneal.agents.llm_writer import LLMKernelWriter

    _, nondet = FAULTY["nondeterministic"]
    fake = FakeAnthropic([f"```python\n{SILU_MUL_BROKEN}```", f"```python\n{nondet}```",
                          f"```python\n{SILU_MUL_OK}```"])
    try:
        fast = engines["fast"]
        setting, _ = make_setting(fast.state(), load_traffic("chat"), seed=0, max_len=64,
                                  num_requests=2, quick=True)
        led = Ledger(tmp_path / "l.sqlite")
        board = Board()
        LLMKernelWriter("sk-test", base_url=fake.url, ops=["silu_and_mul"], attempts_per_op=3).run(
            Lab(ledger=led, engines=engines), setting, board)
        kern = led.experiments(kind="kernel")
        assert [r.verdict.status for r in kern] == ["rejected", "registered", "registered"], [r.verdict for r in kern]
        ver = led.experiments(kind="verify")
        assert [r.verdict.status for r in ver] == ["rejected", "verified"]
        assert "determinism" in ver[0].verdict.reason
        prompts = [r["messages"][0]["content"] for r in fake.requests]
        assert "REJECTED at check" in prompts[1]
        assert "REJECTED at verify" in prompts[2] and "determinism" in prompts[2]
        bench = led.experiments(kind="benchmark")
        assert len(bench) == 1 and bench[0].verdict.status == "measured"
        assert bench[0].plan.choice("silu_and_mul").impl == "llm_silu_and_mul_2"
        led.close()
    finally:
        fake.close()


def test_an_engine_that_loses_its_device_context_exits_and_the_lab_says_so(tmp_path):
    """A CUDA error that poisons the process (a kernel's out-of-bounds index: a device-side assert)
    fails every later call. The engine must not go on answering 500 to each candidate, the compile
    blaming every one of them (session 55: six minutes, a 1.2 GB log): its admin API answers 503
    "engine_dead", the server exits 1 for a new process, and the lab stops on the tier."""
    from anneal.agents.lab import EngineUnavailable

    local = LocalEngines("random:tiny", tmp_path / "engines", fast_layers=None, device="cpu")
    clients = local.start(timeout_s=300)
    led = Ledger(tmp_path / "ledger.sqlite")
    try:
        lab = Lab(ledger=led, engines=clients)
        res, _ = lab.register_kernel("test", "silu_and_mul", "loses_the_device", LOSES_THE_DEVICE, {}, tier="slow")
        assert res.ok, res.error  # honest for its first calls: the isolated check passes it
        plan = Plan().with_ops(silu_and_mul=OpChoice(impl="loses_the_device"))
        plan = plan.model_copy(update={"kernels": [KernelSource(op="silu_and_mul", impl="loses_the_device",
                                                                source=LOSES_THE_DEVICE)]})
        spec = BenchSpec(batch_size=2, context_len=16, steps=4)
        with pytest.raises(EngineUnavailable, match="slow-tier engine died: .*device-side assert triggered"):
            lab.measure(Candidate(plan=plan, agent="test"), spec, tier="slow")
        row = next(r for r in led.experiments() if r.kind == "benchmark")
        assert row.verdict.reason.startswith("the engine died measuring it: ")
        proc = local.engines["slow"].proc
        assert proc.wait(timeout=60) == 1
        assert "the engine is dead" in local.engines["slow"].log.read_text()
        # A resumed run on a new engine tries the candidate once more (an engine bug may have killed
        # the first); a second death is taken as the candidate's, and a third run reuses that row
        # instead of killing its engine in turn.
        for c in clients.values():
            c.close()
        clients = local.start(timeout_s=300)
        with pytest.raises(EngineUnavailable, match="died"):
            Lab(ledger=led, engines=clients).measure(Candidate(plan=plan, agent="test"), spec, tier="slow")
        again = Lab(ledger=led, engines=clients).measure(Candidate(plan=plan, agent="test"), spec, tier="slow")
        assert again.verdict.reason.startswith("the engine died measuring it again: ")
        assert sum(r.kind == "benchmark" for r in led.experiments()) == 2
    finally:
        led.close()
        for c in clients.values():
            c.close()
        local.stop()


def test_anneal_compile_on_tiny_cpu_as_the_readme_runs_it(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("ANTHROPIC_API_KEY", "ANNEAL_ADMIN_TOKEN")}
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from anneal.cli import main; sys.exit(main())", "compile",
         "--model", "random:tiny", "--traffic", "chat", "--budget", "90", "--out", str(out), "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    wall = time.time() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert wall < 240, f"took {wall:.0f}s for a 90 s budget"
    cp = CompiledPlan.model_validate_json((out / "plan.json").read_text())
    assert cp.verification["passed"] is True
    assert any(g.metric == "tokens_per_s" for g in cp.gains)
    assert (out / "report.md").exists() and (out / "search_progress.png").exists()
    report = (out / "report.md").read_text()
    assert "Where the replay's time went" in report and "decode-only steps" in report
    assert "Headroom: the replay at the roofline" in report and "most tokens/s any plan could add" in report
    led = Ledger(out / "ledger.sqlite")
    assert len(led) >= 5
    led.close()
    # Both engines it started are gone.
    started = json.loads((out / "engines.json").read_text())
    assert set(started) == {"fast", "slow"}
    assert started["fast"]["args"][:1] == ["serve"] and "--layers" in started["fast"]["args"]  # how each was started
    for info in started.values():
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)


def test_a_compile_restarts_an_engine_that_died_and_resumes(tmp_path):
    """The fast-tier engine killed mid-search (as a lost CUDA context ends it): the compile starts
    its engines again, resumes from the ledger on what is left of the budget and writes its plan."""
    import signal

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("ANTHROPIC_API_KEY", "ANNEAL_ADMIN_TOKEN")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "anneal.agents.compile", "--model", "random:tiny", "--traffic", "chat",
         "--budget", "60", "--out", str(out), "--device", "cpu"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:  # killed at the search's first experiment
            if (out / "ledger.sqlite").exists() and len(Ledger(out / "ledger.sqlite")) >= 1:
                break
            time.sleep(0.02)
        first = json.loads((out / "engines.json").read_text())
        os.kill(first["fast"]["pid"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = output.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "restarting the engines and resuming from the ledger (1 of 2" in text, text[-3000:]
    assert (out / "plan.json").exists()
    led = Ledger(out / "ledger.sqlite")
    assert len(led.get_meta("runs")) == 2  # the restart resumed as a second run on the same ledger
    led.close()
    again = json.loads((out / "engines.json").read_text())
    assert again["fast"]["pid"] != first["fast"]["pid"]
    log = (out / "engine-fast.log").read_text()
    assert log.count("starting the fast-tier engine") == 2  # the dead engine's log kept before the new one's


def test_sigterm_stops_the_engines_the_compile_started(tmp_path):
    """A compile stopped with SIGTERM (Ctrl-C'd job, evicted pod) takes its engines down with it."""
    import signal

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("ANTHROPIC_API_KEY", "ANNEAL_ADMIN_TOKEN")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "anneal.agents.compile", "--model", "random:tiny", "--traffic", "chat",
         "--budget", "600", "--out", str(out), "--device", "cpu", "--quiet"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if (out / "ledger.sqlite").exists() and len(Ledger(out / "ledger.sqlite")) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        started = json.loads((out / "engines.json").read_text())
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + signal.SIGTERM
    for info in started.values():
        with pytest.raises(ProcessLookupError):
            os.kill(info["pid"], 0)
    assert not (out / "plan.json").exists()
