"""The plan rollout of one InferenceDeployment as a pure state machine (torch-free, no I/O).

Each tick the handler observes (pods and the plan hash each engine reports, the proposal, the
active CompilationJob's phase, a canary analysis when one is due) and calls :func:`step`, which
returns the next ``status.rollout`` and *intents*: serve plan H on pod P (in place, through the
admin API), accept plan H (write the compiled-plan ConfigMap, so restarts and the Deployment keep
it), and events. Intents are level-triggered: the handler carries them out only where the world
differs, so repeating a tick is harmless.

States (``status.rollout.state``)::

    Idle/Succeeded/RolledBack/Failed --(drift job running)--> Compiling --> Verifying
      --(verified proposal; mode auto)--> Canary --(iterations passed)--> Promoting --> Succeeded
                                           |  (failureLimit failed, abortRollout, canary lost)
                                           +--> RollingBack --> RolledBack
      --(mode preview/off, or pinnedPlan)--> Proposed (compiled and reported, never applied)

- Canary: the new plan on ONE ready replica, in place; after ``initialDelay`` from the moment the
  canary reports the new hash, one analysis every ``interval``; ``iterations`` passes promote,
  ``failureLimit`` failures (at least one) roll back, analyses without data *hold* (counted apart).
- Promoting in place: every ready replica gets the plan through its admin API, then the plan is
  accepted; Succeeded only once every ready replica reports the new hash and the deployment's
  configured plan is it.
- Restart-based (``rollout.inPlace: false``, ``type: Rolling``, or an engine without an admin
  API): the plan is accepted at once and the Deployment's rolling restart carries it; Succeeded
  once every ready replica reports it. Such a rollout cannot be aborted once accepted (pin the old
  plan instead).
- ``paused`` holds every step (a canary keeps serving, nothing new starts); ``abortRollout`` rolls
  an in-place rollout back; ``pinnedPlan`` stops automatic rollouts (proposals are reported).
- A plan that was rolled back or failed is remembered (``rejectedPlans``) and never retried
  automatically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from anneal.operator.api.base import duration_seconds
from anneal.operator.api.inference_deployment import CompilationPolicy, GateStatus, RolloutStatus
from anneal.operator.canary_gates import Analysis

SETTLED = ("Idle", "Succeeded", "RolledBack", "Failed", "Proposed")
ACTIVE = ("Canary", "Promoting", "RollingBack")
MAX_REJECTED = 32


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_iso(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class Pod:
    """One engine replica as the handler saw it this tick."""

    name: str
    ready: bool
    plan_hash: str | None = None  # what the engine reports serving (None: could not ask)
    admin: bool = True  # its admin API answered (in-place apply possible)


@dataclass(frozen=True)
class Proposal:
    """A verified plan waiting to be rolled out."""

    plan_hash: str
    job: str | None = None
    speedup: float | None = None
    config_map: str | None = None


@dataclass(frozen=True)
class View:
    now: float
    configured_hash: str | None  # the plan the deployment's plan ConfigMap holds
    pods: tuple[Pod, ...] = ()
    proposal: Proposal | None = None
    job: str | None = None  # the CompilationJob drift started last
    job_phase: str | None = None
    job_message: str = ""
    analysis: Analysis | None = None  # evaluated this tick (only when `analysis_due`)
    apply_errors: dict[str, str] = field(default_factory=dict)  # pod -> in-place apply failure, this tick


@dataclass(frozen=True)
class ServePlan:
    """Make ``pod`` serve ``plan_hash`` through its admin API (skip when it already does)."""

    pod: str
    plan_hash: str


@dataclass(frozen=True)
class AcceptPlan:
    """Make ``plan_hash`` the deployment's configured plan (the compiled-plan ConfigMap)."""

    plan_hash: str
    job: str | None


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False


Action = ServePlan | AcceptPlan | Event


@dataclass
class Step:
    status: RolloutStatus
    actions: list[Action] = field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return self.status.wire()


