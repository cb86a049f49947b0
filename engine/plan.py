"""Plan and CompiledPlan: how a forward pass runs, and nothing about weights (torch-free).

A Plan is what the compiler searches over and what the operator rolls out. Its identity is the
SHA-256 of its canonical JSON (sorted keys, no whitespace), so two plans that mean the same thing
have the same hash wherever they were written.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

ParamValue = int | float | str | bool

# The ops a plan may choose implementations for (the engine's op registry defines them).
OP_NAMES = (
    "embedding",
    "rmsnorm",
    "add_rmsnorm",
    "qkv_proj",
    "qk_rope_store",
    "attention_prefill",
    "attention_decode",
    "o_proj",
    "gate_up_proj",
    "silu_and_mul",
    "down_proj",
    "lm_head",
    "argmax",
    "sample",
)

# Fusions that replace a chain of ops with one kernel (GPU only): name -> what it replaces.
FUSIONS = {
    "lm_head_argmax": "lm_head + greedy argmax in decode graphs (logits not written)",
    "silu_mul_down": "silu_and_mul + down_proj (the activation applied as the GEMV loads)",
    "norm_linear": "(add_)rmsnorm + qkv_proj and + gate_up_proj (the norm in the GEMV's prologue)",
    "linear_norm": "o_proj / down_proj + the add_rmsnorm after it (the GEMV's last tile normalises the row)",
    "gate_up_silu": "gate_up_proj + silu_and_mul (the activation in the GEMV's epilogue; under folded_norm the "
                    "1/rms too, from the statistics o_proj's GEMV leaves as it adds the residual)",
    "qkv_rope": "qkv_proj + qk_rope_store (RoPE and the KV-cache store in the GEMV's epilogue; Llama)",
    "norm_stats": "o_proj / down_proj + the add_rmsnorm after them: each tile adds the residual and leaves its "
                  "share of the row's sum of squares, and the next GEMV (qkv, gate_up) normalises as it loads "
                  "(no norm kernel, no row pass; before linear_norm and norm_linear)",
    "folded_norm": "both RMSNorms of a layer without a kernel: their weights folded into qkv_proj / gate_up_proj "
                   "(a second copy of those weights, of which their fp8 / bf12 copies are made), the residual "
                   "adds done in place by o_proj / down_proj (cuBLAS's beta = 1 for the reference GEMM, the "
                   "Triton GEMV's epilogue on it or its weight copy) and 1/rms applied by qk_rope_store / "
                   "silu_and_mul (or rope_attention) as they load",
    "rope_attention": "qk_rope_store + attention_decode in decode steps: q/k norm, RoPE and the KV-cache store "
                      "done by the split-K attention kernel as it starts (attention_decode must be "
                      "triton_splitk; with folded_norm or norm_stats too), one kernel less a layer; prompt steps "
                      "unfused",
}

# Fusions of ops that run once a step, not once a layer: on a fast tier of a few layers their gain
# is what it is on the whole model (the others' grows with the layer count).
STEP_FUSIONS = ("lm_head_argmax",)

# Fusions that rewrite the same ops as another one: a plan may enable one of each pair.
FUSION_CONFLICTS = {
    "folded_norm": ("norm_linear", "linear_norm", "norm_stats", "qkv_rope", "silu_mul_down"),
    # qkv_rope does the RoPE + store in the qkv GEMV's epilogue. norm_stats does too when beside qkv_rope;
    # beside rope_attention its qkv GEMV normalises and the attention rotates (session 46: on the bf12
    # GEMVs, whose 32-wide tiles cannot hold a head, the pair was refused though nothing clashed)
    "rope_attention": ("qkv_rope",),
}


def fusion_conflicts(fusions) -> list[tuple[str, str]]:
    """The pairs of ``fusions`` (enabled names) that ``FUSION_CONFLICTS`` forbids together."""
    on = set(fusions)
    return [(a, b) for a, others in FUSION_CONFLICTS.items() if a in on for b in others if b in on]


def folded_norm_blockers(plan: "Plan") -> list[str]:
    """The projections whose choice rules out ``plan``'s folded_norm: it adds the residual in o_proj
    and down_proj, in place, which only the reference GEMM (addmm, beta = 1) and the Triton GEMV (its
    epilogue) do."""
    return [p for p in ("o_proj", "down_proj") if plan.choice(p).impl not in RESIDUAL_ADD_IMPLS]


# Fusions that add the residual inside o_proj / down_proj: split by rows at tensor_parallel > 1, they
# would add it before the all-reduce, once a rank.
RESIDUAL_IN_PROJECTION_FUSIONS = ("folded_norm", "linear_norm", "norm_stats")


def fusion_blockers(plan: "Plan") -> dict[str, str]:
    """The enabled fusions that ``plan``'s op choices or its tensor-parallel degree rule out, each
    with the reason (the op table refuses such a plan; the search's ``normalized`` drops the fusion)."""
    out = {}
    gemm = folded_norm_blockers(plan) if "folded_norm" in plan.fusions else []
    if gemm:
        out["folded_norm"] = ("folded_norm adds the residual in place in o_proj and down_proj: "
                              f"{', '.join(gemm)} must be the reference GEMM or the Triton GEMV "
                              f"({', '.join(RESIDUAL_ADD_IMPLS)})")
    impl = plan.choice("attention_decode").impl
    if "rope_attention" in plan.fusions and impl != "triton_splitk":
        out["rope_attention"] = ("rope_attention runs in the split-K decode attention kernel: attention_decode "
                                 f"must be triton_splitk, not {impl}")
    tp = plan.parallelism.tensor_parallel
    for f in RESIDUAL_IN_PROJECTION_FUSIONS:
        if tp > 1 and f in plan.fusions:
            out[f] = (f"{f} adds the residual inside o_proj / down_proj, before the all-reduce of "
                      f"parallelism.tensor_parallel={tp}: leave it out at tensor_parallel > 1")
    return out


GEMV_BLOCK_N = 64  # the Triton GEMV's default tile width (engine/kernels/gemv.KERNEL_PARAMS), fused or not
GEMV_MAX_M = 64  # its default row limit: above it the projection (and a fusion of it) runs unfused


# the projections whose GEMV params each GEMV fusion runs with (``fused_gemv_params``): what
# engine/fusions.build_fusions builds each fusion from, and what a tile sweep of a fusion must vary
GEMV_FUSION_PROJECTIONS = {
    "silu_mul_down": ("down_proj",), "linear_norm": ("o_proj", "down_proj"), "gate_up_silu": ("gate_up_proj",),
    "qkv_rope": ("qkv_proj",), "norm_linear": ("qkv_proj", "gate_up_proj"),
    "norm_stats": ("o_proj", "down_proj", "qkv_proj", "gate_up_proj"),
    "folded_norm": ("o_proj", "down_proj"),  # their residual add, when they are the Triton GEMV
}


# Second copies of the layers' projection weights (engine/weight_copies.py) and the GEMV variants
# that stream them: weight-only fp8 (engine/fp8_weights.py; lossy by design, so the search proposes
# it only when asked to: ``CandidateSpace(fp8_weights=...)``) and bf12 (engine/bf12_weights.py: bf16
# in 12 bits, every weight kept but a few in ten thousand below 2^-14 of their row's largest).
FP8_WEIGHT_IMPL = "triton_gemv_fp8"
BF12_WEIGHT_IMPL = "triton_gemv_bf12"
WEIGHT_COPY_IMPLS = {FP8_WEIGHT_IMPL: "fp8", BF12_WEIGHT_IMPL: "bf12"}  # variant -> the copy's format
# the o_proj / down_proj variants that can add folded_norm's residual in place: cuBLAS's addmm (beta =
# 1) or the Triton GEMV's residual epilogue (on W or its weight copy); an agent-written kernel cannot
RESIDUAL_ADD_IMPLS = ("reference", "triton_gemv_splitk", *WEIGHT_COPY_IMPLS)
# The bf12 GEMV's defaults where they differ from the bf16 GEMV's: its best tiles on every 8B
# projection at M 8 / 16 on an H100 (session 45, bench/fp8_gemv.py: 0.80-0.83x the bf16 GEMV's
# best, against 0.88-0.94x at the bf16 defaults), so a tuner's first timing of it is near its best.
# The variant declares them and its fused GEMVs take them (``fused_gemv_params``).
BF12_GEMV_DEFAULTS = {"block_n": 32, "block_k": 256, "reduce": "ticket"}
# ... and where one projection's best differs (the same bench, M 16, sessions 45-46, two H100s):
# gate_up 65.9-66.5 µs at 64-wide tiles and 8 warps against 70.6 at the common ones (M 8: 66.4 both),
# o 12.7 against 13.3 and down 36.6 against 37.0 with two K splits. A tuner's coordinate descent
# cannot reach gate_up's from the common tiles: each move alone is slower (70.7, 73.4).
BF12_GEMV_OP_DEFAULTS = {"gate_up_proj": {"block_n": 64, "num_warps": 8}, "o_proj": {"split_k": 2},
                         "down_proj": {"split_k": 2}}
# the projections that may read a second copy, and where each one's weight lives: a ``LayerWeights``
# attribute of every layer, or for lm_head ``Weights.lm_head`` itself (``Weights.copy_targets``).
# lm_head joined in session 45: 0.37 ms of the 8B's ~5.5-ms chat decode step on an H100.
WEIGHT_FIELDS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down",
                 "lm_head": "lm_head"}
