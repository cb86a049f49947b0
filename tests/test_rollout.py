"""The plan rollout state machine (anneal.operator.rollout), tick by tick, on the CPU.

Each test drives `step` the way the timer does: the engines' reported plan hashes are the world,
ServePlan/AcceptPlan intents are carried out by a tiny fake world below (it just flips the pod's
hash or the configured hash), and canary analyses are given as gate results.
"""

from __future__ import annotations

from anneal.operator import rollout as ro
from anneal.operator.api.inference_deployment import CompilationPolicy, RolloutStatus
from anneal.operator.canary_gates import Analysis, GateResult

OLD, NEW = "a" * 16, "b" * 16
PASS = Analysis((GateResult("throughput", "pass", 10, 10, 8), GateResult("error-rate", "pass", 0, 0, 0.01)))
FAIL = Analysis((GateResult("throughput", "fail", 2, 10, 8, "canary 2 < 8"), GateResult("error-rate", "pass", 0, 0, 0.01)))
HOLD = Analysis((GateResult("throughput", "missing", message="no data for the canary"),))


def policy(**kw) -> CompilationPolicy:
    base = {"mode": "auto", "rollout": {"canary": {"initialDelay": "30s", "interval": "10s", "iterations": 2, "failureLimit": 2}}}
    for k, v in kw.items():
        if k == "rollout":
            base["rollout"] = {**base["rollout"], **v}
        else:
            base[k] = v
    return CompilationPolicy.model_validate(base)


class World:
    """Three replicas serving OLD; a proposal NEW from the drift job."""

    def __init__(self, replicas: int = 3, admin: bool = True):
        self.pods = {f"llama-x-{i}": OLD for i in range(replicas)}
        self.admin = admin
        self.configured = OLD
        self.refuse: set[str] = set()
        self.now = 1_000_000.0
        self.served: list[tuple[str, str]] = []
        self.accepted: list[str] = []

    def view(self, analysis=None, errors=None, proposal=True, **kw) -> ro.View:
        pods = tuple(ro.Pod(n, True, h, self.admin) for n, h in sorted(self.pods.items()))
        return ro.View(now=self.now, configured_hash=self.configured, pods=pods,
                       proposal=ro.Proposal(NEW, "llama-drift-1", 1.4, "llama-drift-1-result") if proposal else None,
                       job="llama-drift-1", analysis=analysis, apply_errors=errors or {}, **kw)

    def run(self, st, pol, **kw) -> ro.Step:
        """One tick: step, carry out the intents, re-step on refusals (as the handler does)."""
        analysis = kw.pop("analysis", None)
        if analysis is not None:
            assert ro.analysis_due(st or RolloutStatus(), pol, self.now), "analysis given when not due"
        s = ro.step(st, pol, self.view(analysis=analysis, **kw))
        errors = self.execute(s)
        if errors:
            s = ro.step(s.status, pol, self.view(errors=errors, **kw))
            self.execute(s)
        return s

    def execute(self, s: ro.Step) -> dict[str, str]:
        errors = {}
        for a in s.actions:
            if isinstance(a, ro.ServePlan):
                if a.pod in self.refuse and a.plan_hash == NEW:
                    errors[a.pod] = "HTTP 400: plan rejected"
                else:
                    self.pods[a.pod] = a.plan_hash
                    self.served.append((a.pod, a.plan_hash))
            elif isinstance(a, ro.AcceptPlan):
                self.accepted.append(a.plan_hash)
                self.configured = a.plan_hash  # the deployment reconcile picks the ConfigMap up
        return errors


def events(step: ro.Step) -> list[str]:
    return [a.reason for a in step.actions if isinstance(a, ro.Event)]


def start_canary(w: World, pol: CompilationPolicy) -> RolloutStatus:
    s = w.run(None, pol)
    assert s.status.state == "Canary" and s.status.canary_pod == "llama-x-0" and s.status.in_place
    assert "CanaryStarted" in events(s)
    assert w.pods == {"llama-x-0": NEW, "llama-x-1": OLD, "llama-x-2": OLD}  # ONE replica, in place
    w.now += 5
    s = w.run(s.status, pol)
    assert s.status.canary_since is not None and "CanaryServing" in events(s)
    return s.status


