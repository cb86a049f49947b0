"""kopf handlers of CompilationJob: a level-triggered reconcile that provisions the two engine
pods and the coordinator Job, follows the search into the status, applies a verified result when
`autoApply` says so, and a finalizer that releases the GPUs on deletion. A failed or deleted job
never touches the live deployment."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

import kopf
from pydantic import ValidationError

from anneal.engine.plan import CompiledPlan
from anneal.operator import compilation_objects as objects
from anneal.operator import conditions as cond
from anneal.operator import deployment_objects, engine_pod, naming, plan_source, pod_health
from anneal.operator.api import GROUP, VERSION
from anneal.operator.api import compilation_job as api
from anneal.operator.api import inference_deployment as idep_api
from anneal.operator.api.base import now_iso
from anneal.operator.compilation_status import (
    APPLY_RESULT, KEEP_SUPPORT, PROVISION, RELEASE_ENGINES, RESTART_ENGINES, START_COORDINATOR, STOP_COORDINATOR, JobObserved, decide,
    validate_result,
)
from anneal.operator.context import Context
from anneal.operator.kube import ApiException, api_message
from anneal.operator.deployment_handlers import announce, report_invalid_spec


def _parse_time(raw: Any) -> datetime | None:
    return datetime.fromisoformat(str(raw).replace("Z", "+00:00")) if raw else None


def _created_at(body: kopf.Body) -> datetime:
    return _parse_time(body.metadata.get("creationTimestamp")) or datetime.now(timezone.utc)


def resolve_target(ctx: Context, namespace: str, spec: api.CompilationJobSpec) -> tuple[objects.Target | None, tuple[str, str] | None]:
    """The target, or why it cannot work (a condition reason and message, never a crash loop)."""
    kube = ctx.kube
    deployment = None
    if spec.target.inference_deployment:
        found = kube.get(f"{GROUP}/{VERSION}", idep_api.KIND, spec.target.inference_deployment, namespace)
        if found is None:
            return None, ("TargetNotFound", f"InferenceDeployment {spec.target.inference_deployment!r} does not exist in {namespace}")
        try:
            deployment = idep_api.InferenceDeploymentSpec.model_validate(found.get("spec") or {})
        except ValidationError as exc:
            return None, ("TargetInvalid", f"InferenceDeployment {spec.target.inference_deployment!r}: {exc}")
    if spec.traffic.shape is not None:
        from anneal.engine.traffic import parse_traffic  # torch-free

        try:
            parse_traffic(spec.traffic.shape, source="spec.traffic.shape")
        except ValueError as exc:
            return None, ("InvalidTraffic", str(exc)[:500])
    target = objects.resolve_target(spec, deployment, ctx.settings)

    def read(cm: str):
        return kube.config_map(namespace, cm)

    seeds = []
    for i, src in enumerate(spec.seed_plans):
        try:
            plan = plan_source.from_source(src, read, f"spec.seedPlans[{i}]")
        except plan_source.PlanError as err:
            return None, (f"Seed{err.reason}", err.message)
        except ValidationError as exc:  # an inline plan that is not one
            return None, ("SeedInvalidPlan", f"spec.seedPlans[{i}]: not a valid plan: {exc}"[:500])
        seeds.append(plan.model_dump_json())
    target = dataclasses.replace(target, seed_plans=tuple(seeds))
    if deployment is not None:  # the tiers run at the degree of the plan its replicas serve
        try:
            served = plan_source.resolve(spec.target.inference_deployment, deployment, read)
        except plan_source.PlanError as err:
            return None, (f"Target{err.reason}", f"InferenceDeployment {spec.target.inference_deployment!r}: {err.message}"[:500])
        except ValidationError as exc:
            return None, ("TargetInvalidPlan", f"InferenceDeployment {spec.target.inference_deployment!r}: {exc}"[:500])
        target = dataclasses.replace(target, tensor_parallel=served.plan.parallelism.tensor_parallel)
    if spec.llm is not None:
        secret = kube.get("v1", "Secret", spec.llm.credentials.name, namespace)
        if secret is None:
            return None, ("SecretNotFound", f"Secret {spec.llm.credentials.name!r} (spec.llm.credentials) does not exist in {namespace}")
        if spec.llm.credentials.key not in (secret.get("data") or {}):
            return None, ("SecretKeyNotFound", f"Secret {spec.llm.credentials.name!r} has no key {spec.llm.credentials.key!r}")
    if target.model_volume and kube.get("v1", "PersistentVolumeClaim", target.model_volume.claim_name, namespace) is None:
        return None, ("ModelVolumeNotFound", f"PersistentVolumeClaim {target.model_volume.claim_name!r} does not exist in {namespace}")
    if target.kernel_cache:
        claim = kube.get("v1", "PersistentVolumeClaim", target.kernel_cache.claim_name, namespace)
        # the two tiers, and the deployment's own pods when they share its claim
        shared = deployment is not None and deployment.kernel_cache == target.kernel_cache
        pods = len(objects.TIERS) + (deployment.replicas if shared else 0)
        problem = engine_pod.kernel_cache_problem(claim, target.kernel_cache, "kernelCache", namespace, pods,
                                                  separate_nodes=spec.tiers.spread == "Required")
        if problem:
            return None, problem
    placement = target.placement
    if placement.gpus:
        capacity = pod_health.max_allocatable(ctx.nodes(), placement.gpu_resource, placement.node_selector)
        if capacity < placement.gpus:
            return None, (
                "InsufficientGPUs",
                f"each engine requests {placement.gpus} {placement.gpu_resource} but the largest matching node offers {capacity}",
            )
    return target, None


def _owned(body: kopf.Body, obj: dict[str, Any] | None) -> dict[str, Any] | None:
    if obj is not None:
        kopf.adopt(obj, owner=body)
    return obj


def provision(ctx: Context, body: kopf.Body, spec: api.CompilationJobSpec, target: objects.Target, engines: bool = True) -> None:
    """Every child but the coordinator (and, without `engines`, but the engine pods), each created
    only if absent (safe to repeat after a restart)."""
    name, ns = body.metadata.name, body.metadata.namespace
    children = [
        deployment_objects.admin_secret(naming.job_secret(name), ns, naming.job_labels(name, "engine")),
        objects.service_account(name, ns),
        objects.role(name, ns),
        objects.role_binding(name, ns),
        objects.result_config_map(name, ns),
        objects.ledger_config_map(name, ns),
        objects.traffic_config_map(name, ns, spec),
        objects.seeds_config_map(name, ns, target),
        *(objects.tier_pod(name, ns, tier, spec, target, ctx.settings) for tier in objects.TIERS if engines),
    ]
    for child in children:
        if child is not None:
            ctx.kube.create_if_absent(_owned(body, child))


def release_engines(ctx: Context, name: str, namespace: str) -> None:
    for tier in objects.TIERS:
        ctx.kube.delete("v1", "Pod", naming.tier_pod(name, tier), namespace)


def apply_result(ctx: Context, body: kopf.Body, spec: api.CompilationJobSpec, compiled: CompiledPlan, logger: Any) -> str | None:
    """Hand a verified plan to the target InferenceDeployment: accepted (autoApply) or proposed
    (preview). Returns the deployment's name when the plan was accepted."""
    target = spec.target.inference_deployment
    if not target:
        return None
    name, ns = body.metadata.name, body.metadata.namespace
    kube = ctx.kube
    found = kube.get(f"{GROUP}/{VERSION}", idep_api.KIND, target, ns)
    if found is None:
        kopf.warn(body, reason="TargetGone", message=f"InferenceDeployment {target} no longer exists; result kept")
        return None
    dspec = idep_api.InferenceDeploymentSpec.model_validate(found.get("spec") or {})
    ref = {
        "hash": compiled.plan_hash,
        "source": f"CompilationJob/{name}",
        "configMap": naming.result_config_map(name),
    }
    gain = plan_source.speedup(compiled)
    if gain is not None:
        ref["speedup"] = gain
    policy = dspec.compilation
    hold = "paused" if policy.paused else ("pinnedPlan is set" if policy.pinned_plan else None)
    # issue 8: with mode auto and a Canary strategy, autoApply hands the plan to the canary
    # rollout (anneal.operator.rollout_handlers) instead of restarting every replica at once
    canary = spec.auto_apply and policy.mode == "auto" and policy.rollout.type == "Canary"
    if not spec.auto_apply or hold or canary:
        kube.patch_merge(f"{GROUP}/{VERSION}", idep_api.KIND, target, ns,
                         {"status": {"proposedPlan": ref, "lastCompilationJob": name}}, status=True)
        if hold:
            kopf.info(body, reason="NotApplied", message=f"{target}: {hold}; plan proposed in its status")
        elif canary:
            kopf.info(body, reason="CanaryPending", message=f"{target}: plan proposed; its canary rollout follows")
        return None
    base = plan_source.base_plan(dspec, lambda cm: kube.config_map(ns, cm))
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": naming.compiled_plan_config_map(target),
            "namespace": ns,
            "labels": naming.deployment_labels(target),
            "annotations": {
                naming.ANNOTATION_BASE_PLAN_HASH: base.hash,
                naming.ANNOTATION_SOURCE: f"CompilationJob/{name}",
                naming.ANNOTATION_PLAN_HASH: compiled.plan_hash,
            },
        },
        "data": {naming.PLAN_KEY: compiled.model_dump_json(indent=2)},
    }
    kopf.adopt(cm, owner=kopf.Body(found))  # owned by the deployment: outlives this job
    kube.apply(cm)
    kube.patch_merge(f"{GROUP}/{VERSION}", idep_api.KIND, target, ns,
                     {"status": {"lastCompilationJob": name, "proposedPlan": None}}, status=True)
    logger.info("applied plan %s to %s", compiled.plan_hash, target)
    return target


