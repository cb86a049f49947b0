"""kopf handlers of InferenceDeployment: one level-triggered reconcile, run on create/resume/spec
change and on a timer, that writes the children and the operator-owned status (only when changed).
"""

from __future__ import annotations

from typing import Any

import kopf
from pydantic import ValidationError

from anneal.operator import conditions as cond
from anneal.operator import deployment_objects as objects
from anneal.operator import engine_pod, naming, pod_health, rollout
from anneal.operator.api import GROUP, VERSION
from anneal.operator.api import inference_deployment as api
from anneal.operator.context import Context
from anneal.operator.kube import ApiException, api_message
from anneal.operator.deployment_status import Observed, changed, compute
from anneal.operator.plan_source import PlanError, resolve


def invalid_spec_status(
    previous: dict[str, Any], exc: ValidationError, generation: int | None, phase: str = "Failed"
) -> dict[str, Any]:
    """Status of a spec the API server accepted but the models refuse (a schema/model mismatch or
    a rule only the models check): `phase`, with the reason in Ready; nothing else is touched."""
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())[:1000]
    ready = cond.Observation(cond.READY, False, "InvalidSpec", f"spec: {problems}")
    conditions = [c for c in previous.get("conditions") or [] if c.get("type") != cond.READY]
    return {
        "phase": phase,
        "message": f"invalid spec: {problems}",
        "observedGeneration": generation,
        "conditions": conditions + cond.merge(previous.get("conditions") or [], [], generation, ready=ready),
    }


def report_invalid_spec(
    body: kopf.Body, patch: kopf.Patch, exc: ValidationError, logger: Any, phase: str = "Failed"
) -> None:
    previous = dict(body.get("status") or {})
    new = invalid_spec_status(previous, exc, body.metadata.get("generation"), phase)
    diff = changed(previous, new)
    if diff:
        patch.status.update(diff)
        kopf.warn(body, reason="InvalidSpec", message=new["message"])
    logger.warning("%s", new["message"])


def _check_references(ctx: Context, namespace: str, spec: api.InferenceDeploymentSpec, obs: Observed) -> None:
    kube = ctx.kube
    if spec.model_volume and kube.get("v1", "PersistentVolumeClaim", spec.model_volume.claim_name, namespace) is None:
        obs.missing.append(
            ("ModelVolumeNotFound", f"PersistentVolumeClaim {spec.model_volume.claim_name!r} does not exist in {namespace}")
        )
    if spec.kernel_cache:
        claim = kube.get("v1", "PersistentVolumeClaim", spec.kernel_cache.claim_name, namespace)
        problem = engine_pod.kernel_cache_problem(claim, spec.kernel_cache, "spec.kernelCache", namespace,
                                                  spec.replicas, separate_nodes=False)
        if problem:
            obs.missing.append(problem)
    if spec.gpus:
        obs.gpu_capacity = pod_health.max_allocatable(ctx.nodes(), spec.gpu_resource, spec.node_selector)


def reconcile(ctx: Context, body: kopf.Body, patch: kopf.Patch, logger: Any) -> None:
    name, namespace = body.metadata.name, body.metadata.namespace
    generation = body.metadata.get("generation")
    previous = dict(body.get("status") or {})
    try:
        spec = api.InferenceDeploymentSpec.model_validate(dict(body.spec))
    except ValidationError as exc:
        report_invalid_spec(body, patch, exc, logger)
        return
    kube = ctx.kube
    obs = Observed()

    try:
        obs.plan, obs.plan_error = _resolve_plan(ctx, name, namespace, spec)
        _check_references(ctx, namespace, spec, obs)
        _write_children(ctx, body, spec, obs)
    except ApiException as exc:
        # e.g. a quota or an admission webhook refusing a child: report it, retry next tick
        obs.applied = False
        obs.missing.insert(0, ("ChildWriteFailed", f"cannot write children: {api_message(exc)}"))
    obs.deployment = kube.get("apps/v1", "Deployment", naming.deployment(name), namespace)
    obs.pods = kube.list("v1", "Pod", namespace, naming.deployment_selector(name))
    new = compute(name, namespace, spec, generation, obs, previous)
    diff = changed(previous, new)
    if diff:
        patch.status.update(diff)
        announce(body, previous, new, logger)