def test_canary_waits_initial_delay_then_promotes_after_iterations_and_accepts():
    w, pol = World(), policy()
    st = start_canary(w, pol)
    w.now += 20
    assert not ro.analysis_due(st, pol, w.now)  # 25 s < initialDelay 30 s
    w.now += 15
    assert ro.analysis_due(st, pol, w.now)
    st = w.run(st, pol, analysis=PASS).status
    assert st.state == "Canary" and st.analyses_passed == 1 and st.gates[0].name == "throughput"
    w.now += 5
    assert not ro.analysis_due(st, pol, w.now)  # interval 10 s
    w.now += 5
    s = w.run(st, pol, analysis=PASS)
    assert s.status.state == "Promoting" and "CanaryPassed" in events(s)
    assert set(w.pods.values()) == {NEW} and w.configured == OLD  # in place first, accepted after
    w.now += 10
    s = w.run(s.status, pol)
    assert w.accepted == [NEW] and s.status.state == "Promoting"
    w.now += 10
    s = w.run(s.status, pol)
    assert s.status.state == "Succeeded" and "RolloutSucceeded" in events(s)
    assert "all 3 replicas serve plan" in s.status.message and s.status.finished_at
    # settled: the same proposal (now configured) starts nothing
    assert ro.step(s.status, pol, w.view()).actions == []


def test_failed_analyses_roll_the_canary_back_and_the_plan_is_never_retried():
    w, pol = World(), policy()
    st = start_canary(w, pol)
    w.now += 31
    s = w.run(st, pol, analysis=FAIL)
    assert s.status.state == "Canary" and s.status.analyses_failed == 1 and "CanaryAnalysisFailed" in events(s)
    w.now += 10
    s = w.run(s.status, pol, analysis=FAIL)
    assert s.status.state == "RollingBack" and "RollbackStarted" in events(s)
    assert w.pods["llama-x-0"] == OLD  # the old plan re-applied to the canary, in place
    w.now += 10
    s = w.run(s.status, pol)
    assert s.status.state == "RolledBack" and NEW in s.status.rejected_plans and "RolledBack" in events(s)
    assert w.accepted == [] and w.configured == OLD
    w.now += 100
    again = w.run(s.status, pol)
    assert again.status.state == "RolledBack" and again.actions == []  # same plan: not retried


def test_missing_metrics_hold_neither_promote_nor_roll_back():
    w, pol = World(), policy()
    st = start_canary(w, pol)
    w.now += 31
    for i in range(10):
        s = w.run(st, pol, analysis=HOLD)
        st = s.status
        assert st.state == "Canary" and st.analyses_passed == 0 and st.analyses_failed == 0
        assert st.analyses_inconclusive == i + 1 and st.message.startswith("holding")
        w.now += 10
    assert w.pods["llama-x-0"] == NEW and w.accepted == []


def test_a_failure_among_missing_metrics_still_counts():
    mixed = Analysis((GateResult("throughput", "missing"), GateResult("ttft-p90", "fail", 2.0, 1.0, 1.1, "slow")))
    assert mixed.verdict == "failed"
    assert Analysis(()).verdict == "inconclusive"


def test_preview_and_pinned_plans_are_proposed_never_applied():
    for pol in (policy(mode="preview"), policy(pinnedPlan={"inline": {}})):
        w = World()
        s = w.run(None, pol)
        assert s.status.state == "Proposed" and "PlanProposed" in events(s)
        assert not [a for a in s.actions if isinstance(a, (ro.ServePlan, ro.AcceptPlan))]
        s2 = w.run(s.status, pol)
        assert s2.actions == [] and s2.status == s.status  # no status churn, no repeated event
        assert set(w.pods.values()) == {OLD}
    # switching preview -> auto rolls out the proposed plan
    w = World()
    s = w.run(None, policy(mode="preview"))
    s = w.run(s.status, policy())
    assert s.status.state == "Canary"


def test_paused_starts_nothing_and_freezes_a_canary():
    w, pol = World(), policy(paused=True)
    s = w.run(None, pol)
    assert s.status.state == "Idle" and s.actions == [] and "paused" in s.status.message
    st = start_canary(w, policy())
    w.now += 100
    assert not ro.analysis_due(st, pol, w.now)
    s = w.run(st, pol)
    assert s.status.state == "Canary" and s.actions == [] and w.pods["llama-x-0"] == NEW


