"""InferenceDeployment: a served model and the policy that keeps compiling plans for it.

Spec, defaults, validation, status and condition names of the one resource, kept together.
The drift and rollout parts of the status are written by the drift/rollout logic; the schema is
complete now so that logic needs no breaking CRD change.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from anneal.operator.api.base import (
    Condition,
    Duration,
    EnvVar,
    FreeForm,
    KubeModel,
    Name,
    Placement,
    PlanSource,
    SecretKeyRef,
    duration_seconds,
)

KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"

MODEL_PATTERN = r"^(random:[a-z0-9][a-z0-9.\-]*|/[^\s]*|[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*)$"
Model = Field(
    min_length=1,
    max_length=512,
    pattern=MODEL_PATTERN,
    description="Hugging Face model folder (absolute path, e.g. on modelVolume), Hub id org/name, "
    "or random:<preset> (random weights with real shapes, for benchmarks)",
)
TrafficPreset = Literal["chat", "rag", "agentic", "batch"]
# The compiler's proposer agents (anneal.agents.compile.AGENT_NAMES; not imported: the operator
# image has no compiler). llm-writer needs LLM credentials.
AgentName = Literal["kernel-tuner", "plan-search", "graph-buckets", "scheduler-tuner", "llm-writer"]
DEFAULT_AGENTS = ("kernel-tuner", "plan-search", "graph-buckets", "scheduler-tuner")


class ModelVolume(KubeModel):
    """A PersistentVolumeClaim holding model folders, mounted read-only into engine pods."""

    claim_name: Name = Field(description="PersistentVolumeClaim name")
    mount_path: str = Field("/models", pattern=r"^/[^\s]*$", description="where the claim is mounted")


class KernelCache(KubeModel):
    """A PersistentVolumeClaim where engines keep the Triton kernels they compile.

    An engine on an empty cache compiles every kernel of its plan before it serves (12-15 s
    for an 8B chat plan on an H200, bench/NOTES.md session 13): a restarted pod, a rollout's new pods and a
    CompilationJob's tiers skip that on a kept one. ReadWriteMany lets pods on several nodes share
    it; Triton writes each entry to a temporary file and renames it, so concurrent engines never see
    half an entry."""

    claim_name: Name = Field(description="PersistentVolumeClaim name (ReadWriteMany to share across nodes)")


class Serving(KubeModel):
    """Arguments of `anneal serve` in the engine container."""

    device: Literal["cuda", "cpu"] | None = Field(
        None, description="default: cuda when the pod has GPUs, cpu otherwise"
    )
    layers: int | None = Field(None, ge=1, le=1024, description="load only the first K layers")
    extra_args: list[str] = Field(default_factory=list, max_length=64, description="appended to the command")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="extra environment")
    startup_timeout: Duration = Field(
        "15m", description="how long an engine may load weights before it counts as failed"
    )


class PrometheusQuery(KubeModel):
    """Where and over what window traffic metrics are read."""

    url: str | None = Field(
        None, pattern=r"^https?://", description="Prometheus base URL; default: the operator's setting"
    )
    window: Duration = Field("15m", description="range over which the traffic shape is measured")
    selector: str = Field(
        "", max_length=1024, description="extra PromQL label matchers, e.g. cluster=\"eu-1\""
    )


# The parts of a drift score, as status and the policy's weights name them.
DRIFT_PARTS = ("promptLength", "outputLength", "concurrency", "prefixReuse")


class DriftPolicy(KubeModel):
    """When the observed traffic has moved far enough, for long enough, to recompile.

    The score is the largest weighted part (see `anneal.operator.drift`): 1.0 means lengths moved
    by one doubling on average, concurrency doubled or halved, or the prefix-cache hit ratio
    moved by 0.25. A streak starts at `threshold`, continues while the score stays at or above
    `exitThreshold`, and triggers after `consecutiveWindows` non-overlapping Prometheus windows
    that each saw at least `minRequests` requests; never within `cooldown` of the last compile.
    """

    threshold: float = Field(
        1.0, gt=0.0, le=100.0,
        description="drift score that starts a streak (1.0 = lengths moved one doubling, load doubled, "
        "or hit ratio moved 0.25)",
    )
    exit_threshold: float | None = Field(
        None, gt=0.0, le=100.0, description="score below which a streak ends (hysteresis); default 0.7 x threshold"
    )
    consecutive_windows: int = Field(
        3, ge=1, le=100, description="non-overlapping windows the drift must last before a compile"
    )
    weights: dict[str, float] = Field(
        default_factory=lambda: {"promptLength": 1.0, "outputLength": 1.0, "concurrency": 1.0, "prefixReuse": 1.0},
        description="weight of each part (promptLength, outputLength, concurrency, prefixReuse); 0 ignores a part",
    )
    min_requests: int = Field(500, ge=0, le=10**9, description="requests in the window before drift counts")
    check_interval: Duration = Field("5m", description="how often drift is computed")
    cooldown: Duration = Field("6h", description="least time between two compilations")
    max_staleness: Duration = Field(
        "30m", description="the newest usable window must have ended this recently to trigger"
    )

    @model_validator(mode="after")
    def _check(self) -> "DriftPolicy":
        for key, value in self.weights.items():
            if key not in DRIFT_PARTS:
                raise ValueError(f"unknown drift part {key!r} in weights; known: {', '.join(DRIFT_PARTS)}")
            if value < 0:
                raise ValueError(f"weights.{key} must be >= 0")
        if self.exit_threshold is not None and self.exit_threshold > self.threshold:
            raise ValueError("exitThreshold must be <= threshold")
        return self


class SearchPolicy(KubeModel):
    """How a compilation triggered by this policy searches."""

    budget: Duration = Field("1h", description="search time of one compilation")
    fast_layers: int = Field(2, ge=1, le=1024, description="layers loaded by the fast-tier engine")
    agents: list[AgentName] = Field(
        default_factory=lambda: list(DEFAULT_AGENTS), min_length=1, max_length=16, description="proposer agents"
    )
    llm_credentials: SecretKeyRef | None = Field(None, description="Secret key holding an LLM API key")


class VerificationTolerances(KubeModel):
    """What a candidate plan must satisfy before it may serve."""

    logits_rtol: float = Field(2e-2, gt=0.0, le=1.0, description="relative logits error allowed")
    min_greedy_agreement: float = Field(0.99, ge=0.0, le=1.0, description="greedy-token agreement required")
    bit_exact: bool = Field(False, description="require bit-identical outputs")
    kv_contamination: bool = Field(True, description="run the KV-cache contamination tests")


class MetricGate(KubeModel):
    """A PromQL query over the canary's own series that must stay within [min, max]."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "has(self.min) || has(self.max)", "message": "a gate needs min or max"}
            ]
        }
    )

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$", description="gate name")
    query: str = Field(
        min_length=1, max_length=4096, description="PromQL; {{pod}} and {{namespace}} are substituted"
    )
    min: float | None = Field(None, description="fail when the query result is below")
    max: float | None = Field(None, description="fail when the query result is above")

    @model_validator(mode="after")
    def _bounded(self) -> "MetricGate":
        if self.min is None and self.max is None:
            raise ValueError("a gate needs min or max")
        return self


