"""CompilationJob: one search for a faster plan, on two engine tiers, driven by a coordinator.

Spec, defaults, validation, status and condition names of the one resource, kept together.
A CompilationJob is a request: its spec cannot change once the search has started (the API
server enforces it with a transition rule), and its result is a ConfigMap named in the status.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from anneal.operator.api.base import (
    Condition,
    Duration,
    FreeForm,
    KubeModel,
    Name,
    Placement,
    PlanSource,
    ResourceRequirements,
    SecretKeyRef,
    Toleration,
    duration_seconds,
)
from anneal.operator.api.inference_deployment import (
    DEFAULT_AGENTS,
    MODEL_PATTERN,
    AgentName,
    KernelCache,
    ModelVolume,
    TrafficPreset,
    VerificationTolerances,
)

KIND = "CompilationJob"
PLURAL = "compilationjobs"

_ONE_OF = "(has(self.{a}) ? 1 : 0) + (has(self.{b}) ? 1 : 0) == 1"


class Target(KubeModel):
    """What to compile for: an InferenceDeployment (its model, image, GPUs) or an explicit model."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": _ONE_OF.format(a="inferenceDeployment", b="model"),
                    "message": "set exactly one of inferenceDeployment or model",
                }
            ]
        }
    )

    inference_deployment: Name | None = Field(None, description="an InferenceDeployment in this namespace")
    model: str | None = Field(
        None, min_length=1, max_length=512, pattern=MODEL_PATTERN, description="model when no deployment is named"
    )
    model_volume: ModelVolume | None = Field(None, description="volume holding the model (explicit model only)")
    kernel_cache: KernelCache | None = Field(
        None, description="volume keeping the tiers' compiled Triton kernels; default: the deployment's kernelCache"
    )
    image: str | None = Field(None, min_length=1, max_length=512, description="engine image override")

    @model_validator(mode="after")
    def _exactly_one(self) -> "Target":
        if (self.inference_deployment is None) == (self.model is None):
            raise ValueError("set exactly one of inferenceDeployment or model")
        return self


class Traffic(KubeModel):
    """The traffic to compile for: a preset name or a TrafficShape object."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": _ONE_OF.format(a="preset", b="shape"), "message": "set exactly one of preset or shape"}
            ]
        }
    )

    preset: TrafficPreset | None = Field(None, description="chat, rag, agentic or batch")
    shape: FreeForm | None = Field(None, description="a TrafficShape (see `anneal.engine.traffic`)")

    @model_validator(mode="after")
    def _exactly_one(self) -> "Traffic":
        if (self.preset is None) == (self.shape is None):
            raise ValueError("set exactly one of preset or shape")
        return self


class Tiers(Placement):
    """The two measurement engines: fast (first K layers) and slow (all layers), one pod each. For an
    InferenceDeployment target they run on its hardware (GPUs, resources, node selector, tolerations;
    nodeSelector and tolerations here are added); for an explicit model, on what is set here."""

    fast_layers: int = Field(2, ge=1, le=1024, description="layers loaded by the fast-tier engine")
    spread: Literal["Required", "Preferred"] = Field(
        "Preferred", description="anti-affinity keeping the two engines on different nodes"
    )


class Coordinator(KubeModel):
    """The Job that runs the agents (`anneal compile --engines ...`)."""

    image: str | None = Field(None, min_length=1, max_length=512, description="default: the engine image")
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(requests={"cpu": "1", "memory": "2Gi"}),
        description="default: requests cpu 1, memory 2Gi",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels the coordinator requires")
    tolerations: list[Toleration] = Field(default_factory=list, description="taints the coordinator tolerates")


class LLMAgent(KubeModel):
    """Credentials and model of the LLM kernel-writer agent."""

    credentials: SecretKeyRef = Field(description="Secret key holding the API key (never inline)")
    provider: Literal["anthropic", "openai"] = Field("anthropic", description="LLM API provider")
    model: str | None = Field(None, max_length=128, description="provider's model name")


class CompilationJobSpec(KubeModel):
    """One search: target, traffic, budget, tiers, agents and what to do with the result."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "duration(self.budget) >= duration('10s')", "message": "budget must be at least 10s"},
                {
                    "rule": "!has(self.deadline) || duration(self.deadline) > duration(self.budget)",
                    "message": "deadline must be longer than budget",
                },
                {
                    "rule": "!self.autoApply || has(self.target.inferenceDeployment)",
                    "message": "autoApply needs target.inferenceDeployment",
                },
                {
                    "rule": "!('llm-writer' in self.agents) || has(self.llm)",
                    "message": "the llm-writer agent needs spec.llm (credentials Secret)",
                },
            ]
        }
    )

    target: Target
    traffic: Traffic = Field(default_factory=lambda: Traffic(preset="chat"), description="default: chat preset")
    budget: Duration = Field("1h", description="search time")
    deadline: Duration | None = Field(
        None, description="whole-job limit incl. provisioning; default: budget + 30m"
    )
    retries: int = Field(2, ge=0, le=10, description="restarts of the engines and coordinator (with backoff) before the job fails; "
                                                     "each new coordinator resumes the ledger kept in <name>-ledger")
    tiers: Tiers = Field(default_factory=Tiers)
    agents: list[AgentName] = Field(
        default_factory=lambda: list(DEFAULT_AGENTS), min_length=1, max_length=16,
        description="proposer agents to run (llm-writer needs spec.llm)",
    )
    llm: LLMAgent | None = None
    seed_plans: list[PlanSource] = Field(
        default_factory=list, max_length=8,
        description="plans the plan search measures right after the baseline and evolves (a warm start), e.g. "
                    "the plan the deployment serves; drift-triggered jobs seed the serving plan",
    )
    verification: VerificationTolerances = Field(default_factory=VerificationTolerances)
    fp8_weights: bool = Field(
        False, description="the search may run the layers' projections on weight-only fp8 copies (lossy: a "
                           "winner still passes the quality check against the reference plan)",
    )
    coordinator: Coordinator = Field(default_factory=Coordinator)
    auto_apply: bool = Field(False, description="on success, the target InferenceDeployment takes the plan")

    @model_validator(mode="after")
    def _durations(self) -> "CompilationJobSpec":
        if duration_seconds(self.budget) < 10:
            raise ValueError("budget must be at least 10s")
        if self.deadline is not None and duration_seconds(self.deadline) <= duration_seconds(self.budget):
            raise ValueError("deadline must be longer than budget")
        if self.auto_apply and self.target.inference_deployment is None:
            raise ValueError("autoApply needs target.inferenceDeployment")
        if "llm-writer" in self.agents and self.llm is None:
            raise ValueError("the llm-writer agent needs spec.llm (credentials Secret)")
        return self

    def deadline_seconds(self) -> float:
        if self.deadline is not None:
            return duration_seconds(self.deadline)
        return duration_seconds(self.budget) + 1800.0


