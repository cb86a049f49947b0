"""The CompilationJob state machine as a pure function: what the reconcile saw -> the phase, the
conditions and the actions to take. The handler executes the actions; this module decides."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from anneal.engine.plan import CompiledPlan
from anneal.operator import conditions as cond
from anneal.operator import naming, pod_health
from anneal.operator.api import compilation_job as api
from anneal.operator.compilation_objects import TIERS
from anneal.operator.plan_source import speedup

# Actions the handler knows how to do.
PROVISION = "provision"  # secret, RBAC, ConfigMaps, engine pods (create if absent)
# The same without the engine pods: once the search runs, a lost engine is a restart (the
# coordinator holds its address), never a pod silently re-created by a reconcile that read it
# alive just before it was deleted.
KEEP_SUPPORT = "keep-support"
START_COORDINATOR = "start-coordinator"
RESTART_ENGINES = "restart-engines"  # delete engine pods and the coordinator Job; back to Provisioning
RELEASE_ENGINES = "release-engines"  # terminal: delete engine pods, free the GPUs
APPLY_RESULT = "apply-result"
STOP_COORDINATOR = "stop-coordinator"  # suspend a still-running coordinator Job (kept for its logs)


@dataclass
class JobObserved:
    phase: str
    created_at: datetime
    now: datetime
    deadline_s: float
    retries: int
    restarts: int = 0
    last_restart_at: datetime | None = None
    target_problem: tuple[str, str] | None = None  # (reason, message) why the target cannot work
    pods: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    job: dict[str, Any] | None = None
    coordinator_pods: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, str] | None = None  # data of the result ConfigMap
    progress: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decision:
    phase: str
    reason: str
    message: str
    actions: list[str] = field(default_factory=list)
    conditions: list[cond.Observation] = field(default_factory=list)
    result_hash: str | None = None
    best_speedup: float | None = None
    restarts: int = 0
    ready: cond.Observation | None = None


def _job_condition(job: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((job or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def validate_result(data: dict[str, str] | None) -> tuple[CompiledPlan | None, str]:
    """The CompiledPlan in the result ConfigMap, or (None, why not)."""
    if not data or naming.PLAN_KEY not in data:
        return None, "the coordinator wrote no result plan"
    try:
        compiled = CompiledPlan.model_validate_json(data[naming.PLAN_KEY])
    except Exception as exc:
        return None, f"the result is not a CompiledPlan: {str(exc)[:300]}"
    if compiled.verification.get("passed") is not True:
        return None, "the result plan did not pass verification (verification.passed is not true)"
    return compiled, ""


def _coordinator_failure(obs: JobObserved) -> str:
    failed = _job_condition(obs.job, "Failed")
    text = f"{failed.get('reason', '')}: {failed.get('message', '')}" if failed else ""
    for pod in obs.coordinator_pods:
        p = pod_health.problem(pod)
        if p:
            text = f"{text}; {p.message}" if text else p.message
            break
    said = str(obs.progress.get("message") or "")
    if said:  # the coordinator's own last words (e.g. "failed: fast-tier engine: ...")
        text = f"{text}; coordinator: {said}" if text else f"coordinator: {said}"
    return text or "the coordinator Job failed"


def _coordinator_exit_code(obs: JobObserved) -> int | None:
    for pod in obs.coordinator_pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if ended := pod_health.terminated(cs):
                return ended.get("exitCode")
    return None


def decide(obs: JobObserved) -> Decision:
    engines_ready = all(obs.pods.get(t) is not None and pod_health.is_ready(obs.pods[t]) for t in TIERS)
    target_ok = cond.Observation(api.TARGET_RESOLVED, True, "Resolved")
    if obs.target_problem:
        target_ok = cond.Observation(api.TARGET_RESOLVED, False, *obs.target_problem)

    def out(phase: str, reason: str, message: str, actions=(), **kw: Any) -> Decision:
        if phase in api.TERMINAL_PHASES:
            engines = cond.Observation(api.ENGINES_READY, None, "Released", "engine pods are deleted when the job ends")
        else:
            engines = cond.Observation(
                api.ENGINES_READY, engines_ready, "Ready" if engines_ready else "NotReady",
                "" if engines_ready else ", ".join(f"{t}: {_pod_state(obs.pods.get(t))}" for t in TIERS),
            )
        running = obs.job is not None and not _job_condition(obs.job, "Complete") and not _job_condition(obs.job, "Failed")
        coordinator = cond.Observation(
            api.COORDINATOR_RUNNING, True if running else (None if obs.job is None else False),
            "Running" if running else ("NotStarted" if obs.job is None else "Finished"),
        )
        result = kw.pop("result_obs", cond.Observation(api.RESULT_VALID, None, "NoResultYet"))
        # Ready: the job produced a verified plan (like a Job's Complete), not "all parts healthy".
        ready = cond.Observation(cond.READY, phase == "Succeeded", reason, message)
        return Decision(
            phase, reason, message, list(actions), [target_ok, engines, coordinator, result],
            restarts=kw.pop("restarts", obs.restarts), ready=ready, **kw,
        )

    stop = [STOP_COORDINATOR] if _job_running(obs.job) else []
    if obs.phase in api.TERMINAL_PHASES:
        engines_left = any(obs.pods.get(t) is not None for t in TIERS)
        return out(obs.phase, "Finished", "", ([RELEASE_ENGINES] if engines_left else []) + stop)

    elapsed = (obs.now - obs.created_at).total_seconds()
    if elapsed > obs.deadline_s:
        return out("Failed", "DeadlineExceeded", f"not finished within {int(obs.deadline_s)}s", [RELEASE_ENGINES, *stop])

    if obs.target_problem and obs.phase == "Pending":
        # Only a job that has not started waits for its target; once engines exist the search goes
        # on without it (a vanished deployment only means the result cannot be applied).
        return out("Pending", obs.target_problem[0], obs.target_problem[1])

    # Engines: a dead one is recreated (with the coordinator, whose addresses are now stale).
    # A pod already being deleted (after a restart decision) counts as gone, never as dead again.
    live = {t: p for t, p in obs.pods.items() if p is not None and not (p.get("metadata") or {}).get("deletionTimestamp")}
    problems = {t: pod_health.problem(live[t]) for t in TIERS if t in live}
    dead = {t: p for t, p in problems.items() if p and (p.fatal or p.reason == "EngineCrashing")}
    if obs.job is not None and obs.phase in ("Searching", "Verifying"):
        # a vanished engine mid-search leaves the coordinator with a stale address
        for t in TIERS:
            if t not in live:
                dead.setdefault(t, pod_health.Problem("EngineMissing", f"{t} engine pod disappeared", True))
    if not dead and _job_condition(obs.job, "Failed") and _coordinator_exit_code(obs) == naming.EXIT_ENGINES_LOST:
        # The coordinator saw an engine die before its pod turned Failed here (a dying engine answers
        # 503 before its process has exited): the same restart, not the search's failure.
        said = str(obs.progress.get("message") or "").removeprefix("failed: ")
        tier = next((t for t in TIERS if f"{t}-tier" in said), "an")
        dead[tier] = pod_health.Problem("EngineLost", f"the coordinator lost it: {said}" if said else "the coordinator lost it", True)
    if dead:
        tier, p = next(iter(dead.items()))
        if obs.restarts >= obs.retries:
            return out("Failed", "EngineFailed", f"{tier} engine: {p.message}", [RELEASE_ENGINES, *stop])
        return out(
            "Provisioning", "RestartingEngines", f"{tier} engine failed ({p.message}); retry {obs.restarts + 1}/{obs.retries}",
            [RESTART_ENGINES], restarts=obs.restarts + 1,
        )

    if obs.restarts and obs.last_restart_at is not None:
        wait = restart_backoff(obs.restarts) - (obs.now - obs.last_restart_at).total_seconds()
        if wait > 0:
            return out("Provisioning", "BackingOff", f"retry {obs.restarts}/{obs.retries} in {int(wait) + 1}s")
    if obs.job is not None and (obs.job.get("metadata") or {}).get("deletionTimestamp"):
        return out("Provisioning", "WaitingForOldCoordinator", "the previous coordinator Job is being deleted", [PROVISION])
    if obs.job is None:
        if not engines_ready:
            waiting = ", ".join(f"{t}: {_pod_state(obs.pods.get(t))}" for t in TIERS)
            unsched = next((p for p in problems.values() if p and p.reason == "Unschedulable"), None)
            reason = "EnginesUnschedulable" if unsched else "WaitingForEngines"
            return out("Provisioning", reason, unsched.message if unsched else waiting, [PROVISION])
        return out("Searching", "CoordinatorStarted", "both engines ready", [KEEP_SUPPORT, START_COORDINATOR])

    if _job_condition(obs.job, "Failed"):
        return out("Failed", "CoordinatorFailed", _coordinator_failure(obs), [RELEASE_ENGINES])
    if not engines_ready and not _job_condition(obs.job, "Complete"):
        waiting = ", ".join(f"{t}: {_pod_state(obs.pods.get(t))}" for t in TIERS)
        searching = obs.phase in ("Searching", "Verifying")  # the pods exist: an absent one is dead above
        return out("Provisioning", "WaitingForEngines", waiting, [KEEP_SUPPORT if searching else PROVISION])
    if _job_condition(obs.job, "Complete"):
        compiled, why = validate_result(obs.result)
        if compiled is None:
            return out(
                "Failed", "InvalidResult", why, [RELEASE_ENGINES],
                result_obs=cond.Observation(api.RESULT_VALID, False, "InvalidResult", why),
            )
        gain = speedup(compiled)
        return out(
            "Succeeded", "Verified", f"plan {compiled.plan_hash} verified" + (f", {gain:.2f}x" if gain else ""),
            [RELEASE_ENGINES, APPLY_RESULT],
            result_obs=cond.Observation(api.RESULT_VALID, True, "Verified", f"plan {compiled.plan_hash}"),
            result_hash=compiled.plan_hash, best_speedup=gain,
        )
    reported = obs.progress.get("phase")
    # "Done" means the coordinator is finishing; the outcome comes from its Job, so the phase holds.
    if reported == "Verifying" or (reported == "Done" and obs.phase == "Verifying"):
        phase = "Verifying"
    else:
        phase = "Searching"
    return out(phase, "CoordinatorRunning", str(obs.progress.get("message") or ""), [KEEP_SUPPORT])


def restart_backoff(restarts: int) -> float:
    """Seconds between an engine failure and the next attempt: 10 s, doubling, at most 5 min."""
    return min(300.0, 10.0 * 2 ** max(restarts - 1, 0))


def _job_running(job: dict[str, Any] | None) -> bool:
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        return False
    if (job.get("spec") or {}).get("suspend"):
        return False
    return not _job_condition(job, "Complete") and not _job_condition(job, "Failed")


def _pod_state(pod: dict[str, Any] | None) -> str:
    if pod is None:
        return "absent"
    if pod_health.is_ready(pod):
        return "ready"
    return (pod.get("status") or {}).get("phase", "Pending")


def phase_rank(phase: str) -> int:
    return api.PHASE_ORDER.index(phase) if phase in api.PHASE_ORDER else len(api.PHASE_ORDER)
