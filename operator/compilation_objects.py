"""The objects a CompilationJob owns: admin-token Secret, coordinator ServiceAccount/Role/RoleBinding,
traffic and result ConfigMaps, the fast- and slow-tier engine pods and the coordinator Job.
Pure builders over a resolved target, unit-tested on the CPU."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from anneal.operator import engine_pod, naming
from anneal.operator.api.base import GROUP, Placement, duration_seconds
from anneal.operator.api.compilation_job import CompilationJobSpec
from anneal.operator.api.inference_deployment import InferenceDeploymentSpec, KernelCache, ModelVolume, Serving
from anneal.operator.settings import OperatorSettings

TIERS = ("fast", "slow")
COORDINATOR_MARGIN_S = 900  # set-up, verification and writing the result, on top of the budget
_RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclass(frozen=True)
class Target:
    """What the engines load and where they run, resolved from the spec (and its deployment)."""

    model: str
    image: str
    placement: Placement
    model_volume: ModelVolume | None = None
    kernel_cache: KernelCache | None = None
    serving: Serving = field(default_factory=Serving)
    deployment: str | None = None
    seed_plans: tuple[str, ...] = ()  # plan JSON of spec.seedPlans, read when the job was resolved
    # the deployment's plan's parallelism.tensor_parallel: the tiers start split as its replicas run,
    # so the search measures (and its winner keeps) the degree the deployment can apply
    tensor_parallel: int = 1


def resolve_target(
    spec: CompilationJobSpec, deployment: InferenceDeploymentSpec | None, settings: OperatorSettings
) -> Target:
    """For a named InferenceDeployment the engines run on its hardware (GPUs, node selection): a plan
    is only valid for the hardware it was measured on. `tiers` adds node selectors/tolerations."""
    t = spec.target
    if deployment is None:
        return Target(
            model=t.model or "",
            image=t.image or settings.engine_image,
            placement=Placement.model_validate(spec.tiers.model_dump(include=set(Placement.model_fields))),
            model_volume=t.model_volume,
            kernel_cache=t.kernel_cache,
        )
    placement = Placement(
        gpus=deployment.gpus,
        gpu_resource=deployment.gpu_resource,
        resources=deployment.resources,
        node_selector={**deployment.node_selector, **spec.tiers.node_selector},
        tolerations=[*deployment.tolerations, *spec.tiers.tolerations],
    )
    serving = Serving(device=deployment.serving.device, env=deployment.serving.env, extra_args=deployment.serving.extra_args)
    return Target(
        model=deployment.model,
        image=t.image or deployment.image or settings.engine_image,
        placement=placement,
        model_volume=deployment.model_volume,
        kernel_cache=t.kernel_cache or deployment.kernel_cache,
        serving=serving,
        deployment=t.inference_deployment,
    )


def _meta(name: str, namespace: str, job: str, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": naming.job_labels(job, component), **extra}


def tier_pod(job: str, namespace: str, tier: str, spec: CompilationJobSpec, target: Target, settings: OperatorSettings) -> dict[str, Any]:
    """One measurement engine. Bare pod, never restarted in place: a dead engine is recreated by the
    operator (counted against `retries`), so the coordinator sees a fresh one."""
    cfg = engine_pod.EngineConfig(
        model=target.model,
        image=target.image,
        admin_secret=naming.job_secret(job),
        placement=target.placement,
        serving=target.serving,
        model_volume=target.model_volume,
        kernel_cache=target.kernel_cache,
        layers=spec.tiers.fast_layers if tier == "fast" else None,
        tensor_parallel=target.tensor_parallel,
        run_as_user=settings.engine_run_as_user,
        bind_pod_ip=True,  # the coordinator dials pod IPs; two CPU engines may share a host
    )
    pod = engine_pod.pod_spec(cfg)
    pod["restartPolicy"] = "Never"
    term = {
        "labelSelector": {"matchLabels": {naming.LABEL_JOB: job, naming.LABEL_COMPONENT: "engine"}},
        "topologyKey": "kubernetes.io/hostname",
    }
    if spec.tiers.spread == "Required":
        pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    else:
        pod["affinity"] = {
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}
        }
    meta = _meta(naming.tier_pod(job, tier), namespace, job, "engine")
    meta["labels"][naming.LABEL_TIER] = tier
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod}


def traffic_arg(job: str, spec: CompilationJobSpec) -> str:
    if spec.traffic.preset is not None:
        return spec.traffic.preset
    return f"{naming.TRAFFIC_MOUNT}/{naming.TRAFFIC_KEY}"


def traffic_config_map(job: str, namespace: str, spec: CompilationJobSpec) -> dict[str, Any] | None:
    if spec.traffic.shape is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(naming.traffic_config_map(job), namespace, job, "traffic"),
        "data": {naming.TRAFFIC_KEY: json.dumps(spec.traffic.shape, indent=2, sort_keys=True)},
    }


def seeds_config_map(job: str, namespace: str, target: Target) -> dict[str, Any] | None:
    """spec.seedPlans as read at provisioning (a ConfigMap they name may change later; the search
    starts from what the job was resolved with)."""
    if not target.seed_plans:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(naming.seeds_config_map(job), namespace, job, "seeds"),
        "data": {naming.seed_key(i): text for i, text in enumerate(target.seed_plans)},
    }


def result_config_map(job: str, namespace: str) -> dict[str, Any]:
    """Created empty by the operator; the coordinator writes the CompiledPlan into it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(naming.result_config_map(job), namespace, job, "result"),
    }


