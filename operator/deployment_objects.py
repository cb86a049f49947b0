"""The objects an InferenceDeployment owns: Deployment, Service (public port only), plan ConfigMap
and admin-token Secret. Pure builders: same input, same object, so applying them is idempotent."""

from __future__ import annotations

import secrets
from typing import Any

from anneal.engine.plan import Plan
from anneal.operator import engine_pod, naming
from anneal.operator.api.inference_deployment import InferenceDeploymentSpec
from anneal.operator.settings import OperatorSettings


def _meta(name: str, namespace: str, labels: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": dict(labels), **extra}


def engine_config(name: str, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> engine_pod.EngineConfig:
    return engine_pod.EngineConfig(
        model=spec.model,
        image=spec.image or settings.engine_image,
        admin_secret=naming.admin_secret(name),
        placement=spec,
        serving=spec.serving,
        model_volume=spec.model_volume,
        kernel_cache=spec.kernel_cache,
        plan_config_map=naming.plan_config_map(name),
        pull_policy=spec.image_pull_policy,
        run_as_user=settings.engine_run_as_user,
    )


def deployment(
    name: str, namespace: str, spec: InferenceDeploymentSpec, plan_hash: str, settings: OperatorSettings
) -> dict[str, Any]:
    """The engine Deployment. The plan hash in the pod template restarts pods when the plan changes
    (the fallback when a plan cannot be applied in place through the admin API)."""
    labels = naming.deployment_labels(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(naming.deployment(name), namespace, labels),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": naming.deployment_selector(name)},
            # GPUs are scarce: replace pods one by one instead of surging (no double capacity).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0 if spec.gpus else 1, "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": {naming.ANNOTATION_PLAN_HASH: plan_hash}},
                "spec": engine_pod.pod_spec(engine_config(name, spec, settings)),
            },
        },
    }


def service(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(naming.service(name), namespace, naming.deployment_labels(name)),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.deployment_selector(name),
            "ports": [{"name": "http", "port": naming.PUBLIC_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint(name: str, namespace: str) -> str:
    return f"http://{naming.service(name)}.{namespace}.svc:{naming.PUBLIC_PORT}/v1"


def plan_config_map(name: str, namespace: str, plan: Plan, source: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            naming.plan_config_map(name),
            namespace,
            naming.deployment_labels(name),
            annotations={naming.ANNOTATION_PLAN_HASH: plan.hash, naming.ANNOTATION_SOURCE: source},
        ),
        "data": {naming.PLAN_KEY: plan.model_dump_json(indent=2)},
    }


def admin_secret(name: str, namespace: str, labels: dict[str, str], token: str | None = None) -> dict[str, Any]:
    """The admin-API bearer token; created once (never rotated by a reconcile)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(name, namespace, labels),
        "type": "Opaque",
        "stringData": {naming.ADMIN_TOKEN_KEY: token or secrets.token_urlsafe(32)},
    }