def reconcile(ctx: Context, body: kopf.Body, patch: kopf.Patch, logger: Any) -> None:
    name, ns = body.metadata.name, body.metadata.namespace
    previous = dict(body.get("status") or {})
    try:
        spec = api.CompilationJobSpec.model_validate(dict(body.spec))
    except ValidationError as exc:
        # Pending, not Failed: the spec stays editable (it freezes once the search starts).
        report_invalid_spec(body, patch, exc, logger, phase=previous.get("phase") or "Pending")
        return
    kube = ctx.kube
    phase = previous.get("phase") or "Pending"

    target, problem = (None, None)
    if phase not in api.TERMINAL_PHASES:
        target, problem = resolve_target(ctx, ns, spec)
    obs = JobObserved(
        phase=phase,
        created_at=_created_at(body),
        now=datetime.now(timezone.utc),
        deadline_s=spec.deadline_seconds(),
        retries=spec.retries,
        restarts=int(previous.get("engineRestarts") or 0),
        last_restart_at=_parse_time(previous.get("lastRestartAt")),
        target_problem=problem,
        pods={t: kube.get("v1", "Pod", naming.tier_pod(name, t), ns) for t in objects.TIERS},
        job=kube.get("batch/v1", "Job", naming.coordinator(name), ns),
        progress=dict(previous.get("progress") or {}),
    )
    if obs.job is not None:
        obs.coordinator_pods = kube.list("v1", "Pod", ns, {"job-name": naming.coordinator(name)})
        found = kube.config_map(ns, naming.result_config_map(name))
        obs.result = found[0] if found else None
    decision = decide(obs)

    new: dict[str, Any] = {
        "phase": decision.phase,
        "message": decision.message,
        "observedGeneration": body.metadata.get("generation"),
        "engineRestarts": decision.restarts,
        "fastPod": naming.tier_pod(name, "fast"),
        "slowPod": naming.tier_pod(name, "slow"),
        "resultConfigMap": naming.result_config_map(name),
    }
    progress = obs.progress
    if progress.get("experiments") is not None:
        new["experiments"] = int(progress["experiments"])
    if progress.get("bestSpeedup") is not None:
        new["bestSpeedup"] = progress["bestSpeedup"]
    nodes = sorted({(p.get("spec") or {}).get("nodeName") for p in obs.pods.values() if p and (p.get("spec") or {}).get("nodeName")})
    if nodes:
        new["nodes"] = nodes

    try:
        _execute(ctx, body, spec, target, decision, obs, previous, new, logger)
    except ApiException as exc:
        # e.g. a quota, an admission webhook or a missing ServiceAccount: say so, retry next tick
        new["message"] = f"cannot write children: {api_message(exc)}"
        if previous.get("message") != new["message"]:
            kopf.warn(body, reason="ChildWriteFailed", message=new["message"][:1000])
    if decision.result_hash:
        new["resultPlanHash"] = decision.result_hash
    if decision.best_speedup is not None:
        new["bestSpeedup"] = decision.best_speedup
    if obs.job is not None:
        new["coordinatorJob"] = naming.coordinator(name)
    if decision.phase != "Pending":
        new["startedAt"] = previous.get("startedAt") or now_iso()
    if decision.phase in api.TERMINAL_PHASES and phase not in api.TERMINAL_PHASES:
        new["completedAt"] = now_iso()
    if phase in api.TERMINAL_PHASES:
        new = {k: v for k, v in new.items() if k not in ("message", "phase")}  # a finished job's outcome stays
    new["conditions"] = cond.merge(
        previous.get("conditions") or [], decision.conditions, body.metadata.get("generation"), ready=decision.ready
    )
    if phase in api.TERMINAL_PHASES:
        new.pop("conditions")
    diff = {k: v for k, v in new.items() if previous.get(k) != v}
    if diff:
        patch.status.update(diff)
        announce(body, previous, {**previous, **new}, logger)


