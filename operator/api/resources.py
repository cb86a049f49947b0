"""What each CRD declares beyond its schema: names, scope, short names, printer columns and
whole-object validation rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from anneal.operator.api import compilation_job as cj
from anneal.operator.api import inference_deployment as idep


@dataclass(frozen=True)
class Resource:
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    spec: type[BaseModel]
    status: type[BaseModel]
    description: str
    printer_columns: tuple[dict[str, Any], ...]
    rules: tuple[dict[str, str], ...] = field(default=())


def _col(name: str, path: str, type_: str = "string", priority: int = 0, description: str = "") -> dict[str, Any]:
    col: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path}
    if priority:
        col["priority"] = priority
    if description:
        col["description"] = description
    return col


_AGE = _col("Age", ".metadata.creationTimestamp", "date")

INFERENCE_DEPLOYMENT = Resource(
    kind=idep.KIND,
    plural=idep.PLURAL,
    singular="inferencedeployment",
    short_names=("infdep", "idep"),
    spec=idep.InferenceDeploymentSpec,
    status=idep.InferenceDeploymentStatus,
    description="A served model: engine pods running `anneal serve` with a compiled plan, and the "
    "policy that recompiles the plan when the traffic drifts.",
    printer_columns=(
        _col("Model", ".spec.model"),
        _col("Replicas", ".spec.replicas", "integer"),
        _col("Ready", ".status.readyReplicas", "integer"),
        _col("Phase", ".status.phase"),
        _col("Plan", ".status.planHash", description="hash of the configured plan"),
        _col("Drift", ".status.drift.score", "number"),
        _col("Rollout", ".status.rollout.state"),
        _col("Mode", ".spec.compilation.mode", priority=1),
        _col("Endpoint", ".status.endpoint", priority=1),
        _AGE,
    ),
    rules=(
        {
            "rule": "size(self.metadata.name) <= 48",
            "message": "name must be at most 48 characters (child objects append suffixes)",
        },
    ),
)

COMPILATION_JOB = Resource(
    kind=cj.KIND,
    plural=cj.PLURAL,
    singular="compilationjob",
    short_names=("cjob",),
    spec=cj.CompilationJobSpec,
    status=cj.CompilationJobStatus,
    description="One search for a faster plan: a fast-tier and a slow-tier engine pod and a coordinator "
    "Job running `anneal compile`; the verified result lands in a ConfigMap named in the status.",
    printer_columns=(
        _col("Target", ".spec.target.inferenceDeployment"),
        _col("Phase", ".status.phase"),
        _col("Experiments", ".status.experiments", "integer"),
        _col("Speedup", ".status.bestSpeedup", "number"),
        _col("Plan", ".status.resultPlanHash"),
        _col("Budget", ".spec.budget", priority=1),
        _col("Message", ".status.message", priority=1),
        _AGE,
    ),
    rules=(
        {
            "rule": "size(self.metadata.name) <= 40",
            "message": "name must be at most 40 characters (child objects append suffixes)",
        },
        {
            "rule": "!has(oldSelf.status) || !has(oldSelf.status.phase) || "
            "oldSelf.status.phase in ['Pending', 'Provisioning'] || self.spec == oldSelf.spec",
            "message": "spec is frozen once the search has started; create a new CompilationJob",
        },
    ),
)

RESOURCES = (INFERENCE_DEPLOYMENT, COMPILATION_JOB)
