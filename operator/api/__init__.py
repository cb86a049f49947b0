"""The Anneal Kubernetes API (group `anneal.dev`, version `v1alpha1`) as pydantic models.

One module per resource (spec, status, defaults, validation, condition names); `resources.py`
adds what the CRD needs beyond the schema (names, short names, printer columns).
"""

from anneal.operator.api.base import API_VERSION, GROUP, VERSION, Condition, PlanSource, duration_seconds
from anneal.operator.api.compilation_job import CompilationJobSpec, CompilationJobStatus
from anneal.operator.api.inference_deployment import InferenceDeploymentSpec, InferenceDeploymentStatus

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "Condition",
    "PlanSource",
    "duration_seconds",
    "CompilationJobSpec",
    "CompilationJobStatus",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
]