def _execute(ctx: Context, body: kopf.Body, spec: api.CompilationJobSpec, target: objects.Target | None,
             decision: Any, obs: JobObserved, previous: dict[str, Any], new: dict[str, Any], logger: Any) -> None:
    """Carry out the actions `decide` chose, recording what they produced in `new`."""
    name, ns = body.metadata.name, body.metadata.namespace
    kube = ctx.kube
    if target is None and {PROVISION, KEEP_SUPPORT, START_COORDINATOR} & set(decision.actions):
        new["message"] = f"target unavailable: {obs.target_problem[1] if obs.target_problem else 'unknown'}"
    for action in decision.actions:
        if action in (PROVISION, KEEP_SUPPORT) and target is not None:
            provision(ctx, body, spec, target, engines=action == PROVISION)
        elif action == START_COORDINATOR and target is not None:
            ips = {t: (obs.pods[t] or {}).get("status", {}).get("podIP") for t in objects.TIERS}
            if not all(ips.values()):
                raise kopf.TemporaryError("engines are ready but have no pod IP yet", delay=5)
            job = objects.coordinator_job(name, ns, spec, target, ips, ctx.settings)
            kube.create_if_absent(_owned(body, job))
            new["coordinatorJob"] = naming.coordinator(name)
            new["searchStartedAt"] = previous.get("searchStartedAt") or now_iso()
        elif action == RESTART_ENGINES:
            kube.delete("batch/v1", "Job", naming.coordinator(name), ns)
            release_engines(ctx, name, ns)
            new["lastRestartAt"] = now_iso()
        elif action == RELEASE_ENGINES:
            release_engines(ctx, name, ns)
        elif action == STOP_COORDINATOR:
            kube.patch_merge("batch/v1", "Job", naming.coordinator(name), ns, {"spec": {"suspend": True}})
        elif action == APPLY_RESULT and not previous.get("resultPlanHash"):
            compiled, _ = validate_result(obs.result)
            assert compiled is not None  # decide() only asks for this with a valid result
            applied = apply_result(ctx, body, spec, compiled, logger)
            if applied:
                new["appliedTo"] = applied