class CanaryAnalysis(KubeModel):
    """How a canary replica is judged before the plan reaches all replicas."""

    initial_delay: Duration = Field("2m", description="wait before the first analysis")
    interval: Duration = Field("1m", description="time between analyses")
    iterations: int = Field(5, ge=1, le=1000, description="passing analyses needed to promote")
    failure_limit: int = Field(2, ge=0, le=100, description="failed analyses that trigger a rollback")
    max_error_rate_increase: float = Field(0.01, ge=0.0, le=1.0, description="vs. the stable replicas")
    max_latency_regression: float = Field(
        0.10, ge=0.0, le=10.0, description="relative p90 TTFT and inter-token latency increase vs. the stable replicas"
    )
    min_throughput_ratio: float = Field(
        0.8, ge=0.0, le=10.0, description="canary tokens/s at least this fraction of a stable replica's"
    )
    gates: list[MetricGate] = Field(default_factory=list, max_length=32, description="extra metric gates")


class RolloutStrategy(KubeModel):
    """How a verified plan reaches the replicas."""

    type: Literal["Canary", "Rolling"] = Field("Canary", description="Canary: one replica first")
    in_place: bool = Field(
        True, description="apply plans through the engines' admin API without restarting pods when possible"
    )
    canary: CanaryAnalysis = Field(default_factory=CanaryAnalysis)