def test_abort_rollout_rolls_the_canary_back():
    w = World()
    st = start_canary(w, policy())
    s = w.run(st, policy(abortRollout=True))
    assert s.status.state == "RollingBack" and w.pods["llama-x-0"] == OLD
    s = w.run(s.status, policy(abortRollout=True))
    assert s.status.state == "RolledBack" and NEW in s.status.rejected_plans


def test_a_canary_that_refuses_the_plan_fails_the_rollout():
    w, pol = World(), policy()
    w.refuse = {"llama-x-0"}
    s = w.run(None, pol)
    assert s.status.state == "Failed" and "refused plan" in s.status.message
    assert "CanaryApplyFailed" in events(s) and NEW in s.status.rejected_plans
    assert set(w.pods.values()) == {OLD}


def test_a_canary_lost_after_serving_is_a_rollback():
    w, pol = World(), policy()
    st = start_canary(w, pol)
    del w.pods["llama-x-0"]
    s = w.run(st, pol)
    assert s.status.state == "RolledBack" and "lost" in s.status.message


def test_restart_based_rollout_when_in_place_is_impossible():
    for w, pol in ((World(admin=False), policy()), (World(), policy(rollout={"inPlace": False}))):
        s = w.run(None, pol)
        assert s.status.state == "Promoting" and s.status.in_place is False
        assert w.accepted == [NEW] and not w.served  # no admin call: the Deployment restarts pods
        w.pods = {n: NEW for n in w.pods}  # the rolling restart happened
        s = w.run(s.status, pol)
        assert s.status.state == "Succeeded"


def test_the_drift_job_is_followed_through_its_phases():
    w, pol = World(), policy()
    st = None
    for phase, state in (("Searching", "Compiling"), ("Verifying", "Verifying"), ("Failed", "Failed")):
        s = ro.step(st, pol, w.view(proposal=False, job_phase=phase, job_message="boom"))
        assert s.status.state == state and s.status.compilation_job == "llama-drift-1"
        st = s.status
    assert "boom" in st.message
    # a finished job is not followed again
    assert ro.step(st, pol, w.view(proposal=False, job_phase="Failed")).status == st


def test_template_hash_kept_only_for_in_place_promotions():
    st = {"rollout": {"state": "Promoting", "inPlace": True, "toPlanHash": NEW}}
    assert ro.template_plan_hash(st, NEW, OLD) == OLD  # being promoted in place: no restart
    assert ro.template_plan_hash(st, "c" * 16, OLD) == "c" * 16  # another plan change restarts
    st["rollout"]["inPlace"] = False
    assert ro.template_plan_hash(st, NEW, OLD) == NEW
    assert ro.template_plan_hash(None, NEW, None) == NEW


def test_an_in_place_promotion_keeps_the_template_through_later_rollouts():
    """Seen in the e2e: the next canary (a new RolloutStatus) must not restart every replica."""
    w, pol = World(), policy(rollout={"canary": {"initialDelay": "1s", "interval": "1s", "iterations": 1}})
    st = start_canary(w, pol)
    w.now += 2
    st = w.run(st, pol, analysis=PASS).status
    for _ in range(2):
        w.now += 1
        st = w.run(st, pol).status
    assert st.state == "Succeeded" and st.promoted_in_place == NEW
    status = {"rollout": st.wire()}
    assert ro.template_plan_hash(status, NEW, OLD) == OLD
    # a later rollout of another plan: canary, then rolled back; the template never moves
    later = RolloutStatus(**{**ro._keep(st), "state": "Canary", "in_place": True, "to_plan_hash": "c" * 16,
                             "from_plan_hash": NEW})
    assert ro.template_plan_hash({"rollout": later.wire()}, NEW, OLD) == OLD
    rolled = ro._finish(later, "RolledBack", w.now, "bad")
    assert ro.template_plan_hash({"rollout": rolled.wire()}, NEW, OLD) == OLD
    # a restart-based rollout that accepts a new plan does restart
    assert ro.template_plan_hash({"rollout": rolled.wire()}, "c" * 16, OLD) == "c" * 16