def register(registry: kopf.OperatorRegistry, ctx: Context) -> None:
    # A failed reconcile is retried soon: it is level-triggered, so retrying is always safe.
    backoff = max(5.0, ctx.settings.reconcile_interval)
    kw: dict[str, Any] = dict(group=GROUP, version=VERSION, plural=api.PLURAL, registry=registry, backoff=backoff)

    @kopf.on.resume(**kw)
    @kopf.on.create(**kw)
    def start_compilation_job(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        """Start provisioning at once (the spec is frozen by the API server once searching)."""
        reconcile(ctx, body, patch, logger)

    @kopf.timer(**kw, interval=ctx.settings.reconcile_interval, initial_delay=ctx.settings.reconcile_interval)
    def watch_compilation_job(body: kopf.Body, patch: kopf.Patch, logger: Any, **_: Any) -> None:
        """Level-triggered: follow engines, coordinator and deadline whatever events were missed."""
        reconcile(ctx, body, patch, logger)

    @kopf.on.delete(**kw)
    def release_compilation_job(body: kopf.Body, logger: Any, **_: Any) -> None:
        """Finalizer: stop the coordinator and free the GPUs before the job disappears. Never
        touches the target deployment."""
        name, ns = body.metadata.name, body.metadata.namespace
        ctx.kube.delete("batch/v1", "Job", naming.coordinator(name), ns)
        release_engines(ctx, name, ns)
        left = [t for t in objects.TIERS if ctx.kube.get("v1", "Pod", naming.tier_pod(name, t), ns) is not None]
        if left:
            raise kopf.TemporaryError(f"waiting for engine pods {left} to terminate", delay=3)
        logger.info("released %s", name)