class CompilationPolicy(KubeModel):
    """When to compile new plans for this deployment and how to roll them out."""

    mode: Literal["auto", "preview", "off"] = Field(
        "preview",
        description="auto: compile on drift and roll out; preview: compile and report what would roll "
        "out (status.proposedPlan); off: never compile",
    )
    paused: bool = Field(False, description="hold: no new compilation and no rollout step")
    abort_rollout: bool = Field(False, description="roll back an in-progress rollout and hold")
    pinned_plan: PlanSource | None = Field(
        None, description="serve exactly this plan; compiled plans are only reported"
    )
    traffic: TrafficPreset | None = Field(
        None, description="compile for this preset instead of the observed traffic"
    )
    prometheus: PrometheusQuery = Field(default_factory=PrometheusQuery)
    drift: DriftPolicy = Field(default_factory=DriftPolicy)
    search: SearchPolicy = Field(default_factory=SearchPolicy)
    verification: VerificationTolerances = Field(default_factory=VerificationTolerances)
    rollout: RolloutStrategy = Field(default_factory=RolloutStrategy)


class InferenceDeploymentSpec(Placement):
    """A served model: engine image, replicas, GPUs and placement, serving args, plan, policy."""

    model: str = Model
    model_volume: ModelVolume | None = Field(None, description="volume holding model folders")
    kernel_cache: KernelCache | None = Field(
        None, description="volume keeping compiled Triton kernels across pod restarts; default: none (each pod "
        "compiles its plan's kernels at start)"
    )
    image: str | None = Field(
        None, min_length=1, max_length=512, description="engine image; default: the operator's setting"
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="when the kubelet pulls the engine image"
    )
    replicas: int = Field(1, ge=0, le=256, description="engine pods")
    serving: Serving = Field(default_factory=Serving)
    plan: PlanSource | None = Field(
        None, description="the plan to serve; default: the default plan of the pods' device (on CUDA the hand-set "
        "Triton plan with overlap scheduling, on the CPU the reference plan)"
    )
    compilation: CompilationPolicy = Field(default_factory=CompilationPolicy)

    @model_validator(mode="after")
    def _startup(self) -> "InferenceDeploymentSpec":
        duration_seconds(self.serving.startup_timeout)
        return self


# --- status -------------------------------------------------------------------------------------

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]

# Typed condition names; Ready is True only when all of them are.
PLAN_RESOLVED = "PlanResolved"
RESOURCES_READY = "ResourcesReady"
SCHEDULABLE = "Schedulable"
AVAILABLE = "Available"
PLAN_SERVING = "PlanServing"
CONDITIONS = (PLAN_RESOLVED, RESOURCES_READY, SCHEDULABLE, AVAILABLE, PLAN_SERVING)


class PlanRef(KubeModel):
    """A plan by hash and where it came from."""

    hash: str = Field(min_length=1, max_length=64, description="plan content hash")
    source: str = Field("", description="e.g. spec.plan, pinnedPlan, CompilationJob/<name>, default")
    config_map: str | None = Field(None, description="ConfigMap holding the CompiledPlan")
    speedup: float | None = Field(None, description="measured gain over the baseline, when compiled")


class DriftStatus(KubeModel):
    """How far the observed traffic is from the traffic the serving plan was compiled for."""

    score: float | None = Field(None, ge=0.0, description="weighted drift, 0 = same shape")
    parts: dict[str, float] = Field(default_factory=dict, description="per-part drift")
    observed: FreeForm | None = Field(None, description="observed TrafficShape")
    compiled: FreeForm | None = Field(None, description="TrafficShape the serving plan was compiled for")
    compiled_plan_hash: str | None = Field(None, description="the plan `compiled` belongs to")
    baseline: str = Field("", description="where `compiled` came from (CompiledPlan, preset, first observed window)")
    requests: int | None = Field(None, ge=0, description="requests in the window")
    observed_at: str | None = Field(None, description="when the observed shape was read")
    dominant: str | None = Field(None, description="the part that sets the score")
    streak: int = Field(0, ge=0, description="windows the current drift has lasted")
    windows_needed: int = Field(0, ge=0, description="windows a drift must last to trigger")
    compilation_job: str | None = Field(None, description="CompilationJob the drift triggered last")
    last_compilation_at: str | None = Field(None, description="when drift last triggered a compilation")
    message: str = Field("", description="the decision and its reason, or why drift is not computed")


