"""InferenceDeployment status from what a reconcile observed: pure, so every phase and condition
is unit-tested on the CPU. The drift, rollout and proposedPlan parts belong to other writers and
are left untouched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from anneal.operator import conditions as cond
from anneal.operator import deployment_objects, naming, pod_health, rollout
from anneal.operator.api import inference_deployment as api
from anneal.operator.plan_source import PlanError, ResolvedPlan


@dataclass
class Observed:
    """What one reconcile saw in the cluster."""

    deployment: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    plan: ResolvedPlan | None = None
    plan_error: PlanError | None = None
    gpu_capacity: int | None = None  # most GPUs one matching node offers; None: not checked
    missing: list[tuple[str, str]] = field(default_factory=list)  # (reason, message) of absent references
    applied: bool = True  # children written without error
    template_plan_hash: str | None = None  # issue 8: the pod template's hash (differs after an in-place promotion)


def _schedulable(spec: api.InferenceDeploymentSpec, obs: Observed) -> cond.Observation:
    if spec.gpus and obs.gpu_capacity is not None and obs.gpu_capacity < spec.gpus:
        where = f" matching nodeSelector {spec.node_selector}" if spec.node_selector else ""
        return cond.Observation(
            api.SCHEDULABLE, False, "InsufficientGPUs",
            f"each replica requests {spec.gpus} {spec.gpu_resource} but the largest node{where} offers "
            f"{obs.gpu_capacity}; lower spec.gpus or add nodes",
        )
    for pod in obs.pods:
        p = pod_health.problem(pod)
        if p and p.reason == "Unschedulable":
            return cond.Observation(api.SCHEDULABLE, False, "Unschedulable", p.message)
    degree = obs.plan.plan.parallelism.tensor_parallel if obs.plan is not None else 1
    if spec.gpus and degree > spec.gpus:  # the engine would refuse to start: too few devices
        return cond.Observation(
            api.SCHEDULABLE, False, "TooFewGPUsForPlan",
            f"the plan splits the model across {degree} GPUs (parallelism.tensor_parallel) but each replica "
            f"requests {spec.gpus} {spec.gpu_resource}; raise spec.gpus or serve a plan of a lower degree",
        )
    if spec.gpus > degree:  # schedulable, but say what the request buys: the plan's degree of GPUs
        return cond.Observation(
            api.SCHEDULABLE, True, "ExtraGPUsIdle",
            f"each replica requests {spec.gpus} {spec.gpu_resource} and its plan runs on {degree} "
            f"(parallelism.tensor_parallel={degree}), so {spec.gpus - degree} idle per replica; serve a plan "
            f"with tensor_parallel {spec.gpus}, or set spec.gpus to {degree} and raise spec.replicas",
        )
    return cond.Observation(api.SCHEDULABLE, True, "Schedulable")


def _available(spec: api.InferenceDeploymentSpec, obs: Observed, ready: int) -> cond.Observation:
    for pod in obs.pods:
        p = pod_health.problem(pod)
        if p and p.reason != "Unschedulable":
            return cond.Observation(api.AVAILABLE, False, p.reason, p.message)
    if ready >= spec.replicas:
        return cond.Observation(api.AVAILABLE, True, "ReplicasReady", f"{ready}/{spec.replicas} replicas ready")
    return cond.Observation(api.AVAILABLE, False, "ReplicasNotReady", f"{ready}/{spec.replicas} replicas ready")


def _plan_serving(spec: api.InferenceDeploymentSpec, obs: Observed) -> tuple[cond.Observation, bool]:
    d = obs.deployment
    if obs.plan is None or d is None:
        return cond.Observation(api.PLAN_SERVING, None, "NotDeployed"), False
    dstatus = d.get("status") or {}
    template_hash = (d["spec"]["template"]["metadata"].get("annotations") or {}).get(naming.ANNOTATION_PLAN_HASH)
    rolled = (
        template_hash == (obs.template_plan_hash or obs.plan.hash)
        and dstatus.get("observedGeneration", 0) >= d.get("metadata", {}).get("generation", 0)
        and dstatus.get("updatedReplicas", 0) == spec.replicas
        and dstatus.get("readyReplicas", 0) == spec.replicas
        and dstatus.get("replicas", 0) == spec.replicas
    )
    if rolled:
        return cond.Observation(api.PLAN_SERVING, True, "PlanRolledOut", f"all replicas run plan {obs.plan.hash}"), True
    return (
        cond.Observation(
            api.PLAN_SERVING, False, "RolloutInProgress",
            f"{dstatus.get('updatedReplicas', 0)}/{spec.replicas} replicas updated to plan {obs.plan.hash}",
        ),
        False,
    )


def compute(
    name: str, namespace: str, spec: api.InferenceDeploymentSpec, generation: int | None,
    obs: Observed, previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """The operator-owned part of the status (wire form)."""
    previous = previous or {}
    dstatus = (obs.deployment or {}).get("status") or {}
    ready = int(dstatus.get("readyReplicas", 0) or 0)
    if obs.plan_error is not None:
        plan_obs = cond.Observation(api.PLAN_RESOLVED, False, obs.plan_error.reason, obs.plan_error.message)
    else:
        plan_obs = cond.Observation(api.PLAN_RESOLVED, True, "PlanResolved", f"plan {obs.plan.hash} from {obs.plan.source}" if obs.plan else "")
    if obs.missing:
        reason, message = obs.missing[0]
        res_obs = cond.Observation(api.RESOURCES_READY, False, reason, message)
    elif not obs.applied or obs.deployment is None:
        res_obs = cond.Observation(api.RESOURCES_READY, None, "NotApplied", "child objects not written yet")
    else:
        res_obs = cond.Observation(api.RESOURCES_READY, True, "Applied", "Deployment, Service and ConfigMap in place")
    sched = _schedulable(spec, obs)
    avail = _available(spec, obs, ready)
    serving, rolled = _plan_serving(spec, obs)
    observations = [plan_obs, res_obs, sched, avail, serving]

    pod_fatal = any(p is not None and p.fatal for p in map(pod_health.problem, obs.pods))
    if pod_fatal or any(o.ok is False for o in (plan_obs, res_obs, sched)):
        phase = "Degraded" if ready > 0 else "Failed"
    elif all(o.ok for o in observations):
        phase = "Ready"
    elif obs.deployment is None:
        phase = "Pending"
    else:
        phase = "Progressing"

    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "replicas": int(dstatus.get("replicas", 0) or 0),
        "readyReplicas": ready,
        "updatedReplicas": int(dstatus.get("updatedReplicas", 0) or 0),
        "endpoint": deployment_objects.endpoint(name, namespace),
        # issue 8: drift/rollout conditions from the status those timers write; Ready stays ours
        "conditions": cond.merge(previous.get("conditions") or [], observations + rollout.conditions(previous),
                                 generation, ready=cond.aggregate(observations)),
    }
    if obs.plan is not None:
        status["planHash"] = obs.plan.hash
        status["planSource"] = obs.plan.source
    else:
        # An unresolvable plan leaves the configured one in place: keep reporting it.
        status["planHash"] = previous.get("planHash")
        status["planSource"] = previous.get("planSource")
    status["servingPlanHash"] = obs.plan.hash if rolled and obs.plan else previous.get("servingPlanHash")
    return status


def changed(previous: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The keys of `new` that differ from `previous` (a status patch; empty = write nothing)."""
    previous = previous or {}
    return {k: v for k, v in new.items() if previous.get(k) != v}
