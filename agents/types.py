"""The compiler's pydantic types, in one place: what agents propose, measure, predict and decide.

Torch-free. The engine's wire formats (admin API answers) are parsed into these at the client, so
the rest of the compiler never handles raw dicts; extra fields the engine adds are kept (``extra =
"allow"``) so a newer engine does not break an older compiler.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from anneal.engine.plan import Plan

Tier = Literal["fast", "slow"]
BenchMode = Literal["decode", "prefill", "mixed", "workload"]
# What became of an experiment. "pruned": the cost model predicted it to lose, never run;
# "rejected": it ran but failed a gate (kernel check, verification, timing consistency);
# "failed": the engine refused or crashed on it (bad plan, timeout).
VerdictStatus = Literal["measured", "pruned", "rejected", "failed", "verified", "registered"]
ExperimentKind = Literal["benchmark", "kernel", "verify", "remeasure"]


class _Wire(BaseModel):
    """An engine answer: unknown fields are kept, not rejected."""

    model_config = ConfigDict(extra="allow")


class HardwareInfo(_Wire):
    """The engine's start-up microbenchmarks and device facts."""

    copy_gbps: float | None = None
    matmul_tflops: float | None = None
    num_gpus: int | None = None
    memory_gb: float | None = None


class EngineState(_Wire):
    """``GET /admin/state``."""

    model: str
    device: str = "cpu"
    gpu_name: str | None = None
    dtype: str = "float32"
    num_layers_loaded: int = 0
    num_layers_total: int = 0
    plan: Plan = Field(default_factory=Plan)
    plan_hash: str = ""
    kv: dict[str, Any] = Field(default_factory=dict)
    ops: dict[str, list[str]] = Field(default_factory=dict)
    variants: dict[str, dict[str, dict[str, list[Any]]]] = Field(default_factory=dict)
    hardware: HardwareInfo = Field(default_factory=HardwareInfo)
    config: dict[str, Any] | None = Field(None, description="model config, when the engine reports it")


class Measurement(_Wire):
    """``POST /admin/benchmark``: step (or request) times with their spread."""

    plan_hash: str = ""
    median_ms: float
    p10_ms: float | None = None
    p90_ms: float | None = None
    tokens_per_s: float | None = None
    samples_ms: list[float] = Field(default_factory=list)
    per_op_ms: dict[str, float] | None = None
    itl_p90_ms: float | None = None
    ttft_p90_ms: float | None = None
    time_split: dict[str, float] | None = Field(
        None, description="workload replays: where the wall time went (engine/benchmark.py _TimeSplit)")
    decode_batches: dict[int, int] | None = Field(
        None, description="workload replays: decode-only steps per batch size (what CUDA graphs replay)")
    speculation: dict[str, Any] | None = Field(
        None, description="workload replays: an n-gram drafter over the replay's greedy outputs "
                          "(engine/ngram_draft.py): verify steps, tokens a step, drafted, accepted")

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative noise of this measurement (0 when unknown)."""
        if self.p10_ms is None or self.p90_ms is None or not self.median_ms:
            return 0.0
        return (self.p90_ms - self.p10_ms) / self.median_ms


class KernelResult(_Wire):
    """``POST /admin/kernels``."""

    ok: bool
    stage: str
    error: str | None = None
    max_rel_err: float | None = None
    ms: float | None = None


class CheckResult(_Wire):
    name: str
    passed: bool
    detail: str = ""
    metrics: dict[str, Any] = Field(default_factory=dict)


class VerifyReport(_Wire):
    """``POST /admin/verify``."""

    passed: bool
    plan_hash: str = ""
    checks: list[CheckResult] = Field(default_factory=list)

    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def reason(self) -> str:
        bad = self.failures()
        if not bad:
            return "all checks passed" if self.passed else "verification failed (no failing check named)"
        return "; ".join(f"{c.name}: {c.detail or 'failed'}" for c in bad)


class BenchSpec(BaseModel):
    """How a candidate is measured: one ``/admin/benchmark`` body minus the plan."""

    model_config = ConfigDict(frozen=True)

    mode: BenchMode = "decode"
    batch_size: int = 1
    context_len: int = 64
    prompt_len: int = 64
    steps: int = 8
    warmup: int = 2
    repeats: int = 5
    num_requests: int | None = None
    seed: int = 0
    per_op: bool = False  # also time each op in a few eager steps (the kernel tuner's signal)

    def key(self) -> str:
        return (
            f"{self.mode}:b{self.batch_size}:c{self.context_len}:p{self.prompt_len}"
            f":s{self.steps}:r{self.repeats}:n{self.num_requests}:seed{self.seed}"
        ) + (":op" if self.per_op else "")


class Prediction(BaseModel):
    """What the cost model expected, logged beside the measurement so its error is visible."""

    ms: float
    model: str = "roofline"
    per_op_ms: dict[str, float] = Field(default_factory=dict)
    corrected: bool = False


class Verdict(BaseModel):
    status: VerdictStatus
    reason: str = ""


class Candidate(BaseModel):
    """A plan an agent wants measured, and why."""

    plan: Plan
    agent: str
    note: str = ""
    parent: str | None = Field(None, description="hash of the plan it was derived from")

    @property
    def hash(self) -> str:
        return self.plan.hash


class Experiment(BaseModel):
    """One row of the ledger: a candidate, how it was measured, what was predicted and decided."""

    id: int | None = None
    run_id: str = ""
    key: str = Field(description="what makes two experiments the same (plan hash, tier, kind, spec)")
    plan: Plan
    plan_hash: str
    tier: Tier = "fast"
    kind: ExperimentKind = "benchmark"
    agent: str = ""
    note: str = ""
    spec: BenchSpec | None = None
    prediction: Prediction | None = None
    measurement: Measurement | None = None
    verdict: Verdict
    detail: dict[str, Any] = Field(default_factory=dict)
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def ms(self) -> float:
        return self.measurement.median_ms if self.measurement else math.inf


class LatencyObjective(BaseModel):
    """Tokens/s is maximised subject to these tail bounds (None = unbounded)."""

    itl_p90_ms: float | None = None
    ttft_p90_ms: float | None = None

    def satisfied(self, m: Measurement) -> bool:
        if self.itl_p90_ms is not None and m.itl_p90_ms is not None and m.itl_p90_ms > self.itl_p90_ms:
            return False
        if self.ttft_p90_ms is not None and m.ttft_p90_ms is not None and m.ttft_p90_ms > self.ttft_p90_ms:
            return False
        return True


class ModelShape(BaseModel):
    """The numbers the roofline needs from a model config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        H, D = self.hidden_size, self.head_dim
        per_layer = H * (self.num_heads + 2 * self.num_kv_heads) * D + self.num_heads * D * H
        per_layer += 3 * H * self.intermediate_size
        return float(self.dtype_bytes) * (self.num_layers * per_layer + 2 * self.vocab_size * H)