def _resolve_plan(ctx: Context, name: str, namespace: str, spec: api.InferenceDeploymentSpec):
    try:
        return resolve(name, spec, lambda cm: ctx.kube.config_map(namespace, cm)), None
    except PlanError as exc:
        return None, exc
    except ValidationError as exc:
        return None, PlanError("InvalidPlan", f"not a valid plan: {exc}")


def _write_children(ctx: Context, body: kopf.Body, spec: api.InferenceDeploymentSpec, obs: Observed) -> None:
    """Admin Secret (once), plan ConfigMap, Deployment, Service; all owned by the deployment."""
    name, namespace = body.metadata.name, body.metadata.namespace
    kube = ctx.kube
    secret = objects.admin_secret(naming.admin_secret(name), namespace, naming.deployment_labels(name))
    kopf.adopt(secret, owner=body)
    kube.create_if_absent(secret)
    if obs.plan is not None:
        plan_hash: str | None = obs.plan.hash
        cm = objects.plan_config_map(name, namespace, obs.plan.plan, obs.plan.source)
        kopf.adopt(cm, owner=body)
        kube.apply(cm)
    else:  # keep serving the plan already configured, if any
        found = kube.config_map(namespace, naming.plan_config_map(name))
        plan_hash = found[1].get(naming.ANNOTATION_PLAN_HASH) if found else None
    if plan_hash is not None and not obs.missing:
        # issue 8: a plan promoted in place keeps the pod template's hash (no restart of the replicas)
        ro = (body.get("status") or {}).get("rollout") or {}
        current = kube.get("apps/v1", "Deployment", naming.deployment(name), namespace) if (
            ro.get("inPlace") or ro.get("promotedInPlace")) else None
        template_hash = rollout.template_plan_hash(body.get("status"), plan_hash, rollout.deployment_template_hash(current))
        obs.template_plan_hash = template_hash
        dep = objects.deployment(name, namespace, spec, template_hash, ctx.settings)
        kopf.adopt(dep, owner=body)
        kube.apply(dep)
    svc = objects.service(name, namespace)
    kopf.adopt(svc, owner=body)
    kube.apply(svc)


# Reasons of a False condition that mean "not yet", not "something is wrong": no Warning events.
PROGRESS_REASONS = frozenset({
    "RolloutInProgress", "ReplicasNotReady", "NotReady", "NotStarted", "NoResultYet", "NotDeployed",
    "NotApplied", "WaitingForEngines", "Finished", "Released",
})


def announce(body: kopf.Body, previous: dict[str, Any], new: dict[str, Any], logger: Any) -> None:
    """Events on transitions: a phase change, and every condition that changed status."""
    if previous.get("phase") != new.get("phase"):
        kind = kopf.warn if new["phase"] in ("Failed", "Degraded") else kopf.info
        ready = cond.find(new.get("conditions"), cond.READY) or {}
        kind(body, reason=new["phase"], message=ready.get("message") or f"phase {new['phase']}")
        logger.info("phase %s -> %s", previous.get("phase"), new["phase"])
    before = {c.get("type") for c in previous.get("conditions") or []}
    for c in cond.transitions(previous.get("conditions") or [], new.get("conditions") or []):
        if c["type"] == cond.READY or c["status"] == "Unknown":
            continue
        problem = c["status"] == "False" and c.get("reason") not in PROGRESS_REASONS
        if c["type"] not in before and not problem:
            continue  # first observation: only problems are news
        kind = kopf.warn if problem else kopf.info
        kind(body, reason=c.get("reason") or c["type"], message=f"{c['type']}={c['status']}: {c.get('message', '')}")


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    # A failed reconcile is retried soon: it is level-triggered, so retrying is always safe.
    backoff = max(5.0, ctx.settings.reconcile_interval)
    kw: dict[str, Any] = dict(group=GROUP, version=VERSION, plural=api.PLURAL, registry=registry, backoff=backoff)

    @kopf.on.resume(**kw)
    @kopf.on.create(**kw)
    @kopf.on.update(**kw, field="spec")
    def apply_inference_deployment(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        """React to spec changes at once."""
        reconcile(ctx, body, patch, logger)

    @kopf.timer(**kw, interval=ctx.settings.reconcile_interval, initial_delay=ctx.settings.reconcile_interval)
    def watch_inference_deployment(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        """Level-triggered: converge children and status whatever events were missed."""
        reconcile(ctx, body, patch, logger)