def analysis_due(st: RolloutStatus, policy: CompilationPolicy, now: float) -> bool:
    """Whether the handler should evaluate the canary gates this tick."""
    if st.state != "Canary" or policy.paused or policy.abort_rollout:
        return False
    since = parse_iso(st.canary_since)
    if since is None:
        return False
    canary = policy.rollout.canary
    if now < since + duration_seconds(canary.initial_delay):
        return False
    last = parse_iso(st.last_analysis_at)
    return last is None or now >= last + duration_seconds(canary.interval)


def _ready(view: View) -> list[Pod]:
    """Ready replicas whose engine answered this tick."""
    return sorted((p for p in view.pods if p.ready and p.plan_hash is not None), key=lambda p: p.name)


def _finish(st: RolloutStatus, state: str, now: float, message: str, reject: bool = False) -> RolloutStatus:
    rejected = list(st.rejected_plans)
    if reject and st.to_plan_hash and st.to_plan_hash not in rejected:
        rejected = (rejected + [st.to_plan_hash])[-MAX_REJECTED:]
    return st.model_copy(update=dict(state=state, finished_at=iso(now), message=message, rejected_plans=rejected))


def step(st: RolloutStatus | None, policy: CompilationPolicy, view: View) -> Step:
    st = st or RolloutStatus()
    if st.state in ACTIVE:
        return _active(st, policy, view)
    return _settled(st, policy, view)


def _settled(st: RolloutStatus, policy: CompilationPolicy, view: View) -> Step:
    now, p = view.now, view.proposal
    fresh = (
        # the handler passes only proposals that may roll out by themselves (drift's job, autoApply)
        p is not None and p.plan_hash != view.configured_hash and p.plan_hash not in st.rejected_plans
        and not (st.state == "Proposed" and st.to_plan_hash == p.plan_hash and policy.mode != "auto")
    )
    if not fresh:
        running = view.job_phase not in (None, "Succeeded", "Failed", "Gone")
        if (view.job_phase and st.state in ("Compiling", "Verifying")) or (running and view.job != st.compilation_job):
            return _follow_job(st, view)
        return Step(st)
    assert p is not None
    base = dict(to_plan_hash=p.plan_hash, from_plan_hash=view.configured_hash, compilation_job=p.job,
                speedup=p.speedup)
    gain = f" (speedup {p.speedup:g}x)" if p.speedup else ""
    hold = None
    if policy.pinned_plan is not None:
        hold = "pinnedPlan is set"
    elif policy.mode != "auto":
        hold = f"mode {policy.mode}"
    if hold:
        if st.state == "Proposed" and st.to_plan_hash == p.plan_hash:
            return Step(st)
        new = RolloutStatus(**{**_keep(st), **base, "state": "Proposed", "started_at": iso(now),
                               "message": f"{hold}: plan {p.plan_hash} from {p.job} is proposed, not applied{gain}"})
        return Step(new, [Event("PlanProposed", new.message)])
    if policy.paused:
        msg = f"paused: plan {p.plan_hash} from {p.job} waits"
        return Step(st if st.message == msg else st.model_copy(update={"message": msg}))
    ready = _ready(view)
    if not ready:
        msg = f"plan {p.plan_hash} waits for a ready replica"
        return Step(st if st.message == msg else st.model_copy(update={"message": msg}))
    in_place = policy.rollout.in_place and all(q.admin for q in ready)
    if policy.rollout.type == "Canary" and in_place:
        canary = ready[0].name
        new = RolloutStatus(**{**_keep(st), **base, "state": "Canary", "in_place": True, "canary_pod": canary,
                               "started_at": iso(now),
                               "message": f"canary {canary}: applying plan {p.plan_hash}{gain}"})
        return Step(new, [ServePlan(canary, p.plan_hash),
                          Event("CanaryStarted", f"plan {p.plan_hash} from {p.job} on canary {canary}{gain}")])
    why = "type Rolling" if policy.rollout.type == "Rolling" else (
        "inPlace is false" if not policy.rollout.in_place else "an engine has no reachable admin API")
    new = RolloutStatus(**{**_keep(st), **base, "state": "Promoting", "in_place": in_place, "started_at": iso(now),
                           "message": f"rolling out plan {p.plan_hash} to all replicas ({why}){gain}"})
    actions: list[Action] = [Event("PromotionStarted", new.message)]
    return Step(new, actions + _promote_actions(new, view))


