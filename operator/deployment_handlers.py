"""kopf handlers of InferenceDeployment: one level-triggered reconcile, run on create/resume/spec
change and on a timer, that writes the children and the operator-owned status (only when changed).
"""

from __future__ import annotations

from typing import Any

import kopf
from pydantic import ValidationError

from anneal.operator import conditions as cond
from anneal.operator import deployment_objects as objects
from anneal.operator import naming, pod_health
from anneal.operator.api import GROUP, VERSION
from anneal.operator.api import inference_deployment as api
from anneal.operator.context import Context
from anneal.operator.deployment_status import Observed, changed, compute
from anneal.operator.plan_source import PlanError, resolve


def parse_spec(spec: dict[str, Any]) -> api.InferenceDeploymentSpec:
    try:
        return api.InferenceDeploymentSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from None


def _check_references(ctx: Context, namespace: str, spec: api.InferenceDeploymentSpec, obs: Observed) -> None:
    kube = ctx.kube
    if spec.model_volume and kube.get("v1", "PersistentVolumeClaim", spec.model_volume.claim_name, namespace) is None:
        obs.missing.append(
            ("ModelVolumeNotFound", f"PersistentVolumeClaim {spec.model_volume.claim_name!r} does not exist in {namespace}")
        )
    if spec.gpus:
        obs.gpu_capacity = pod_health.max_allocatable(kube.list("v1", "Node"), spec.gpu_resource, spec.node_selector)


def reconcile(ctx: Context, body: kopf.Body, patch: kopf.Patch, logger: Any) -> None:
    name, namespace = body.metadata.name, body.metadata.namespace
    generation = body.metadata.get("generation")
    previous = dict(body.get("status") or {})
    spec = parse_spec(body.spec)
    kube = ctx.kube
    obs = Observed()

    secret = objects.admin_secret(naming.admin_secret(name), namespace, naming.deployment_labels(name))
    kopf.adopt(secret, owner=body)
    kube.create_if_absent(secret)

    try:
        obs.plan = resolve(name, spec, lambda cm: kube.config_map(namespace, cm))
    except PlanError as exc:
        obs.plan_error = exc
    except ValidationError as exc:
        obs.plan_error = PlanError("InvalidPlan", f"not a valid plan: {exc}")
    _check_references(ctx, namespace, spec, obs)

    plan_hash = obs.plan.hash if obs.plan else None
    if obs.plan is not None:
        cm = objects.plan_config_map(name, namespace, obs.plan, obs.plan.source)
        kopf.adopt(cm, owner=body)
        kube.apply(cm)
    else:  # keep serving the plan already configured, if any
        found = kube.config_map(namespace, naming.plan_config_map(name))
        plan_hash = found[1].get(naming.ANNOTATION_PLAN_HASH) if found else None
    if plan_hash is not None and not obs.missing:
        dep = objects.deployment(name, namespace, spec, plan_hash, ctx.settings)
        kopf.adopt(dep, owner=body)
        kube.apply(dep)
    svc = objects.service(name, namespace)
    kopf.adopt(svc, owner=body)
    kube.apply(svc)

    obs.deployment = kube.get("apps/v1", "Deployment", naming.deployment(name), namespace)
    obs.pods = kube.list("v1", "Pod", namespace, naming.deployment_selector(name))
    new = compute(name, namespace, spec, generation, obs, previous)
    diff = changed(previous, new)
    if diff:
        patch.status.update(diff)
        announce(body, previous, new, logger)


def announce(body: kopf.Body, previous: dict[str, Any], new: dict[str, Any], logger: Any) -> None:
    """Events on transitions: a phase change, and every condition that changed status."""
    if previous.get("phase") != new.get("phase"):
        kind = kopf.warn if new["phase"] in ("Failed", "Degraded") else kopf.info
        ready = cond.find(new.get("conditions"), cond.READY) or {}
        kind(body, reason=new["phase"], message=ready.get("message") or f"phase {new['phase']}")
        logger.info("phase %s -> %s", previous.get("phase"), new["phase"])
    for c in cond.transitions(previous.get("conditions") or [], new.get("conditions") or []):
        if c["type"] == cond.READY or c["status"] == "Unknown":
            continue
        kind = kopf.info if c["status"] == "True" else kopf.warn
        kind(body, reason=c.get("reason") or c["type"], message=f"{c['type']}={c['status']}: {c.get('message', '')}")


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    kw: dict[str, Any] = dict(group=GROUP, version=VERSION, plural=api.PLURAL, registry=registry)

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