COPY_PROJECTIONS = tuple(WEIGHT_FIELDS)


def weight_copies(plan: "Plan") -> dict[str, str]:
    """The projections ``plan`` runs on a second copy of their weight, and each copy's format."""
    return {p: WEIGHT_COPY_IMPLS[plan.choice(p).impl] for p in COPY_PROJECTIONS
            if plan.choice(p).impl in WEIGHT_COPY_IMPLS}


def bf12_gemv_defaults(op: str) -> dict[str, Any]:
    """The bf12 GEMV's declared defaults for projection ``op`` where they differ from the bf16 GEMV's."""
    return {**BF12_GEMV_DEFAULTS, **BF12_GEMV_OP_DEFAULTS.get(op, {})}


def gemv_tiles(impl: str, params: dict[str, Any], op: str) -> dict[str, Any]:
    """``params`` of projection ``op``'s Triton GEMV choice with the bf12 GEMV's own defaults made
    explicit where ``impl`` is it (``bf12_gemv_defaults``): the tiles it runs, whoever else runs them."""
    return {**bf12_gemv_defaults(op), **params} if impl == BF12_WEIGHT_IMPL else dict(params)


def fused_gemv_params(impl: str, params: dict[str, Any], op: str) -> tuple[dict[str, Any], int]:
    """The GEMV kernel params a fusion takes from projection ``op``'s choice (the projection's own
    when it is the Triton GEMV, on a weight copy or not, else the GEMV's defaults), and the row count
    above which the unfused ops run instead (prefill)."""
    if impl != "triton_gemv_splitk" and impl not in WEIGHT_COPY_IMPLS:
        return {}, GEMV_MAX_M
    p = gemv_tiles(impl, params, op)
    if impl in WEIGHT_COPY_IMPLS:
        p["weights"] = WEIGHT_COPY_IMPLS[impl]  # the fused GEMV streams the same copy the projection does
    return p, p.pop("max_m", GEMV_MAX_M) or 1 << 30