def _keep(st: RolloutStatus) -> dict[str, Any]:
    """What survives from one rollout to the next."""
    return {"rejected_plans": list(st.rejected_plans), "promoted_in_place": st.promoted_in_place}


def _follow_job(st: RolloutStatus, view: View) -> Step:
    """Compiling/Verifying while the drift-triggered job runs; Failed when it failed."""
    phase = view.job_phase
    if phase in ("Pending", "Provisioning", "Searching"):
        state, msg = "Compiling", f"CompilationJob {view.job} is {phase}"
    elif phase == "Verifying":
        state, msg = "Verifying", f"CompilationJob {view.job} is verifying its best plan"
    elif phase == "Failed":
        state, msg = "Failed", f"CompilationJob {view.job} failed: {view.job_message}".rstrip(": ")
    elif phase == "Succeeded":
        # succeeded, but its plan is not new (already configured or rejected): nothing to roll out
        state, msg = "Idle", f"CompilationJob {view.job} found no plan to roll out"
    else:  # job gone
        state, msg = "Idle", f"CompilationJob {view.job} is gone"
    if st.state == state and st.message == msg and st.compilation_job == view.job:
        return Step(st)
    new = RolloutStatus(**{**_keep(st), "state": state, "compilation_job": view.job, "message": msg,
                           "started_at": st.started_at if st.compilation_job == view.job else iso(view.now)})
    events: list[Action] = []
    if state == "Failed":
        events.append(Event("CompilationFailed", msg, warning=True))
    elif state != st.state and state in ("Compiling", "Verifying"):
        events.append(Event(f"Compilation{phase}" if phase != "Verifying" else "CompilationVerifying", msg))
    return Step(new, events)


def _active(st: RolloutStatus, policy: CompilationPolicy, view: View) -> Step:
    now = view.now
    if policy.abort_rollout and st.state in ("Canary", "Promoting"):
        if st.in_place:
            new = st.model_copy(update=dict(state="RollingBack", message="abortRollout: restoring plan "
                                            f"{st.from_plan_hash}"))
            return Step(new, [Event("RollbackStarted", new.message, warning=True), *_rollback_actions(new, view)])
        if st.state == "Promoting":
            msg = "abortRollout ignored: a restart-based rollout cannot be undone once accepted; set pinnedPlan"
            return Step(st if st.message == msg else st.model_copy(update={"message": msg}))
    if policy.paused and st.state != "RollingBack":
        msg = f"paused during {st.state}"
        return Step(st if st.message == msg else st.model_copy(update={"message": msg}))
    if st.state == "Canary":
        return _canary(st, policy, view)
    if st.state == "Promoting":
        return _promoting(st, view)
    return _rolling_back(st, view)