def ledger_config_map(job: str, namespace: str) -> dict[str, Any]:
    """Created empty by the operator; the coordinator keeps its experiment ledger in it, so the one
    started after an engine restart resumes where the last one stopped (its pod's disk is gone)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(naming.ledger_config_map(job), namespace, job, "ledger"),
    }


def service_account(job: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(naming.coordinator(job), namespace, job, "coordinator")}


def role(job: str, namespace: str) -> dict[str, Any]:
    """The coordinator may read its job, patch its status, result and ledger ConfigMaps, and read its engines."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(naming.coordinator(job), namespace, job, "coordinator"),
        "rules": [
            {"apiGroups": [GROUP], "resources": ["compilationjobs"], "resourceNames": [job], "verbs": ["get"]},
            {"apiGroups": [GROUP], "resources": ["compilationjobs/status"], "resourceNames": [job], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [naming.result_config_map(job), naming.ledger_config_map(job)],
             "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": [naming.tier_pod(job, t) for t in TIERS], "verbs": ["get"]},
        ],
    }


def role_binding(job: str, namespace: str) -> dict[str, Any]:
    name = naming.coordinator(job)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(name, namespace, job, "coordinator"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }


def compile_options(job: str, spec: CompilationJobSpec) -> dict[str, Any]:
    """What `anneal compile` gets beyond its flags (env ANNEAL_COMPILE_OPTIONS, JSON)."""
    opts: dict[str, Any] = {
        "agents": list(spec.agents),
        "fastLayers": spec.tiers.fast_layers,
        "verification": {
            "tolerances": {
                "logits_rtol": spec.verification.logits_rtol,
                "min_greedy_agreement": spec.verification.min_greedy_agreement,
                "bit_exact": spec.verification.bit_exact,
            },
            "kvContamination": spec.verification.kv_contamination,
        },
        "resultConfigMap": naming.result_config_map(job),
        "fp8Weights": spec.fp8_weights,
    }
    if spec.llm is not None:
        opts["llm"] = {"provider": spec.llm.provider, "model": spec.llm.model}
    return opts


def coordinator_job(
    job: str, namespace: str, spec: CompilationJobSpec, target: Target, engine_ips: dict[str, str], settings: OperatorSettings
) -> dict[str, Any]:
    """The Job running `anneal compile --engines FAST,SLOW --report-to NS/NAME [--seed-plans ...]`.
    Created only once both engines are ready, so their addresses are known (no cluster DNS needed)."""
    engines = ",".join(f"http://{engine_ips[t]}:{naming.ADMIN_PORT}" for t in TIERS)
    budget_s = int(duration_seconds(spec.budget))
    args = [
        "compile",
        "--model", target.model,
        "--traffic", traffic_arg(job, spec),
        "--budget", str(budget_s),
        "--out", "/work/out",
        "--engines", engines,
        "--report-to", f"{namespace}/{job}",
    ]
    if target.kernel_cache is None:
        # The tiers start on an empty Triton cache (their emptyDir): there compile-ahead ran 3595
        # experiments/h against 1946 without (session 56, one H100, a 250-s chat compile each); on a
        # warm cache (spec.kernelCache) most candidates hit the JIT cache and it cost the H200 13%.
        args.append("--compile-ahead")
    if target.seed_plans:
        args += ["--seed-plans", ",".join(f"{naming.SEEDS_MOUNT}/{naming.seed_key(i)}" for i in range(len(target.seed_plans)))]
    opts = compile_options(job, spec)
    env: list[dict[str, Any]] = [
        engine_pod.admin_token_env(naming.job_secret(job)),
        {"name": "ANNEAL_COMPILE_OPTIONS", "value": json.dumps(opts, sort_keys=True)},
        {"name": "HOME", "value": "/tmp"},
    ]
    if spec.llm is not None:
        var = "ANTHROPIC_API_KEY" if spec.llm.provider == "anthropic" else "OPENAI_API_KEY"
        ref = spec.llm.credentials
        env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    mounts = [{"name": "work", "mountPath": "/work"}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    if spec.traffic.shape is not None:
        mounts.append({"name": "traffic", "mountPath": naming.TRAFFIC_MOUNT, "readOnly": True})
        volumes.append({"name": "traffic", "configMap": {"name": naming.traffic_config_map(job)}})
    if target.seed_plans:
        mounts.append({"name": "seeds", "mountPath": naming.SEEDS_MOUNT, "readOnly": True})
        volumes.append({"name": "seeds", "configMap": {"name": naming.seeds_config_map(job)}})
    c = spec.coordinator
    res = engine_pod.resources(Placement(gpus=0, resources=c.resources))
    pod: dict[str, Any] = {
        "serviceAccountName": naming.coordinator(job),
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.engine_run_as_user,
            "runAsGroup": settings.engine_run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "coordinator",
                "image": c.image or target.image,
                "command": ["anneal"],
                "args": args,
                "env": env,
                "resources": res,
                "volumeMounts": mounts,
                "securityContext": dict(_RESTRICTED),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": volumes,
    }
    if c.node_selector:
        pod["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        pod["tolerations"] = [t.wire() for t in c.tolerations]
    labels = naming.job_labels(job, "coordinator")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(naming.coordinator(job), namespace, job, "coordinator"),
        "spec": {
            "backoffLimit": spec.retries,
            "activeDeadlineSeconds": budget_s + COORDINATOR_MARGIN_S,
            # A new coordinator pod resumes the ledger kept in <job>-ledger. Not worth a new pod: bad
            # flags (2), or a lost engine (3: its address is dead; the operator restarts the engines
            # with a new Job). Not the coordinator's failure: an eviction or preemption.
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "coordinator", "operator": "In",
                                                      "values": [2, naming.EXIT_ENGINES_LOST]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