def retiled_fusions(plan: "Plan", base: "Plan") -> list[str]:
    """The GEMV fusions that would run with other tiles in ``plan`` than in ``base``: each takes its
    projections' GEMV params (``fused_gemv_params``), so a projection tuned unfused changes a fused
    kernel that was never timed with them (session 23: `gemv-m16-alldot`'s tiles in the compiled
    chat plan's fused GEMVs, 10-12% slower decode steps). ``lm_head_argmax`` too when lm_head's weight
    copy or its tiles change: it reads the copy lm_head runs on, with lm_head's tiles, and keeps its
    own kernel otherwise (``fusions._lm_head_argmax``)."""
    out = [f for f, projs in GEMV_FUSION_PROJECTIONS.items()
           if any(_fused_path(f, plan.choice(p), p) != _fused_path(f, base.choice(p), p) for p in projs)]
    head, base_head = plan.choice("lm_head"), base.choice("lm_head")
    moved = head_copy_params(head.impl, head.params) != head_copy_params(base_head.impl, base_head.params)
    return out + (["lm_head_argmax"] if moved else [])


def _fused_path(fusion: str, choice: "OpChoice", op: str) -> tuple:
    """What a fusion runs for projection ``op`` chosen as ``choice``: its GEMV params; for folded_norm
    also whether the residual add is cuBLAS's or the GEMV's (its GEMV fusions run the GEMV either way)."""
    gemv = fused_gemv_params(choice.impl, choice.params, op)
    if fusion == "folded_norm":
        return choice.impl == "reference", gemv
    return (gemv,)