def _canary(st: RolloutStatus, policy: CompilationPolicy, view: View) -> Step:
    now, to = view.now, st.to_plan_hash
    pod = next((p for p in view.pods if p.name == st.canary_pod), None)
    if pod is None or (not pod.ready and st.canary_since):
        new = _finish(st, "RolledBack", now, f"canary {st.canary_pod} was lost under plan {to}; "
                      f"the replicas serve plan {st.from_plan_hash}", reject=True)
        return Step(new, [Event("CanaryLost", new.message, warning=True)])
    if st.canary_pod in view.apply_errors:
        new = _finish(st, "Failed", now, f"canary {st.canary_pod} refused plan {to}: "
                      f"{view.apply_errors[st.canary_pod]} (the previous plan keeps serving)", reject=True)
        return Step(new, [Event("CanaryApplyFailed", new.message, warning=True)])
    if pod.plan_hash is None:  # Ready, but its engine did not answer this tick: no evidence either way
        return Step(st)
    if pod.plan_hash != to:
        if st.canary_since:  # it served the new plan and lost it (engine restarted): re-apply
            return Step(st.model_copy(update={"canary_since": None, "message": f"canary {pod.name} restarted; re-applying plan {to}"}),
                        [ServePlan(pod.name, to)])
        return Step(st, [ServePlan(pod.name, to)])
    if not st.canary_since:
        delay = policy.rollout.canary.initial_delay
        new = st.model_copy(update={"canary_since": iso(now),
                                    "message": f"canary {pod.name} serves plan {to}; first analysis after {delay}"})
        return Step(new, [Event("CanaryServing", new.message)])
    a = view.analysis
    if a is None:
        return Step(st)
    cfg = policy.rollout.canary
    update: dict[str, Any] = {"last_analysis_at": iso(now),
                              "gates": [GateStatus.model_validate(r.wire()) for r in a.results]}
    verdict = a.verdict
    if verdict == "passed":
        update["analyses_passed"] = st.analyses_passed + 1
        update["message"] = f"analysis {update['analyses_passed']}/{cfg.iterations} passed: {a.summary()}"
    elif verdict == "failed":
        update["analyses_failed"] = st.analyses_failed + 1
        update["message"] = f"analysis failed ({update['analyses_failed']}/{max(1, cfg.failure_limit)}): {a.summary()}"
    else:
        update["analyses_inconclusive"] = st.analyses_inconclusive + 1
        update["message"] = f"holding: {a.summary()} (missing metrics are not evidence)"
    new = st.model_copy(update=update)
    events: list[Action] = []
    if verdict == "failed":
        events.append(Event("CanaryAnalysisFailed", new.message, warning=True))
    elif verdict == "inconclusive" and st.message != new.message and not st.message.startswith("holding"):
        events.append(Event("CanaryHeld", new.message))
    if new.analyses_failed >= max(1, cfg.failure_limit):
        new = new.model_copy(update={"state": "RollingBack",
                                     "message": f"rolling back plan {to}: {new.analyses_failed} failed analyses; last: {a.summary()}"})
        events.append(Event("RollbackStarted", new.message, warning=True))
        return Step(new, events + _rollback_actions(new, view))
    if new.analyses_passed >= cfg.iterations:
        new = new.model_copy(update={"state": "Promoting",
                                     "message": f"canary passed {new.analyses_passed} analyses; promoting plan {to} to all replicas"})
        events.append(Event("CanaryPassed", new.message))
        return Step(new, events + _promote_actions(new, view))
    return Step(new, events)


def _promote_actions(st: RolloutStatus, view: View) -> list[Action]:
    to = st.to_plan_hash
    assert to is not None
    ready = _ready(view)
    if st.in_place:
        pending = [ServePlan(p.name, to) for p in ready if p.plan_hash != to]
        if pending:
            return pending
    return [AcceptPlan(to, st.compilation_job)]


def _promoting(st: RolloutStatus, view: View) -> Step:
    now, to = view.now, st.to_plan_hash
    if view.apply_errors:
        pod, err = sorted(view.apply_errors.items())[0]
        new = st.model_copy(update={"state": "RollingBack", "message": f"{pod} refused plan {to}: {err}; rolling back"})
        return Step(new, [Event("PromotionFailed", new.message, warning=True), *_rollback_actions(new, view)])
    ready = _ready(view)
    serving = [p for p in ready if p.plan_hash == to]
    if ready and len(serving) == len(ready) and view.configured_hash == to and len(view.pods) == len(ready):
        new = _finish(st, "Succeeded", now, f"all {len(ready)} replicas serve plan {to}")
        new = new.model_copy(update={"promoted_in_place": to if st.in_place else None})
        return Step(new, [Event("RolloutSucceeded", new.message)])
    msg = f"promoting plan {to}: {len(serving)}/{len(ready)} ready replicas serve it" + (
        "" if view.configured_hash == to else "; accepting it as the configured plan")
    new = st if st.message == msg else st.model_copy(update={"message": msg})
    return Step(new, _promote_actions(st, view))