class HardwareSpec(BaseModel):
    """Peak numbers of one GPU (or the CPU) and its interconnect."""

    name: str
    mem_gbps: float = Field(description="memory bandwidth, GB/s (measured copy bandwidth when known)")
    matmul_tflops: float = Field(description="dense matmul rate in the serving dtype, TFLOP/s")
    num_devices: int = 1
    memory_gb: float = 80.0
    link_gbps: float = 0.0  # NVLink per-direction bandwidth per GPU; 0 = no fast link
    link_latency_us: float = 8.0
    launch_us: float = 5.0  # per-kernel launch cost outside a CUDA graph
    graph_launch_us: float = 1.1  # per-kernel cost replayed from a CUDA graph
    # What a graphed decode step costs once, beyond its ops' eager per-op timings, whatever its layer
    # count (bench/layer_sweep.py: the step over 1-32 layers is a line whose intercept exceeds the
    # timed once-a-step ops by this). 0: not measured for this GPU.
    graph_step_us: float = 0.0


class CompileSettings(BaseModel):
    """One `anneal compile` invocation, validated."""

    model: str
    traffic: str
    budget_s: float = Field(120.0, gt=0)
    out: str = "anneal-out"
    engines: tuple[str, str] | None = None
    report_to: str | None = None
    fast_layers: int = Field(1, ge=1)
    seed: int = 0
    device: str = "cpu"
    top_k: int = Field(3, ge=1, description="fast-tier winners re-measured on the slow tier")
    max_spread: float = Field(0.5, gt=0, description="reject a winner whose re-measured spread exceeds this")
    rounds: int | None = Field(None, ge=1, le=20, description="interleaved slow-tier rounds of winner vs "
                               "baseline (default 2 on a GPU, 1 on the CPU); more rounds narrow a noisy replay")
    compile_ahead: bool = Field(False, description="the fast engine compiles queued candidates' kernels ahead")
    fp8_weights: bool = Field(False, description="the search may run projections on weight-only fp8 copies "
                                                 "(lossy: the winner still needs the quality check)")
    baseline_plan: str | None = Field(None, description="Plan/CompiledPlan file both tiers serve before the "
                                                        "search: the baseline to beat (default: theirs)")
    measure_tp: list[int] | None = Field(None, description="tensor-parallel degrees the compiled plan is served "
                                         "at after the search, beside the cost model's prediction; None: 1 and the "
                                         "recommended degree when that is not 1 (agents/tp_measure.py)")
    slow_tier_memory: float | None = Field(None, gt=0.05, le=0.98, description="the locally started slow tier's "
                                           "share of GPU memory (its --gpu-memory-utilization; None: the engine's "
                                           "default 0.85): lower leaves room for candidates' second copies of weights")
    seed_plans: list[str] = Field(default_factory=list, description="Plan/CompiledPlan files the plan search "
                                  "measures first and then evolves, like its own finds (earlier compiles, "
                                  "hand-set plans): a warm start")