def head_copy_params(impl: str, params: dict[str, Any]) -> tuple[dict[str, Any], int] | None:
    """What ``lm_head_argmax`` takes from lm_head's choice: its copy's GEMV params (``fused_gemv_params``)
    when lm_head reads a weight copy, else None (the fused kernel keeps its own defaults)."""
    return fused_gemv_params(impl, params, "lm_head") if impl in WEIGHT_COPY_IMPLS else None


def rope_fusable(block_n: int, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the qkv GEMV's RoPE epilogue can tile these heads: whole heads per tile, no tile
    across q | k | v."""
    return (block_n % head_dim == 0 and head_dim % 2 == 0 and (num_heads * head_dim) % block_n == 0
            and (num_kv_heads * head_dim) % block_n == 0)


def inert_fusions(plan: "Plan", config: dict[str, Any]) -> dict[str, str]:
    """The enabled fusions that run nothing on this model (``config``: the engine's model config)
    under the plan's params, each with the reason: the engine runs the unfused ops in their place in
    every step, so a trial of one times noise. Session 23's chat compile kept ``qkv_rope`` (x0.989)
    on the 8B, whose 128-wide heads the qkv GEMV's default 64-wide tiles cannot hold."""
    out: dict[str, str] = {}
    if plan.fusions.get("qkv_rope"):
        choice = plan.choice("qkv_proj")
        block_n = int(fused_gemv_params(choice.impl, choice.params, "qkv_proj")[0].get("block_n", GEMV_BLOCK_N))
        D, H, Hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
        if config.get("family") == "qwen3":
            out["qkv_rope"] = "the q/k norm runs between the qkv projection and RoPE (Qwen3): RoPE stays in qk_rope_store"
        elif not rope_fusable(block_n, D, H, Hkv):
            out["qkv_rope"] = (f"the qkv GEMV's block_n {block_n} cannot tile whole heads of {D} ({H} q, {Hkv} kv "
                               f"heads): qkv_proj and qk_rope_store run unfused")
    if plan.fusions.get("gate_up_silu") and plan.fusions.get("folded_norm") and plan.choice("o_proj").impl == "reference":
        out["gate_up_silu"] = ("under folded_norm the fused SiLU takes its 1/rms from the statistics o_proj's Triton GEMV "
                               "leaves; o_proj is cuBLAS: gate_up_proj and the folded silu_and_mul run unfused")
    return out


DEFAULT_GRAPH_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def token_graph_seqs(tokens: int, max_seqs: int) -> int:
    """Sequences a token graph of ``tokens`` rows holds: each sequence of a step brings at least one
    token, and a step holds at most the plan's ``max_seqs``."""
    return min(tokens, max_seqs)


def token_graph_size(sizes: list[int], tokens: int, seqs: int, max_seqs: int) -> int | None:
    """The token graph a prompt or mixed step of ``tokens`` rows from ``seqs`` sequences replays:
    the smallest of ``sizes`` that holds its tokens, if that one holds its sequences too; None:
    the step runs eagerly."""
    for size in sorted(sizes):
        if size >= tokens:
            return size if seqs <= token_graph_seqs(size, max_seqs) else None
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OpChoice(_Strict):
    """The implementation of one op and its tunable parameters."""

    impl: str = Field("reference", description="variant name in the op registry")
    params: dict[str, ParamValue] = Field(default_factory=dict)


class SchedulerKnobs(_Strict):
    """Continuous-batching knobs."""

    max_num_seqs: int = Field(64, ge=1, le=4096, description="most sequences in one step")
    max_num_batched_tokens: int = Field(
        2048, ge=16, le=1 << 20, description="token budget of one step (prefill chunks + decodes)"
    )
    chunked_prefill: bool = Field(True, description="split long prompts across steps")
    mixed_prefill: bool = Field(
        True,
        description="running decodes ride along with prefill chunks in one (eager, varlen) step; "
        "False: prefill steps run alone and decode steps take the CUDA-graph path, alternating "
        "while both have work",
    )
    enable_prefix_caching: bool = True
    overlap: bool = Field(
        False,
        description="launch the next decode step before the host has read this one's tokens (decode-"
        "only steps without log-probs, nothing waiting; engine/overlap.py), so the host's per-step work "
        "runs while the GPU computes; no gain on the CPU, whose steps run synchronously",
    )
    speculative_tokens: int = Field(
        0, ge=0, le=8,
        description="speculative decoding with an n-gram drafter (prompt lookup, engine/ngram_draft.py): up to "
        "this many drafted tokens a sequence, checked in one step; greedy requests only, the tokens unchanged. "
        "0: off. Pays where outputs repeat their context (a replay's extra.speculation says how much)",
    )


# Knobs added after plans were stored and hashed (ledgers, CompiledPlans): left out of the hash
# while they hold their default. A path: a plan field, or a group and its knob.
_HASHED_WHEN_SET = (("scheduler", "overlap"), ("cuda_graph_token_sizes",), ("scheduler", "speculative_tokens"))


class Parallelism(_Strict):
    """How the model is split across devices: ``tensor_parallel`` ranks, each a process with its
    own device (engine/tensor_parallel.py), fixed when the engine starts (``check_parallelism``).
    The compiler reports the degree its cost model predicts best."""

    tensor_parallel: int = Field(1, ge=1, le=8)


# What a split step adds to the plan's ops, by the names the engine's per-op profile times them under
# (engine/benchmark.py) and the cost model fits them by: the all-reduce after each o_proj / down_proj,
# and the one gather of the lm_head's logits.
COLLECTIVES = ("all_reduce", "gather_logits")


class KernelSource(_Strict):
    """Source of an agent-written kernel registered as variant ``impl`` of ``op``."""

    op: str
    impl: str
    source: str = Field(description="Python/Triton source defining `build(**params)`")
    params: dict[str, list[ParamValue]] = Field(
        default_factory=dict, description="tunable parameters: name -> allowed values (first = default)"
    )


class Plan(_Strict):
    """Everything that decides how a forward pass runs."""

    ops: dict[str, OpChoice] = Field(default_factory=dict, description="op name -> implementation")
    fusions: dict[str, bool] = Field(
        default_factory=dict, description="named fusions, e.g. lm_head_argmax"
    )
    cuda_graph_batch_sizes: list[int] = Field(
        default_factory=lambda: list(DEFAULT_GRAPH_BATCH_SIZES),
        description="decode batch sizes captured as CUDA graphs (GPU only); [] = eager",
    )
    cuda_graph_token_sizes: list[int] = Field(
        default_factory=list,
        description="prompt and mixed steps of up to this many tokens (and as many sequences, at most "
        "max_num_seqs) replay a CUDA graph of the next size up, padded (GPU only; every op of a prompt step "
        "must run without waiting on the host, as the reference attention_prefill does); [] = eager",
    )
    scheduler: SchedulerKnobs = Field(default_factory=SchedulerKnobs)
    parallelism: Parallelism = Field(default_factory=Parallelism)
    kernels: list[KernelSource] = Field(default_factory=list)
    name: str | None = Field(None, description="a human label; not part of the hash")

    @field_validator("ops")
    @classmethod
    def _known_ops(cls, ops: dict[str, OpChoice]) -> dict[str, OpChoice]:
        unknown = sorted(set(ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {list(OP_NAMES)}")
        return ops

    @field_validator("fusions")
    @classmethod
    def _known_fusions(cls, fusions: dict[str, bool]) -> dict[str, bool]:
        unknown = sorted(set(fusions) - set(FUSIONS))
        if unknown:
            raise ValueError(f"unknown fusions {unknown}; known: {sorted(FUSIONS)}")
        return {k: v for k, v in fusions.items() if v}

    @field_validator("cuda_graph_batch_sizes", "cuda_graph_token_sizes")
    @classmethod
    def _buckets(cls, sizes: list[int], info: ValidationInfo) -> list[int]:
        kind, top = {"cuda_graph_batch_sizes": ("batch", 4096), "cuda_graph_token_sizes": ("token", 16384)}[
            info.field_name]
        if any(s < 1 or s > top for s in sizes):
            raise ValueError(f"CUDA-graph {kind} sizes must be in 1..{top}")
        return sorted(set(sizes))

    def choice(self, op: str) -> OpChoice:
        return self.ops.get(op, OpChoice())

    def canonical(self) -> dict[str, Any]:
        """The hashed content: defaults made explicit, the label left out."""
        data = self.model_dump(mode="json", exclude={"name"})
        data["ops"] = {op: self.choice(op).model_dump(mode="json") for op in OP_NAMES}
        for *groups, knob in _HASHED_WHEN_SET:  # so plans written before the knob keep their hash
            model, held = self, data
            for g in groups:
                model, held = getattr(model, g), held[g]
            field = type(model).model_fields[knob]
            if held[knob] == field.get_default(call_default_factory=True):
                del held[knob]
        return data

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def with_ops(self, **choices: OpChoice) -> "Plan":
        return self.model_copy(update={"ops": {**self.ops, **choices}})

    def with_tensor_parallel(self, degree: int) -> "Plan":
        """This plan split ``degree`` ways (ValueError outside 1-8); nothing else changed or checked
        (``check_parallelism`` says what a split plan cannot keep)."""
        return self.model_copy(update={"parallelism": Parallelism(tensor_parallel=degree)})


def check_parallelism(plan: Plan, running: int | None = None, devices: int | None = None) -> None:
    """Refuse a plan whose parallelism this engine cannot run (ValueError): a degree other than the
    one it started at (``running``: its weights and cache are split that way), more devices than
    there are (``devices``), or fusions that a row-split projection breaks."""
    tp = plan.parallelism.tensor_parallel
    if running is not None and tp != running:
        raise ValueError(
            f"parallelism.tensor_parallel={tp}: this engine runs at tensor_parallel={running} (its weights "
            f"and KV cache are split at start); start an engine with this plan to run degree {tp}"
        )
    if devices is not None and tp > devices:
        raise ValueError(f"parallelism.tensor_parallel={tp} needs {tp} GPUs, one a rank, from the engine's "
                         f"device on; {devices} visible there")
    split = [why for f, why in fusion_blockers(plan).items() if f in RESIDUAL_IN_PROJECTION_FUSIONS] if tp > 1 else []
    if split:  # before the weights load (the op table would refuse it too)
        raise ValueError("; ".join(split))


class Gain(_Strict):
    """A measured gain of the plan against the baseline, both measured in the same run."""

    metric: str
    baseline: float
    candidate: float
    unit: str = ""
    paired: float | None = Field(
        None, description="median over the request samples of candidate / baseline on the same sample; "
                          "``ratio`` when set. Each sample's requests move both plans alike, which the ratio of "
                          "the two medians (taken on different samples) does not cancel")

    @property
    def ratio(self) -> float:
        if self.paired is not None:
            return self.paired
        return self.candidate / self.baseline if self.baseline else float("nan")


class CompiledPlan(_Strict):
    """A plan plus what it was compiled for, what it gained, and its verification report."""

    plan: Plan
    model: str
    hardware: str
    traffic: dict[str, Any] = Field(default_factory=dict, description="the TrafficShape it was tuned for")
    gains: list[Gain] = Field(default_factory=list)
    verification: dict[str, Any] = Field(default_factory=dict)
    created_at: str | None = None
    kind: Literal["CompiledPlan"] = "CompiledPlan"

    @property
    def plan_hash(self) -> str:
        return self.plan.hash


# What is served when no plan is named (`anneal serve`, `anneal generate`, the tiers `anneal
# compile` starts, an InferenceDeployment without `spec.plan`): on CUDA the hand-set Triton plan
# with overlap scheduling, bench/plans/triton-overlap.json (a test keeps the two equal). On the H200's
# 8B chat replay it ran x1.06-1.12 the tokens/s of triton.json (session 18), and triton.json 16x the
# reference plan's (session 4): the reference plan is for verification, not serving. Elsewhere the
# reference plan: the Triton variants need CUDA.
_CUDA_DEFAULT = {
    "name": "default on CUDA: Triton norms, RoPE+store, attention, SiLU, argmax; cuBLAS projections; overlap",
    "ops": {op: {"impl": impl} for op, impl in (
        ("rmsnorm", "triton"), ("add_rmsnorm", "triton"), ("qk_rope_store", "triton"),
        ("attention_decode", "triton_splitk"), ("attention_prefill", "triton"), ("silu_and_mul", "triton"),
        ("argmax", "triton"))},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "overlap": True},
}


def default_plan(device: str) -> Plan:
    """The plan served on ``device`` (``cuda``, ``cuda:N``, ``cpu``) when none is named."""
    if device.split(":")[0] == "cuda":
        return Plan.model_validate(_CUDA_DEFAULT)
    return Plan(name="default off CUDA: the reference plan")


def load_plan(text: str) -> Plan:
    """A Plan from JSON or YAML text; a CompiledPlan document yields its plan."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("a plan must be a JSON/YAML object")
    if data.get("kind") == "CompiledPlan" or "plan" in data and "model" in data:
        return CompiledPlan.model_validate(data).plan
    return Plan.model_validate(data)