def _rollback_actions(st: RolloutStatus, view: View) -> list[Action]:
    back = st.from_plan_hash
    if back is None:
        return []
    return [ServePlan(p.name, back) for p in view.pods if p.ready and p.plan_hash not in (back, None)]


def _rolling_back(st: RolloutStatus, view: View) -> Step:
    now, back = view.now, st.from_plan_hash
    if view.apply_errors:
        pod, err = sorted(view.apply_errors.items())[0]
        new = _finish(st, "Failed", now, f"rollback failed on {pod}: {err}; it may still serve plan "
                      f"{st.to_plan_hash} (delete the pod to restart it on plan {back})", reject=True)
        return Step(new, [Event("RollbackFailed", new.message, warning=True)])
    actions = _rollback_actions(st, view)
    if not actions and all(p.plan_hash == back for p in view.pods if p.ready):
        new = _finish(st, "RolledBack", now, f"every replica serves plan {back} again; plan {st.to_plan_hash} "
                      f"rejected ({st.message})", reject=True)
        return Step(new, [Event("RolledBack", new.message, warning=True)])
    return Step(st, actions)


# --- hooks used by the deployment reconcile -----------------------------------------------------

def template_plan_hash(status: dict[str, Any] | None, configured_hash: str, current_template_hash: str | None) -> str:
    """The plan hash to put into the Deployment's pod template (a change restarts the pods).

    A plan promoted in place is already served by every replica: neither its acceptance nor any
    later rollout that leaves it configured (a canary, a rollback) may restart them, so the template
    keeps the hash it had. Every other change of the configured plan restarts (rolls) the pods."""
    ro = (status or {}).get("rollout") or {}
    if current_template_hash and (
        ro.get("promotedInPlace") == configured_hash
        or (ro.get("inPlace") and ro.get("toPlanHash") == configured_hash and ro.get("state") == "Promoting")
    ):
        return current_template_hash
    return configured_hash


TRAFFIC_IN_POLICY = "TrafficWithinPolicy"
ROLLOUT_SETTLED = "RolloutSettled"


def conditions(status: dict[str, Any] | None):
    """The drift and rollout conditions, derived from ``status.drift`` and ``status.rollout`` (what
    the drift watch and the rollout timer wrote). Not part of Ready: a drifting deployment or a
    canary in progress still serves."""
    from anneal.operator.conditions import Observation

    status = status or {}
    out = []
    d = status.get("drift")
    if d:
        msg = str(d.get("message") or "")
        if d.get("score") is None:
            out.append(Observation(TRAFFIC_IN_POLICY, None, "NoEvidence", msg))
        elif msg.startswith("sustained drift"):
            out.append(Observation(TRAFFIC_IN_POLICY, False, "DriftDetected", msg))
        elif msg.startswith("drift building"):
            out.append(Observation(TRAFFIC_IN_POLICY, None, "DriftBuilding", msg))
        else:
            reason = "Cooldown" if msg.startswith("cooldown") else "WithinPolicy"
            out.append(Observation(TRAFFIC_IN_POLICY, True, reason, msg))
    r = status.get("rollout")
    if r:
        state, msg = r.get("state") or "Idle", str(r.get("message") or "")
        if state in ("Idle", "Succeeded", "Proposed"):
            out.append(Observation(ROLLOUT_SETTLED, True, state, msg))
        elif state in ("RolledBack", "Failed"):
            out.append(Observation(ROLLOUT_SETTLED, True, state, msg))
        else:  # Compiling, Verifying, Canary, Promoting, RollingBack, Held
            out.append(Observation(ROLLOUT_SETTLED, False, "RolloutInProgress", f"{state}: {msg}"))
    return out


def deployment_template_hash(deployment: dict[str, Any] | None) -> str | None:
    if not deployment:
        return None
    meta = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    from anneal.operator.naming import ANNOTATION_PLAN_HASH

    return (meta.get("annotations") or {}).get(ANNOTATION_PLAN_HASH)