# --- status -------------------------------------------------------------------------------------

Phase = Literal["Pending", "Provisioning", "Searching", "Verifying", "Succeeded", "Failed"]
TERMINAL_PHASES = ("Succeeded", "Failed")
# The phase order: status never moves backwards.
PHASE_ORDER = ("Pending", "Provisioning", "Searching", "Verifying", "Succeeded")

TARGET_RESOLVED = "TargetResolved"
ENGINES_READY = "EnginesReady"
COORDINATOR_RUNNING = "CoordinatorRunning"
RESULT_VALID = "ResultValid"
CONDITIONS = (TARGET_RESOLVED, ENGINES_READY, COORDINATOR_RUNNING, RESULT_VALID)


class Progress(KubeModel):
    """Written by the coordinator through `anneal.operator.progress.report`."""

    model_config = ConfigDict(extra="allow")

    phase: Literal["Searching", "Verifying", "Done"] | None = Field(None, description="coordinator's stage")
    experiments: int | None = Field(None, ge=0, description="experiments run so far")
    best_speedup: float | None = Field(None, ge=0.0, description="best measured speedup so far")
    best_plan_hash: str | None = Field(None, description="hash of the best plan so far")
    message: str | None = Field(None, description="free text from the coordinator")
    updated_at: str | None = Field(None, description="time of the last report")


class CompilationJobStatus(KubeModel):
    """Observed state; phase Pending → Provisioning → Searching → Verifying → Succeeded | Failed."""

    model_config = ConfigDict(extra="allow")

    phase: Phase = Field("Pending", description="Pending, Provisioning, Searching, Verifying, Succeeded or Failed")
    observed_generation: int | None = Field(None, description="spec generation the status reflects")
    message: str = Field("", description="what the job waits for, or why it failed")
    progress: Progress | None = Field(None, description="written by the coordinator")
    experiments: int = Field(0, ge=0, description="experiments run (from the coordinator)")
    best_speedup: float | None = Field(None, description="best verified speedup over the baseline")
    fast_pod: str | None = Field(None, description="fast-tier engine pod")
    slow_pod: str | None = Field(None, description="slow-tier engine pod")
    nodes: list[str] = Field(default_factory=list, description="nodes of the fast and slow engines")
    coordinator_job: str | None = Field(None, description="the Job running `anneal compile`")
    result_config_map: str | None = Field(None, description="ConfigMap holding the CompiledPlan JSON")
    result_plan_hash: str | None = Field(None, description="hash of the verified result plan")
    applied_to: str | None = Field(None, description="InferenceDeployment that took the plan")
    started_at: str | None = Field(None, description="when provisioning started")
    search_started_at: str | None = Field(None, description="when the coordinator started")
    completed_at: str | None = Field(None, description="when the job succeeded or failed")
    engine_restarts: int = Field(0, ge=0, description="engine pods recreated after a failure")
    last_restart_at: str | None = Field(None, description="when the engines were last recreated (backoff)")
    conditions: list[Condition] = Field(default_factory=list, description="typed conditions and their aggregate Ready")
