"""The engine container and pod spec (`anneal serve`), shared by InferenceDeployment replicas and
CompilationJob tier pods: one place decides ports, probes, GPU requests and the security context."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from anneal.operator import naming
from anneal.operator.api.base import Placement, duration_seconds
from anneal.operator.api.inference_deployment import KernelCache, ModelVolume, Serving

_RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine pod."""

    model: str
    image: str
    admin_secret: str
    placement: Placement
    serving: Serving = field(default_factory=Serving)
    model_volume: ModelVolume | None = None
    kernel_cache: KernelCache | None = None
    plan_config_map: str | None = None
    layers: int | None = None
    tensor_parallel: int = 1  # ranks of a plan-less engine (a CompilationJob's tiers for a split deployment)
    pull_policy: str = "IfNotPresent"
    run_as_user: int = 10001
    bind_pod_ip: bool = False  # listen on the pod IP only (pods reached by IP, never port-forwarded)


def engine_device(serving: Serving, gpus: int) -> str:
    """The ``--device`` an engine pod runs on: the serving setting, else CUDA when it has GPUs."""
    return serving.device or ("cuda" if gpus > 0 else "cpu")


def serve_args(cfg: EngineConfig) -> list[str]:
    """Arguments of `anneal serve` (the engine CLI contract)."""
    args = ["serve", "--model", cfg.model]
    if cfg.plan_config_map:
        args += ["--plan", f"{naming.PLAN_MOUNT}/{naming.PLAN_KEY}"]
    args += ["--host", "$(POD_IP)" if cfg.bind_pod_ip else "0.0.0.0", "--port", str(naming.PUBLIC_PORT), "--admin-port", str(naming.ADMIN_PORT)]
    layers = cfg.layers if cfg.layers is not None else cfg.serving.layers
    if layers is not None:
        args += ["--layers", str(layers)]
    if cfg.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(cfg.tensor_parallel)]
    args += ["--device", engine_device(cfg.serving, cfg.placement.gpus), *cfg.serving.extra_args]
    return args


def resources(placement: Placement) -> dict[str, Any]:
    """Requests/limits with the GPUs added as an extended resource (requests == limits for GPUs)."""
    requests = dict(placement.resources.requests)
    limits = dict(placement.resources.limits)
    if placement.gpus > 0:
        requests[placement.gpu_resource] = placement.gpus
        limits[placement.gpu_resource] = placement.gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = {k: str(v) for k, v in requests.items()}
    if limits:
        out["limits"] = {k: str(v) for k, v in limits.items()}
    return out


def admin_token_env(secret: str) -> dict[str, Any]:
    return {
        "name": "ANNEAL_ADMIN_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": secret, "key": naming.ADMIN_TOKEN_KEY}},
    }


def container(cfg: EngineConfig) -> dict[str, Any]:
    startup_periods = max(1, math.ceil(duration_seconds(cfg.serving.startup_timeout) / 10))
    health = {"httpGet": {"path": "/health", "port": "http"}}
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if cfg.plan_config_map:
        mounts.append({"name": "plan", "mountPath": naming.PLAN_MOUNT, "readOnly": True})
    if cfg.model_volume:
        mounts.append({"name": "model", "mountPath": cfg.model_volume.mount_path, "readOnly": True})
    if cfg.kernel_cache:
        mounts.append({"name": "kernel-cache", "mountPath": naming.KERNEL_CACHE_MOUNT})
    triton_cache = f"{naming.KERNEL_CACHE_MOUNT}/triton" if cfg.kernel_cache else "/tmp/triton"
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        admin_token_env(cfg.admin_secret),
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "TRITON_CACHE_DIR", "value": triton_cache},
        *({"name": e.name, "value": e.value} for e in cfg.serving.env),
    ]
    return {
        "name": "engine",
        "image": cfg.image,
        "imagePullPolicy": cfg.pull_policy,
        "command": ["anneal"],
        "args": serve_args(cfg),
        "ports": [
            {"name": "http", "containerPort": naming.PUBLIC_PORT, "protocol": "TCP"},
            {"name": "admin", "containerPort": naming.ADMIN_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": resources(cfg.placement),
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": startup_periods},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 15, "failureThreshold": 4, "timeoutSeconds": 5},
        "volumeMounts": mounts,
        "securityContext": dict(_RESTRICTED),
        # The last log lines land in the pod status, so a bad model path shows up in a condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def kernel_cache_problem(claim: dict[str, Any] | None, cache: KernelCache, field: str, namespace: str, pods: int,
                         separate_nodes: bool) -> tuple[str, str] | None:
    """Why ``pods`` engine pods cannot use the kernel-cache claim (``claim``: as read, None when it does
    not exist), as a condition reason and message; None when they can. Kubernetes would leave the
    extra pods of a claim they cannot share creating their containers for ever (a multi-attach
    error), so the operator says so instead. ReadWriteOnce is allowed where the pods may share a node."""
    what = f"PersistentVolumeClaim {cache.claim_name!r} ({field})"
    if claim is None:
        return "KernelCacheNotFound", f"{what} does not exist in {namespace}"
    modes = set((claim.get("spec") or {}).get("accessModes") or [])
    if pods <= 1 or not modes or "ReadWriteMany" in modes:
        return None
    if modes <= {"ReadWriteOncePod"}:
        why = f"its access mode ReadWriteOncePod lets one pod mount it and {pods} would; use a ReadWriteMany claim"
    elif separate_nodes and modes <= {"ReadWriteOnce", "ReadWriteOncePod"}:
        why = ("its access mode ReadWriteOnce keeps it on one node and the two tiers must run on two "
               "(tiers.spread Required); use a ReadWriteMany claim or tiers.spread Preferred")
    else:
        return None
    return "KernelCacheNotShared", f"{what}: {why}"


def tolerations(placement: Placement) -> list[dict[str, Any]]:
    out = [t.wire() for t in placement.tolerations]
    if placement.gpus > 0 and not any(t.get("key") == placement.gpu_resource for t in out):
        # GPU nodes are commonly tainted with their resource name.
        out.append({"key": placement.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    return out


def pod_spec(cfg: EngineConfig) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if cfg.plan_config_map:
        volumes.append({"name": "plan", "configMap": {"name": cfg.plan_config_map}})
    if cfg.model_volume:
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": cfg.model_volume.claim_name, "readOnly": True}}
        )
    if cfg.kernel_cache:
        volumes.append({"name": "kernel-cache", "persistentVolumeClaim": {"claimName": cfg.kernel_cache.claim_name}})
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never talk to the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": cfg.run_as_user,
            "runAsGroup": cfg.run_as_user,
            "fsGroup": cfg.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container(cfg)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 30,
    }
    if cfg.placement.node_selector:
        spec["nodeSelector"] = dict(cfg.placement.node_selector)
    tol = tolerations(cfg.placement)
    if tol:
        spec["tolerations"] = tol
    return spec
