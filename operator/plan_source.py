"""Which plan an InferenceDeployment serves, and from where.

Order: `compilation.pinnedPlan` > the compiled plan the deployment accepted (ConfigMap
`<name>-compiled`, only while `spec.plan` is still the plan it was compiled from) > `spec.plan` >
the default plan of the pods' device (`default_plan`: the hand-set Triton plan on CUDA, the reference
plan on the CPU). Reading ConfigMaps is passed in, so the decision is a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from anneal.engine.plan import CompiledPlan, Plan, default_plan, load_plan
from anneal.operator import naming
from anneal.operator.api.base import PlanSource
from anneal.operator.api.inference_deployment import InferenceDeploymentSpec
from anneal.operator.engine_pod import engine_device

# name -> (data, annotations), or None when the ConfigMap does not exist.
ReadConfigMap = Callable[[str], "tuple[dict[str, str], dict[str, str]] | None"]


class PlanError(Exception):
    """The plan cannot be resolved; `reason` is a condition reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ResolvedPlan:
    plan: Plan
    source: str
    speedup: float | None = None

    @property
    def hash(self) -> str:
        return self.plan.hash


def from_source(src: PlanSource, read: ReadConfigMap, label: str) -> Plan:
    """The plan `src` names (PlanError when it cannot be read or is not a plan)."""
    if src.inline is not None:
        return Plan.model_validate(src.inline)
    ref = src.config_map_ref
    assert ref is not None
    found = read(ref.name)
    if found is None:
        raise PlanError("PlanConfigMapNotFound", f"{label}: ConfigMap {ref.name!r} does not exist")
    data, _ = found
    if ref.key not in data:
        raise PlanError("PlanKeyNotFound", f"{label}: ConfigMap {ref.name!r} has no key {ref.key!r}")
    try:
        return load_plan(data[ref.key])
    except Exception as exc:  # pydantic or JSON/YAML errors: all mean "not a plan"
        raise PlanError("InvalidPlan", f"{label}: {ref.name}/{ref.key} is not a valid plan: {exc}") from None


def speedup(compiled: CompiledPlan) -> float | None:
    """The first throughput-like gain ratio of a compiled plan (what users read as 'speedup')."""
    for gain in compiled.gains:
        if gain.baseline and gain.candidate:
            return round(gain.ratio, 4)
    return None


def base_plan(spec: InferenceDeploymentSpec, read: ReadConfigMap) -> ResolvedPlan:
    """`spec.plan`, or the default plan of the device the pods run on."""
    if spec.plan is None:
        return ResolvedPlan(default_plan(engine_device(spec.serving, spec.gpus)), "default")
    return ResolvedPlan(from_source(spec.plan, read, "spec.plan"), "spec.plan")


def resolve(name: str, spec: InferenceDeploymentSpec, read: ReadConfigMap) -> ResolvedPlan:
    if spec.compilation.pinned_plan is not None:
        return ResolvedPlan(from_source(spec.compilation.pinned_plan, read, "pinnedPlan"), "pinnedPlan")
    base = base_plan(spec, read)
    found = read(naming.compiled_plan_config_map(name))
    if found is not None:
        data, annotations = found
        if annotations.get(naming.ANNOTATION_BASE_PLAN_HASH) == base.hash and naming.PLAN_KEY in data:
            try:
                compiled = CompiledPlan.model_validate_json(data[naming.PLAN_KEY])
            except Exception as exc:
                raise PlanError("InvalidPlan", f"compiled plan {naming.compiled_plan_config_map(name)}: {exc}") from None
            source = annotations.get(naming.ANNOTATION_SOURCE, "compiled")
            return ResolvedPlan(compiled.plan, source, speedup(compiled))
    return base