RolloutState = Literal[
    "Idle", "Compiling", "Verifying", "Proposed", "Canary", "Promoting", "RollingBack", "RolledBack", "Held",
    "Succeeded", "Failed",
]


class GateStatus(KubeModel):
    """One canary gate of the last analysis."""

    name: str = Field(description="gate name")
    outcome: Literal["pass", "fail", "missing"] = Field(description="missing: no data, the rollout holds")
    canary: float | None = Field(None, description="the canary's value")
    baseline: float | None = Field(None, description="the stable replicas' value")
    limit: float | None = Field(None, description="the bound the canary was held to")
    message: str = Field("", description="the comparison, in words")


class RolloutStatus(KubeModel):
    """Where a plan rollout stands (rollout state lives here, not in annotations)."""

    state: RolloutState = Field("Idle", description="where the rollout stands")
    from_plan_hash: str | None = Field(None, description="plan served before the rollout")
    to_plan_hash: str | None = Field(None, description="plan being rolled out")
    canary_pod: str | None = Field(None, description="the replica serving the new plan first")
    compilation_job: str | None = Field(None, description="CompilationJob that produced the plan")
    analyses_passed: int = Field(0, ge=0, description="canary analyses passed")
    analyses_failed: int = Field(0, ge=0, description="canary analyses failed")
    analyses_inconclusive: int = Field(0, ge=0, description="analyses without data (held, not counted)")
    in_place: bool | None = Field(None, description="plans applied through the admin API (no restart)")
    speedup: float | None = Field(None, description="the compiled plan's measured gain")
    canary_since: str | None = Field(None, description="when the canary was seen serving the new plan")
    last_analysis_at: str | None = Field(None, description="time of the last canary analysis")
    gates: list[GateStatus] = Field(default_factory=list, description="gates of the last analysis")
    promoted_in_place: str | None = Field(
        None, description="the configured plan reached the replicas in place; the pod template keeps an older hash "
        "(no restart) until a plan is rolled out by restart"
    )
    rejected_plans: list[str] = Field(
        default_factory=list, max_length=32, description="plan hashes rolled back or failed: never retried automatically"
    )
    started_at: str | None = Field(None, description="when the rollout started")
    finished_at: str | None = Field(None, description="when the rollout ended")
    message: str = Field("", description="what the rollout waits for or why it stopped")


class InferenceDeploymentStatus(KubeModel):
    """Observed state. Written by the operator only when it changed."""

    model_config = ConfigDict(extra="allow")

    phase: Phase = Field("Pending", description="Pending, Progressing, Ready, Degraded or Failed")
    observed_generation: int | None = Field(None, description="spec generation the status reflects")
    replicas: int = Field(0, ge=0, description="engine pods that exist")
    ready_replicas: int = Field(0, ge=0, description="engine pods that pass their readiness probe")
    updated_replicas: int = Field(0, ge=0, description="engine pods with the configured plan")
    plan_hash: str | None = Field(None, description="hash of the plan the engines are configured with")
    plan_source: str | None = Field(None, description="where the configured plan came from")
    serving_plan_hash: str | None = Field(
        None, description="plan hash every ready replica was rolled out with"
    )
    endpoint: str | None = Field(None, description="in-cluster URL of the OpenAI-compatible API")
    proposed_plan: PlanRef | None = Field(None, description="a compiled plan not (yet) rolled out")
    last_compilation_job: str | None = Field(None, description="the latest CompilationJob for this deployment")
    drift: DriftStatus | None = Field(None, description="observed vs. compiled traffic")
    rollout: RolloutStatus | None = Field(None, description="the plan rollout in progress or last finished")
    conditions: list[Condition] = Field(default_factory=list, description="typed conditions and their aggregate Ready")
