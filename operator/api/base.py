"""Building blocks shared by the Anneal API types: the camelCase base model and the small
Kubernetes-shaped types (conditions, tolerations, resources, references, durations).

Everything here is pydantic and torch-free; the CRD YAML is generated from these models
(`anneal.operator.crdgen`), so a field's description is what `kubectl explain` prints.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP = "anneal.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class KubeModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True
    )

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, no unset optionals)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# A Go-style duration limited to what users write in YAML: 30s, 15m, 1h30m, 500ms.
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(text: str) -> float:
    """Seconds in a duration string such as ``1h30m``; a clear error for anything else."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"not a duration: {text!r} (write e.g. 30s, 15m, 1h30m)")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))


# A Kubernetes quantity ("1", "500m", "16Gi", or a bare integer).
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
Quantity = Annotated[
    str | int,
    # The pattern and length only constrain strings (JSON Schema semantics), so integers pass.
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN, "maxLength": 64}),
]
Name = Annotated[
    str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]
# Names used to derive child names (`<name>-fast`, `<name>-coordinator`) must leave room.
ShortName = Annotated[str, Field(min_length=1, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _check_quantity(value: str | int) -> str | int:
    if isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(f"not a Kubernetes quantity: {value!r} (e.g. 500m, 16Gi, 2)")
    return value


QuantityMap = Annotated[dict[str, Quantity], Field(max_length=16)]


class ResourceRequirements(KubeModel):
    """CPU, memory and other non-GPU resources of a container (GPUs have their own field)."""

    requests: QuantityMap = Field(default_factory=dict, description="e.g. {cpu: '4', memory: 32Gi}")
    limits: QuantityMap = Field(default_factory=dict, description="e.g. {memory: 64Gi}")

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, values: dict[str, str | int]) -> dict[str, str | int]:
        for value in values.values():
            _check_quantity(value)
        return values


class Toleration(KubeModel):
    """A core/v1 Toleration: lets pods schedule onto tainted (e.g. GPU) nodes."""

    key: str | None = Field(None, description="taint key; empty with operator Exists matches all")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists matches any value")
    value: str | None = Field(None, description="taint value (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="taint effect to match; empty matches all"
    )
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute only")


class Placement(KubeModel):
    """Where pods may run and what they request: GPUs, other resources, node selection."""

    gpus: int = Field(1, ge=0, le=16, description="GPUs per pod (0 runs on the CPU); an engine uses its "
                      "plan's parallelism.tensor_parallel of them")
    gpu_resource: str = Field(
        "nvidia.com/gpu", min_length=1, max_length=253, description="extended resource name of a GPU"
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="CPU/memory requests and limits"
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="node labels a pod requires"
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="taints the pods tolerate")


class EnvVar(KubeModel):
    """A plain environment variable for the engine container."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="variable name")
    value: str = Field("", max_length=32768, description="variable value")


class SecretKeyRef(KubeModel):
    """A key of a Secret in the resource's own namespace."""

    name: Name = Field(description="Secret name")
    key: str = Field("api-key", min_length=1, max_length=253, description="key inside the Secret")


class ConfigMapKeyRef(KubeModel):
    """A key of a ConfigMap in the resource's own namespace."""

    name: Name = Field(description="ConfigMap name")
    key: str = Field("plan.json", min_length=1, max_length=253, description="key holding the plan JSON")


class PlanSource(KubeModel):
    """Where a plan comes from: a ConfigMap key (Plan or CompiledPlan JSON/YAML) or inline."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.configMapRef) != has(self.inline)",
                    "message": "set exactly one of configMapRef or inline",
                }
            ]
        }
    )

    config_map_ref: ConfigMapKeyRef | None = Field(None, description="a ConfigMap key holding the plan")
    inline: FreeForm | None = Field(None, description="a Plan object (see `anneal.engine.plan.Plan`)")

    @model_validator(mode="after")
    def _exactly_one(self) -> "PlanSource":
        if (self.config_map_ref is None) == (self.inline is None):
            raise ValueError("set exactly one of configMapRef or inline")
        return self


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(KubeModel):
    """One observation about the resource (metav1.Condition shape)."""

    type: str = Field(description="condition type, CamelCase")
    status: ConditionStatus = Field(description="True, False or Unknown")
    reason: str = Field("", description="machine-readable CamelCase reason")
    message: str = Field("", description="what is wrong and what to do")
    last_transition_time: str | None = Field(None, description="RFC 3339 time the status last changed")
    observed_generation: int | None = Field(None, description="spec generation this was computed for")