def test_conditions_from_drift_and_rollout_status():
    obs = {o.type: o for o in ro.conditions({
        "drift": {"score": 2.1, "message": "sustained drift: prompt lengths moved 2.10 doublings"},
        "rollout": {"state": "Canary", "message": "analysis 1/5 passed"},
    })}
    assert obs[ro.TRAFFIC_IN_POLICY].ok is False and obs[ro.TRAFFIC_IN_POLICY].reason == "DriftDetected"
    assert obs[ro.ROLLOUT_SETTLED].ok is False and obs[ro.ROLLOUT_SETTLED].reason == "RolloutInProgress"
    obs = {o.type: o for o in ro.conditions({"drift": {"score": 0.1, "message": "within policy"},
                                               "rollout": {"state": "RolledBack"}})}
    assert obs[ro.TRAFFIC_IN_POLICY].ok is True and obs[ro.ROLLOUT_SETTLED].reason == "RolledBack"
    assert ro.conditions({}) == []


def test_a_finished_drift_job_does_not_overwrite_a_later_rollout():
    """After a user's job rolled back, the (older, succeeded) drift job is not 'followed' again."""
    w, pol = World(), policy()
    st = RolloutStatus(state="RolledBack", compilation_job="planted", rejected_plans=[NEW], to_plan_hash=NEW)
    s = ro.step(st, pol, w.view(proposal=False, job_phase="Succeeded"))
    assert s.status == st and s.actions == []
    # a new drift job that is running is followed
    s = ro.step(st, pol, w.view(proposal=False, job_phase="Searching"))
    assert s.status.state == "Compiling" and s.status.rejected_plans == [NEW]


def test_a_canary_whose_engine_does_not_answer_is_held_not_lost_or_reapplied():
    w, pol = World(), policy()
    st = start_canary(w, pol)
    pods = tuple(ro.Pod(n, True, None if n == "llama-x-0" else h) for n, h in sorted(w.pods.items()))
    view = ro.View(now=w.now + 40, configured_hash=OLD, pods=pods, proposal=w.view().proposal, job="llama-drift-1")
    s = ro.step(st, pol, view)
    assert s.status == st and s.actions == []
    # not Ready in Kubernetes after serving the plan: lost
    pods = tuple(ro.Pod(n, n != "llama-x-0", h) for n, h in sorted(w.pods.items()))
    s = ro.step(st, pol, ro.View(now=w.now + 40, configured_hash=OLD, pods=pods, job="llama-drift-1"))
    assert s.status.state == "RolledBack"


def test_the_handler_measures_the_canary_only_since_it_served_the_plan(monkeypatch):
    """The gates' rate() window starts when the canary began serving the new plan (initialDelay 20 s
    < the 30 s minimum window: the first analysis would otherwise average in the old plan)."""
    from anneal.operator import rollout_handlers
    from anneal.operator.api.inference_deployment import InferenceDeploymentSpec
    from anneal.operator.context import Context
    from anneal.operator.settings import OperatorSettings

    queries: list[str] = []

    class FakePrometheus:
        def __init__(self, url):
            assert url == "http://prom:9090"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def query_scalar(self, q, at=None):
            queries.append(q)
            return 1.0

    monkeypatch.setattr(rollout_handlers, "Prometheus", FakePrometheus)
    driver = rollout_handlers.RolloutDriver(Context(OperatorSettings(prometheus_url="http://prom:9090")))
    spec = InferenceDeploymentSpec.model_validate({"model": "random:tiny", "compilation": {"mode": "auto", "rollout": {
        "canary": {"initialDelay": "20s", "interval": "10s"}}}})
    since = 1_000_000.0
    st = RolloutStatus(state="Canary", canary_pod="p0", canary_since=ro.iso(since), to_plan_hash=NEW)
    pods = (ro.Pod("p0", True, NEW), ro.Pod("p1", True, OLD))
    a = driver.analyze(spec, "ns", st, pods, since + 20.4)
    assert a.verdict == "passed" and queries
    windows = {q.split("[")[1].split("]")[0] for q in queries if "[" in q}
    assert windows == {"20s"}, queries
    queries.clear()
    driver.analyze(spec, "ns", st, pods, since + 95)  # long since: the usual window
    assert {q.split("[")[1].split("]")[0] for q in queries if "[" in q} == {"30s"}, queries
