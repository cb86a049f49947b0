"""The lab: where agents get candidates measured — ledger, engines, cost model and budget in one place.

Why one place: every measurement goes through the same steps (reuse a finished experiment from the
ledger, predict, prune, measure, calibrate, record), and one engine must never time two candidates
at once (they would slow each other down), so agents running concurrently queue here per tier.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from anneal.engine.plan import Plan
from anneal.agents.cost_model import CostModel
from anneal.agents.engine_client import EngineClient, EngineError
from anneal.agents.ledger import Ledger, experiment_key
from anneal.agents.space import CandidateSpace
from anneal.agents.types import (
    BenchSpec, Candidate, CheckResult, Experiment, KernelResult, Prediction, Tier, Verdict, VerifyReport,
)


class BudgetExhausted(Exception):
    """The search budget is spent: agents stop proposing."""


class EngineUnavailable(RuntimeError):
    """An engine stopped answering at all (not a rejected candidate: the process is gone or hung)."""


# Failed rows' reasons when the engine died measuring the candidate: retried on a resume the first
# time, kept the second
DIED = "the engine died measuring it"
DIED_MEASURING = f"{DIED}: "
DIED_AGAIN = f"{DIED} again: "
UNREACHABLE_LIMIT = 3  # consecutive unanswered calls before a tier is declared gone
WARMUP_SEED = 1_000_003  # warm-up benchmarks use their own inputs, never a candidate's


@dataclass
class Lab:
    ledger: Ledger
    engines: dict[str, EngineClient]  # tier -> client
    cost_model: CostModel | None = None
    deadline: float = math.inf  # time.monotonic() deadline for new fast-tier experiments
    run_id: str = ""
    traffic: dict[str, Any] | None = None
    prune_margin: float = 0.25
    on_experiment: Callable[[Experiment], None] | None = None
    space: CandidateSpace | None = None  # refusals teach it what the device cannot run
    base: Plan | None = None  # the baseline: one-op changes against it teach the cost model
    _base_ms: dict[str, float] = field(default_factory=dict)  # spec key -> baseline ms
    on_note: Callable[[str], None] | None = None
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _best: dict[str, tuple[float, Plan]] = field(default_factory=dict)
    _state_lock: threading.Lock = field(default_factory=threading.Lock)
    _inflight: dict[str, threading.Event] = field(default_factory=dict)
    _unreachable: dict[str, int] = field(default_factory=dict)
    _registered: set[tuple[str, str, str, str]] = field(default_factory=set)  # (tier, op, impl, source)
    compile_ahead: bool = False  # ask the fast engine to compile each candidate's kernels while it queues
    _no_prepare: bool = False  # the fast engine has no POST /admin/prepare
    reused: int = 0
    run: int = 0
    stopped: bool = False  # interrupted: an answer arriving now is not recorded (it may be cut short)

    def __post_init__(self) -> None:
        self._locks = {tier: threading.Lock() for tier in self.engines}

    # ---- budget --------------------------------------------------------------------------------

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def check_budget(self, deadline: float | None = None, grace_s: float = 0.0) -> None:
        """BudgetExhausted past the search's deadline, or past ``deadline`` (a later phase's own)
        when given, each moved ``grace_s`` later; always once the run is stopped."""
        if self.stopped or (self.deadline if deadline is None else deadline) + grace_s <= time.monotonic():
            raise BudgetExhausted()

    def stop(self) -> None:
        """The run is interrupted: no new fast-tier experiment starts, and none still in flight is
        recorded (its engine may be stopping under it; a resumed run measures it again)."""
        self.stopped = True
        self.deadline = float("-inf")

    # ---- measuring -----------------------------------------------------------------------------

    def best(self, spec: BenchSpec) -> tuple[float, Plan | None]:
        with self._state_lock:
            ms, plan = self._best.get(spec.key(), (math.inf, None))
        return ms, plan

    def measure(
        self, cand: Candidate, spec: BenchSpec, tier: Tier = "fast", *, prune: bool = True,
        traffic: dict[str, Any] | None = None, budgeted: bool = True, deadline: float | None = None,
        grace_s: float = 0.0,
    ) -> Experiment:
        """Measure one candidate (or reuse its finished experiment) and record it.

        Two agents asking for the same experiment at once get one measurement: the second waits.
        ``grace_s``: it may still start this long past the deadline (never once the run is stopped).
        """
        key = experiment_key(cand.hash, tier, "benchmark", spec)
        while True:
            with self._state_lock:
                ev = self._inflight.get(key)
                if ev is None:
                    self._inflight[key] = threading.Event()
                    break
            ev.wait()
        try:
            return self._measure(key, cand, spec, tier, prune, traffic, budgeted, deadline, grace_s)
        finally:
            with self._state_lock:
                self._inflight.pop(key).set()

    def _measure(self, key: str, cand: Candidate, spec: BenchSpec, tier: Tier, prune: bool,
                 traffic: dict[str, Any] | None, budgeted: bool, deadline: float | None = None,
                 grace_s: float = 0.0) -> Experiment:
        old = self.ledger.lookup(key)
        died_before = old is not None and old.verdict.reason.startswith(DIED_MEASURING)
        if old is not None and _transient(old):
            old = None  # the engine crashed or was unreachable that time: worth another try
        if old is not None:
            with self._state_lock:
                self.reused += 1
            if old.measurement is not None and old.verdict.status == "measured" and self.cost_model \
                    and spec.mode != "workload":  # a resumed run calibrates from what it reuses
                self.cost_model.observe(old.plan, spec, old.measurement)
                self._learn_delta(old.plan, spec, old.measurement.median_ms)
            self._note_best(old, spec)
            return old
        if budgeted:  # a finished experiment above is reused whatever the time
            self.check_budget(deadline, grace_s)
        pred = self._predict(cand.plan, spec)
        exp = Experiment(
            run_id=self.run_id, key=key, plan=cand.plan, plan_hash=cand.hash, tier=tier,
            kind="benchmark", agent=cand.agent, note=cand.note, spec=spec, prediction=pred,
            verdict=Verdict(status="measured"), started_at=time.time(),
            detail={"parent": cand.parent} if cand.parent else {},
        )
        best_ms, _ = self.best(spec)
        if prune and self.cost_model and spec.mode != "workload" and self.cost_model.should_prune(
            cand.plan, spec, best_ms, self.prune_margin, base=self.base, base_ms=self._base_ms.get(spec.key())
        ):
            exp = exp.model_copy(update={"verdict": Verdict(
                status="pruned",
                reason=f"predicted {pred.ms:.3f} ms ({pred.model}) > best {best_ms:.3f} ms "
                       f"x {1 + self.prune_margin:.2f}",
            )})
            return self._record(exp)
        missing = self.ensure_kernels(cand, tier)
        if missing:
            exp = exp.model_copy(update={"verdict": Verdict(status="failed", reason=missing)})
            return self._record(exp)
        if tier == "fast":
            self._prepare(cand)
        try:
            with self._locks[tier]:
                m = self.engines[tier].benchmark(cand.plan, spec, traffic if traffic is not None else (
                    self.traffic if spec.mode == "workload" else None))
        except EngineError as e:
            if e.engine_dead:
                # Recorded before the tier is given up. A resumed run retries it once (an engine bug
                # may have killed it: session 55), not twice: if the candidate's kernel lost the
                # context, it would kill every restarted engine in turn.
                why = DIED_AGAIN if died_before else DIED_MEASURING
                self._record(exp.model_copy(update={"verdict": Verdict(status="failed", reason=f"{why}{e}")}))
            self._count_unreachable(tier, e)
            self._learn_refusal(str(e))
            exp = exp.model_copy(update={"verdict": Verdict(status="failed", reason=str(e))})
            return self._record(exp)
        self._unreachable[tier] = 0
        if not (m.median_ms > 0 and math.isfinite(m.median_ms)):
            exp = exp.model_copy(update={"measurement": m, "verdict": Verdict(
                status="failed", reason=f"engine returned a non-positive time {m.median_ms}")})
            return self._record(exp)
        if self.cost_model and spec.mode != "workload":
            self.cost_model.observe(cand.plan, spec, m)
            self._learn_delta(cand.plan, spec, m.median_ms)
        exp = exp.model_copy(update={"measurement": m})
        self._note_best(exp, spec)
        return self._record(exp)

    def _prepare(self, cand: Candidate) -> None:
        """Before queueing for the fast engine, have it compile this candidate's kernels while it
        measures the other agents' candidates (engine/compile_ahead.py). Only the fast tier: the
        slow tier's workload replays are timed on the wall clock, which a compile would disturb.
        Best effort: an engine without the endpoint, or a plan it refuses, is found out anyway."""
        client = self.engines.get("fast")
        if not self.compile_ahead or self._no_prepare or not hasattr(client, "prepare"):
            return
        try:
            client.prepare([cand.plan])
        except EngineError as e:
            if e.status == 404:
                self._no_prepare = True

    def _learn_refusal(self, message: str) -> None:
        """An impl the engine says cannot run on its device leaves the search space."""
        if self.space is None:
            return
        for op, impl in _NOT_ON_DEVICE.findall(message):
            if self.space.forget(op, impl):
                if self.on_note:
                    self.on_note(f"{op}/{impl} does not run on this engine's device: dropped from the space")

    def _count_unreachable(self, tier: str, e: EngineError) -> None:
        """A 4xx/5xx is the candidate's fault; a dead engine (its CUDA context lost: every later call
        would fail, whatever the candidate) or no answer at all, repeatedly, is the engine's."""
        if e.engine_dead:
            raise EngineUnavailable(f"the {tier}-tier engine died: {e}")
        if e.status is not None:
            self._unreachable[tier] = 0
            return
        with self._state_lock:
            n = self._unreachable[tier] = self._unreachable.get(tier, 0) + 1
        if n >= UNREACHABLE_LIMIT:
            raise EngineUnavailable(f"the {tier}-tier engine stopped answering: {e}")

    def _predict(self, plan: Plan, spec: BenchSpec) -> Prediction | None:
        """The roofline's prediction, or, when every changed op's effect is known, the baseline's
        measured time times those effects (the better estimate), logged beside the measurement."""
        if self.cost_model is None or spec.mode == "workload":
            return None
        pred = self.cost_model.predict(plan, spec)
        if not math.isfinite(pred.ms):  # a split plan on hardware without interconnect figures
            return None
        base_ms = self._base_ms.get(spec.key())
        if self.base is not None and base_ms is not None and plan.hash != self.base.hash:
            est = self.cost_model.predict_from_base(self.base, plan, spec, base_ms)
            if est is not None:
                pred = pred.model_copy(update={"ms": est, "model": "baseline x one-op effects",
                                               "corrected": True})
        return pred

    def _learn_delta(self, plan: Plan, spec: BenchSpec, ms: float) -> None:
        if self.base is None or self.cost_model is None:
            return
        if plan.hash == self.base.hash:
            self._base_ms[spec.key()] = ms
        elif spec.key() in self._base_ms:
            self.cost_model.observe_delta(self.base, plan, spec, self._base_ms[spec.key()], ms)

    def _note_best(self, exp: Experiment, spec: BenchSpec) -> None:
        if exp.verdict.status != "measured" or exp.measurement is None:
            return
        with self._state_lock:
            cur = self._best.get(spec.key(), (math.inf, None))[0]
            if exp.measurement.median_ms < cur:
                self._best[spec.key()] = (exp.measurement.median_ms, exp.plan)

    def _record(self, exp: Experiment) -> Experiment:
        exp = exp.model_copy(update={"finished_at": time.time()})
        if self.stopped:
            return exp
        exp = self.ledger.record(exp)
        with self._state_lock:
            self.run += 1
        if self.on_experiment:
            self.on_experiment(exp)
        return exp

    def warm_up(self, spec: BenchSpec, traffic: dict[str, Any] | None = None) -> None:
        """One unrecorded benchmark per engine, so the first candidate does not pay start-up costs
        (allocator growth, lazy imports, caches) that the baseline measured later would not."""
        spec = spec.model_copy(update={"seed": WARMUP_SEED, "steps": 1, "warmup": 0, "repeats": 1})
        for tier, client in self.engines.items():
            with self._locks[tier]:
                try:
                    client.benchmark(None, spec, traffic if spec.mode == "workload" else None)
                except EngineError as e:
                    self._count_unreachable(tier, e)

    # ---- kernels and verification ---------------------------------------------------------------

    def ensure_kernels(self, cand: Candidate, tier: str) -> str | None:
        """The plan's agent-written kernels registered on ``tier`` first (a restarted engine, a
        resumed run or the other tier has not seen them); the first failure's reason, if any."""
        for k in cand.plan.kernels:
            if (tier, k.op, k.impl, _short_hash(k.source)) in self._registered:
                continue
            res, _ = self.register_kernel(cand.agent, k.op, k.impl, k.source, dict(k.params), tier,
                                          note=f"carried by plan {cand.hash[:10]}")
            if not res.ok:
                return f"kernel {k.op}/{k.impl} could not be registered on the {tier} tier: {res.error}"
        return None

    def register_kernel(
        self, agent: str, op: str, impl: str, source: str, params: dict[str, list[Any]],
        tier: Tier = "fast", note: str = "",
    ) -> tuple[KernelResult, Experiment]:
        """Register an agent-written kernel on ``tier``; the result (pass or reject) is a ledger row."""
        started = time.time()
        try:
            with self._locks[tier]:
                res = self.engines[tier].register_kernel(op, impl, source, params)
        except EngineError as e:
            res = KernelResult(ok=False, stage="engine", error=str(e))
        plan = Plan()
        if res.ok:
            with self._state_lock:
                self._registered.add((tier, op, impl, _short_hash(source)))
        status = "registered" if res.ok else "rejected"
        reason = "" if res.ok else f"kernel {op}/{impl} failed at {res.stage}: {res.error or ''}".strip()
        exp = Experiment(
            run_id=self.run_id, key=f"kernel|{tier}|{op}/{impl}|{_short_hash(source)}", plan=plan,
            plan_hash=plan.hash, tier=tier, kind="kernel", agent=agent, note=note,
            verdict=Verdict(status=status, reason=reason), started_at=started,
            detail={"op": op, "impl": impl, "source": source, "result": res.model_dump()},
        )
        return res, self._record(exp)

    def verify(
        self, cand: Candidate, tier: Tier = "slow", checks: list[str] | None = None, **kw: Any
    ) -> tuple[VerifyReport, Experiment]:
        """Run the engine's verification suite on a plan; failure reasons go to the ledger.

        A verdict already in the ledger for the same plan, tier and options is reused (a resumed
        run does not verify twice), unless the engine could not be reached that time.
        """
        opts = json.dumps({"checks": checks, **kw}, sort_keys=True, default=str)
        key = f"{experiment_key(cand.hash, tier, 'verify')}|{_short_hash(opts)}"
        old = self.ledger.lookup(key)
        if old is not None and "report" in old.detail:
            rep = VerifyReport.model_validate(old.detail["report"])
            if not any(c.name == "engine" for c in rep.failures()):
                return rep, old
        started = time.time()
        missing = self.ensure_kernels(cand, tier)
        try:
            if missing:
                raise EngineError(missing)
            with self._locks[tier]:
                rep = self.engines[tier].verify(cand.plan, checks, **kw)
        except EngineError as e:
            rep = VerifyReport(passed=False, plan_hash=cand.hash,
                               checks=[CheckResult(name="engine", passed=False, detail=str(e))])
        verdict = Verdict(status="verified" if rep.passed else "rejected",
                          reason="verification passed" if rep.passed else f"verification failed: {rep.reason()}")
        exp = Experiment(
            run_id=self.run_id, key=key, plan=cand.plan, plan_hash=cand.hash, tier=tier,
            kind="verify", agent=cand.agent, note=cand.note, verdict=verdict, started_at=started,
            detail={"report": rep.model_dump()},
        )
        return rep, self._record(exp)


def _transient(exp: Experiment) -> bool:
    """A failure that says nothing about the candidate: no answer, or a 5xx from the engine (but not
    the engine's second death while measuring it: that one is taken as the candidate's doing)."""
    if exp.verdict.status != "failed" or exp.verdict.reason.startswith(DIED_AGAIN):
        return False
    return not re.search(r" -> 4\d\d: ", exp.verdict.reason)


_NOT_ON_DEVICE = re.compile(r"(\w+)/([\w.-]+) does not run on")


def _short_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:12]
