"""A corpus of resources the API must refuse, checked here against the generated OpenAPI schema
(jsonschema) and the pydantic models; e2e/test_operator_schema.py sends the same corpus to a real
API server. Each case names the layer that catches it on the server: `schema` (OpenAPI),
`cel` (x-kubernetes-validations) or `strict` (unknown field, refused under strict field validation)."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from anneal.operator import crdgen
from anneal.operator.api import CompilationJobSpec, InferenceDeploymentSpec
from anneal.operator.api.resources import COMPILATION_JOB, INFERENCE_DEPLOYMENT

API = "anneal.dev/v1alpha1"


def valid_inference_deployment(name: str = "llama") -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": "random:llama-3.2-1b",
            "replicas": 2,
            "gpus": 1,
            "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": 64000000000}},
            "nodeSelector": {"anneal.dev/node-type": "kwok-gpu"},
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
            "serving": {"device": "cuda", "extraArgs": ["--max-num-seqs", "64"], "startupTimeout": "20m"},
            "plan": {"inline": {"scheduler": {"max_num_seqs": 32}}},
            "compilation": {
                "mode": "preview",
                "drift": {"threshold": 0.3, "cooldown": "2h"},
                "rollout": {"canary": {"gates": [{"name": "p95-ttft", "query": "histogram_quantile(0.95, x)", "max": 0.5}]}},
            },
        },
    }


def valid_compilation_job(name: str = "llama-chat") -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "CompilationJob",
        "metadata": {"name": name},
        "spec": {
            "target": {"inferenceDeployment": "llama"},
            "traffic": {"preset": "chat"},
            "budget": "30m",
            "deadline": "2h",
            "tiers": {"fastLayers": 2, "spread": "Required"},
            "llm": {"credentials": {"name": "anthropic", "key": "api-key"}},
            "autoApply": True,
        },
    }


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    keys = path.split(".")
    node = obj
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1])
    elif isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value
    return obj


_DELETE = object()
I, C = valid_inference_deployment, valid_compilation_job

# (id, layer, resource)
INVALID: list[tuple[str, str, dict[str, Any]]] = [
    ("idep-no-spec", "schema", _set(I(), "spec", _DELETE)),
    ("idep-no-model", "schema", _set(I(), "spec.model", _DELETE)),
    ("idep-empty-model", "schema", _set(I(), "spec.model", "")),
    ("idep-model-with-spaces", "schema", _set(I(), "spec.model", "my model")),
    ("idep-model-relative-path", "schema", _set(I(), "spec.model", "models")),
    ("idep-negative-replicas", "schema", _set(I(), "spec.replicas", -1)),
    ("idep-replicas-string", "schema", _set(I(), "spec.replicas", "two")),
    ("idep-too-many-gpus", "schema", _set(I(), "spec.gpus", 17)),
    ("idep-pull-policy", "schema", _set(I(), "spec.imagePullPolicy", "Sometimes")),
    ("idep-device", "schema", _set(I(), "spec.serving.device", "tpu")),
    ("idep-zero-layers", "schema", _set(I(), "spec.serving.layers", 0)),
    ("idep-startup-timeout-words", "schema", _set(I(), "spec.serving.startupTimeout", "10 minutes")),
    ("idep-env-name", "schema", _set(I(), "spec.serving.env", [{"name": "1BAD", "value": "x"}])),
    ("idep-too-many-args", "schema", _set(I(), "spec.serving.extraArgs", ["-x"] * 65)),
    ("idep-mode", "schema", _set(I(), "spec.compilation.mode", "yes")),
    ("idep-threshold-out-of-range", "schema", _set(I(), "spec.compilation.drift.threshold", 150.0)),
    ("idep-negative-min-requests", "schema", _set(I(), "spec.compilation.drift.minRequests", -5)),
    ("idep-cooldown-words", "schema", _set(I(), "spec.compilation.drift.cooldown", "6 hours")),
    ("idep-prometheus-url", "schema", _set(I(), "spec.compilation.prometheus.url", "prometheus:9090")),
    ("idep-rtol-zero", "schema", _set(I(), "spec.compilation.verification.logitsRtol", 0)),
    ("idep-rollout-type", "schema", _set(I(), "spec.compilation.rollout.type", "BlueGreen")),
    ("idep-failure-limit", "schema", _set(I(), "spec.compilation.rollout.canary.failureLimit", -1)),
    ("idep-toleration-operator", "schema", _set(I(), "spec.tolerations.0.operator", "Maybe")),
    ("idep-toleration-seconds", "schema", _set(I(), "spec.tolerations.0.tolerationSeconds", -1)),
    ("idep-model-volume-no-claim", "schema", _set(I(), "spec.modelVolume", {"mountPath": "/models"})),
    ("idep-pinned-plan-ref-no-name", "schema", _set(I(), "spec.compilation.pinnedPlan", {"configMapRef": {"key": "plan.json"}})),
    ("idep-cpu-not-quantity", "schema", _set(I(), "spec.resources.requests.cpu", "lots")),
    ("idep-plan-both-sources", "cel", _set(I(), "spec.plan.configMapRef", {"name": "p"})),
    ("idep-plan-no-source", "cel", _set(I(), "spec.plan", {})),
    ("idep-gate-unbounded", "cel", _set(I(), "spec.compilation.rollout.canary.gates.0.max", _DELETE)),
    ("idep-name-too-long", "cel", _set(I(), "metadata.name", "a" * 49)),
    ("idep-unknown-field", "strict", _set(I(), "spec.gpuCount", 2)),
    ("cjob-no-target", "schema", _set(C(), "spec.target", _DELETE)),
    ("cjob-traffic-preset", "schema", _set(C(), "spec.traffic.preset", "chatty")),
    ("cjob-budget-words", "schema", _set(C(), "spec.budget", "forever")),
    ("cjob-too-many-retries", "schema", _set(C(), "spec.retries", 11)),
    ("cjob-fast-layers-zero", "schema", _set(C(), "spec.tiers.fastLayers", 0)),
    ("cjob-spread", "schema", _set(C(), "spec.tiers.spread", "Always")),
    ("cjob-no-agents", "schema", _set(C(), "spec.agents", [])),
    ("cjob-unknown-agent", "schema", _set(C(), "spec.agents", ["search"])),
    ("cjob-llm-writer-without-llm", "cel", _set(_set(C(), "spec.agents", ["llm-writer"]), "spec.llm", _DELETE)),
    ("cjob-llm-no-credentials", "schema", _set(C(), "spec.llm", {"provider": "anthropic"})),
    ("cjob-llm-provider", "schema", _set(C(), "spec.llm.provider", "mistral")),
    ("cjob-greedy-agreement", "schema", _set(C(), "spec.verification.minGreedyAgreement", 1.5)),
    ("cjob-target-empty", "cel", _set(C(), "spec.target", {})),
    ("cjob-target-both", "cel", _set(C(), "spec.target.model", "random:tiny")),
    ("cjob-traffic-both", "cel", _set(C(), "spec.traffic.shape", {"prompt_len": {"mean": 100}})),
    ("cjob-budget-too-short", "cel", _set(C(), "spec.budget", "5s")),
    ("cjob-deadline-before-budget", "cel", _set(C(), "spec.deadline", "10m")),
    ("cjob-auto-apply-explicit-model", "cel", _set(_set(C(), "spec.target", {"model": "random:tiny"}), "spec.autoApply", True)),
    ("cjob-memory-not-quantity", "schema", _set(C(), "spec.coordinator.resources", {"requests": {"memory": "lots"}})),
    ("cjob-name-too-long", "cel", _set(C(), "metadata.name", "b" * 41)),
    ("cjob-unknown-field", "strict", _set(C(), "spec.budgetSeconds", 60)),
]


def _schema(kind: str) -> dict[str, Any]:
    resource = INFERENCE_DEPLOYMENT if kind == "InferenceDeployment" else COMPILATION_JOB
    return crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _pydantic_accepts(obj: dict[str, Any]) -> bool:
    model = InferenceDeploymentSpec if obj["kind"] == "InferenceDeployment" else CompilationJobSpec
    limit = 48 if obj["kind"] == "InferenceDeployment" else 40
    if len(obj["metadata"]["name"]) > limit or "spec" not in obj:
        return False
    try:
        model.model_validate(obj["spec"])
        return True
    except ValidationError:
        return False


def test_corpus_is_large_and_ids_unique():
    ids = [case[0] for case in INVALID]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("obj", [I(), C(), _set(_set(C(), "spec.target", {"model": "/models/llama", "modelVolume": {"claimName": "models"}}), "spec.autoApply", False)])
def test_valid_examples_pass_schema_and_models(obj):
    jsonschema.Draft4Validator(_schema(obj["kind"])).validate(obj)
    assert _pydantic_accepts(obj)


@pytest.mark.parametrize("case_id,layer,obj", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_resource_is_refused(case_id, layer, obj):
    assert not _pydantic_accepts(obj), f"{case_id}: the models accept it"
    errors = list(jsonschema.Draft4Validator(_schema(obj["kind"])).iter_errors(obj))
    if layer == "schema":
        assert errors, f"{case_id}: the generated OpenAPI schema accepts it"
    else:
        # CEL rules and strict field validation are evaluated by the API server only (see e2e);
        # here it must pass the OpenAPI layer, or the case is mislabelled.
        assert not errors, f"{case_id} is caught by the OpenAPI schema; label it 'schema'"
