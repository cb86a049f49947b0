"""The CompilationJob state machine (`compilation_status.decide`) and the progress reporter's
pure parts."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from anneal.engine.plan import CompiledPlan, Gain, Plan
from anneal.operator import compilation_status as cs
from anneal.operator import progress

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def engine(ready=True, phase="Running", waiting=None, terminated=None, ip="10.0.0.1"):
    status = {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    c = {"state": {"waiting": waiting} if waiting else {"running": {}}}
    if terminated:
        c["state"] = {"terminated": terminated}
    status["containerStatuses"] = [c]
    return {"metadata": {"name": "e"}, "status": status}


def job(condition=None, message=""):
    conds = [{"type": condition, "status": "True", "reason": "BackoffLimitExceeded", "message": message}] if condition else []
    return {"metadata": {"name": "j-coordinator"}, "status": {"conditions": conds}}


def result(passed=True, gain=1.5):
    plan = CompiledPlan(plan=Plan.model_validate({"scheduler": {"max_num_seqs": 8}}), model="random:tiny", hardware="H200",
                        gains=[Gain(metric="tokens/s", baseline=100.0, candidate=100.0 * gain)],
                        verification={"passed": passed})
    return {"plan.json": plan.model_dump_json()}, plan.plan_hash


def obs(**kw):
    base = dict(phase="Pending", created_at=T0, now=T0 + timedelta(minutes=5), deadline_s=3600, retries=2)
    base.update(kw)
    return cs.JobObserved(**base)


def test_target_problem_keeps_the_job_pending_with_a_reason():
    d = cs.decide(obs(target_problem=("TargetNotFound", "InferenceDeployment 'x' does not exist")))
    assert (d.phase, d.reason, d.actions) == ("Pending", "TargetNotFound", [])
    target = next(c for c in d.conditions if c.type == "TargetResolved")
    assert target.ok is False and "does not exist" in target.message


def test_a_target_vanishing_mid_search_does_not_stop_the_search():
    ready = {"fast": engine(), "slow": engine()}
    d = cs.decide(obs(phase="Searching", pods=ready, job=job(), target_problem=("TargetNotFound", "gone")))
    assert d.phase == "Searching"
    assert next(c for c in d.conditions if c.type == "TargetResolved").ok is False


def test_provisioning_until_both_engines_are_ready():
    d = cs.decide(obs(pods={"fast": engine(), "slow": engine(ready=False, phase="Pending")}))
    assert d.phase == "Provisioning" and d.actions == [cs.PROVISION] and "slow: Pending" in d.message
    d = cs.decide(obs(pods={}))
    assert d.phase == "Provisioning" and d.reason == "WaitingForEngines"


def test_unschedulable_engines_say_why():
    pending = engine(ready=False, phase="Pending")
    pending["status"]["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                            "message": "0/3 nodes: didn't match pod anti-affinity rules"})
    d = cs.decide(obs(pods={"fast": engine(), "slow": pending}))
    assert d.reason == "EnginesUnschedulable" and "anti-affinity" in d.message


def test_coordinator_starts_once_both_engines_are_ready():
    d = cs.decide(obs(phase="Provisioning", pods={"fast": engine(), "slow": engine()}))
    assert d.phase == "Searching" and cs.START_COORDINATOR in d.actions


def test_progress_moves_searching_to_verifying():
    ready = {"fast": engine(), "slow": engine()}
    assert cs.decide(obs(phase="Searching", pods=ready, job=job(), progress={"phase": "Searching"})).phase == "Searching"
    d = cs.decide(obs(phase="Searching", pods=ready, job=job(), progress={"phase": "Verifying", "message": "checking KV"}))
    assert d.phase == "Verifying" and d.message == "checking KV"


def test_success_needs_a_complete_job_and_a_verified_result():
    ready = {"fast": engine(), "slow": engine()}
    data, plan_hash = result()
    d = cs.decide(obs(phase="Verifying", pods=ready, job=job("Complete"), result=data))
    assert d.phase == "Succeeded" and d.result_hash == plan_hash and d.best_speedup == 1.5
    assert cs.RELEASE_ENGINES in d.actions and cs.APPLY_RESULT in d.actions
    assert next(c for c in d.conditions if c.type == "ResultValid").ok is True
    assert d.ready.ok is True and d.ready.reason == "Verified"
    running = cs.decide(obs(phase="Searching", pods=ready, job=job()))
    assert running.ready.ok is False and running.ready.reason == "CoordinatorRunning"


@pytest.mark.parametrize("data,why", [
    (None, "no result plan"),
    ({"plan.json": "{not json"}, "not a CompiledPlan"),
    (result(passed=False)[0], "did not pass verification"),
])
def test_a_complete_job_without_a_verified_result_is_a_failure(data, why):
    d = cs.decide(obs(phase="Verifying", pods={"fast": engine(), "slow": engine()}, job=job("Complete"), result=data))
    assert d.phase == "Failed" and d.reason == "InvalidResult" and why in d.message
    assert cs.APPLY_RESULT not in d.actions and cs.RELEASE_ENGINES in d.actions


def test_failed_coordinator_fails_the_job_with_its_last_words():
    crashed = engine(ready=False, phase="Failed", terminated={"exitCode": 2, "message": "ConnectionRefused: 10.0.0.1:8001"})
    d = cs.decide(obs(phase="Searching", pods={"fast": engine(), "slow": engine()}, job=job("Failed", "Job has reached the specified backoff limit"),
                      coordinator_pods=[crashed], progress={"phase": "Done", "message": "failed: fast-tier engine: 404"}))
    assert d.phase == "Failed" and d.reason == "CoordinatorFailed"
    assert "backoff limit" in d.message and "ConnectionRefused" in d.message and "fast-tier engine: 404" in d.message


def test_a_coordinator_that_lost_an_engine_restarts_the_engines_not_fails_the_job():
    """A dying engine answers 503 before its process exits: its coordinator may end (exit 3) while
    the engine pod still reads Running. That is the engine's death, retried, not the search's."""
    lost = engine(ready=False, phase="Failed", terminated={"exitCode": 3, "message": "the fast-tier engine died"})
    said = {"phase": "Done", "message": "failed: the fast-tier engine died: CUDA error: device-side assert triggered"}
    d = cs.decide(obs(phase="Searching", pods={"fast": engine(), "slow": engine()}, job=job("Failed"),
                      coordinator_pods=[lost], progress=said, restarts=0))
    assert d.phase == "Provisioning" and d.reason == "RestartingEngines" and d.actions == [cs.RESTART_ENGINES]
    assert d.restarts == 1 and d.message.startswith("fast engine failed (the coordinator lost it: the fast-tier engine died")
    d = cs.decide(obs(phase="Searching", pods={"fast": engine(), "slow": engine()}, job=job("Failed"),
                      coordinator_pods=[lost], progress=said, restarts=2))
    assert d.phase == "Failed" and d.reason == "EngineFailed" and "device-side assert" in d.message
    other = engine(ready=False, phase="Failed", terminated={"exitCode": 1, "message": "bad traffic file"})
    d = cs.decide(obs(phase="Searching", pods={"fast": engine(), "slow": engine()}, job=job("Failed"),
                      coordinator_pods=[other], progress=said, restarts=0))
    assert d.reason == "CoordinatorFailed"


def test_done_report_holds_the_phase_until_the_job_ends():
    ready = {"fast": engine(), "slow": engine()}
    assert cs.decide(obs(phase="Searching", pods=ready, job=job(), progress={"phase": "Done"})).phase == "Searching"
    assert cs.decide(obs(phase="Verifying", pods=ready, job=job(), progress={"phase": "Done"})).phase == "Verifying"


def test_dead_engine_is_retried_then_fails_the_job():
    dead = engine(ready=False, phase="Failed", terminated={"exitCode": 137, "message": "OOMKilled"})
    d = cs.decide(obs(phase="Searching", pods={"fast": dead, "slow": engine()}, job=job(), restarts=0))
    assert d.phase == "Provisioning" and d.actions == [cs.RESTART_ENGINES] and d.restarts == 1
    d = cs.decide(obs(phase="Searching", pods={"fast": dead, "slow": engine()}, job=job(), restarts=2))
    assert d.phase == "Failed" and d.reason == "EngineFailed" and "OOMKilled" in d.message


def test_restarts_back_off_and_terminating_pods_are_not_dead_again():
    dying = engine(ready=False, phase="Failed", terminated={"exitCode": 137, "message": "OOMKilled"})
    dying["metadata"]["deletionTimestamp"] = "2026-11-29T12:04:00Z"
    just_now = T0 + timedelta(minutes=5) - timedelta(seconds=3)
    d = cs.decide(obs(phase="Provisioning", pods={"fast": dying, "slow": None}, restarts=1, last_restart_at=just_now))
    assert d.phase == "Provisioning" and d.reason == "BackingOff" and d.actions == [] and d.restarts == 1
    later = cs.decide(obs(phase="Provisioning", pods={"fast": None, "slow": None}, restarts=1,
                          last_restart_at=T0 + timedelta(minutes=5) - timedelta(seconds=11)))
    assert later.actions == [cs.PROVISION]
    assert [cs.restart_backoff(n) for n in (1, 2, 3, 10)] == [10, 20, 40, 300]


def test_an_engine_vanishing_mid_search_restarts_the_engines():
    d = cs.decide(obs(phase="Searching", pods={"fast": None, "slow": engine()}, job=job()))
    assert d.actions == [cs.RESTART_ENGINES] and "disappeared" in d.message


def test_a_reconcile_mid_search_never_creates_engine_pods():
    """Session 11's flaky e2e: a reconcile that read the fast pod alive, then ran its actions after
    the pod was deleted, re-created it; the restart was never counted and the coordinator kept a
    stale address. Mid-search only the support objects are kept; a lost pod is a restart."""
    ready = {"fast": engine(), "slow": engine()}
    for phase, progress_ in (("Searching", {}), ("Verifying", {"phase": "Verifying"})):
        d = cs.decide(obs(phase=phase, pods=ready, job=job(), progress=progress_))
        assert d.phase == phase and d.actions == [cs.KEEP_SUPPORT]
    d = cs.decide(obs(phase="Searching", pods={"fast": engine(ready=False), "slow": engine()}, job=job()))
    assert d.reason == "WaitingForEngines" and d.actions == [cs.KEEP_SUPPORT]
    d = cs.decide(obs(phase="Provisioning", pods=ready))
    assert d.phase == "Searching" and cs.PROVISION not in d.actions and cs.START_COORDINATOR in d.actions


def test_deadline_fails_releases_and_stops_the_coordinator():
    d = cs.decide(obs(phase="Searching", now=T0 + timedelta(hours=2), pods={"fast": engine(), "slow": engine()}, job=job()))
    assert d.phase == "Failed" and d.reason == "DeadlineExceeded"
    assert d.actions == [cs.RELEASE_ENGINES, cs.STOP_COORDINATOR]
    suspended = job()
    suspended["spec"] = {"suspend": True}
    assert cs.decide(obs(phase="Failed", pods={}, job=suspended)).actions == []


def test_terminal_jobs_only_release_leftover_engines():
    assert cs.decide(obs(phase="Succeeded", pods={"fast": engine(), "slow": None})).actions == [cs.RELEASE_ENGINES]
    d = cs.decide(obs(phase="Failed", now=T0 + timedelta(days=3), pods={}))
    assert d.phase == "Failed" and d.actions == []


# --- progress reporter --------------------------------------------------------------------------

def test_report_to_parses_namespace_and_name():
    assert progress.parse_report_to("ml/llama-chat") == ("ml", "llama-chat")
    for bad in ("llama", "/x", "ml/", "a/b/c"):
        with pytest.raises(ValueError, match="NAMESPACE/NAME"):
            progress.parse_report_to(bad)


def test_progress_patch_writes_only_given_fields():
    body = progress.progress_patch(phase="Searching", experiments=12, best_speedup=1.31, now="2026-11-29T12:00:00Z")
    assert body == {"status": {"progress": {"phase": "Searching", "experiments": 12, "bestSpeedup": 1.31,
                                            "updatedAt": "2026-11-29T12:00:00Z"}}}
    with pytest.raises(ValueError):
        progress.progress_patch(phase="Succeeded")
    with pytest.raises(ValueError):
        progress.progress_patch(experiments=-1)


def test_a_coordinator_waiting_for_engines_is_still_provisioning():
    d = cs.decide(obs(phase="Provisioning", pods={"fast": engine(), "slow": engine(ready=False, phase="Pending")}, job=job(),
                      progress={"phase": "Searching"}))
    assert d.phase == "Provisioning" and d.reason == "WaitingForEngines"


def test_restart_is_counted_once_while_the_old_coordinator_goes_away():
    going = job()
    going["metadata"]["deletionTimestamp"] = "2026-11-29T12:05:00Z"
    d = cs.decide(obs(phase="Provisioning", pods={"fast": None, "slow": None}, job=going, restarts=1))
    assert d.phase == "Provisioning" and d.restarts == 1 and cs.START_COORDINATOR not in d.actions
    # a coordinator created before the engines (e.g. by hand) waits for them; engines are created
    d = cs.decide(obs(phase="Pending", pods={"fast": None, "slow": None}, job=job()))
    assert d.phase == "Provisioning" and d.actions == [cs.PROVISION] and d.restarts == 0
