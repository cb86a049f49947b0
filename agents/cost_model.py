"""A roofline cost model, calibrated online per (op, implementation) by the timings the engine reports.

Why: an experiment costs engine time, a prediction costs nothing. Each op's time is
``max(bytes / bandwidth, flops / matmul rate) + launch cost`` for the model's shapes at a batch
size and context length; the bandwidth and matmul rate come from the engine's microbenchmarks at
start (``/admin/state`` -> ``hardware``) when known, else from the GPU's data sheet. Observed
per-op timings fit a correction per (op, impl[, params]), so the model learns what the roofline
misses (launch gaps, ramp-up, bad tiling): a line ``fixed + slope x roofline`` per call once shapes
with different rooflines are seen, a multiplicative factor (running geometric mean) until then. What the
ops' sum misses of a graphed step (fusions above all: a fused plan reports fused ops no slot
receives; kernels that overlap their neighbours in a graph) is one more factor on the layers' part,
the median per set of fusions. The search uses it to prune
candidates predicted to lose and to pick the tensor-parallel degree (NVLink all-reduce included).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any

from anneal.engine.plan import COLLECTIVES, Plan, token_graph_size, weight_copies
from anneal.agents.types import BenchSpec, EngineState, HardwareSpec, Measurement, ModelShape, Prediction

# Data-sheet numbers (dense bf16; per-direction NVLink per GPU). Microbenchmarks override bandwidth
# and matmul rate when the engine reports them. ``graph_step_us``: measured, not from a sheet, the
# median over the 8B's fits of bench/layer_sweep.py (two plans, batches 1 / 16, contexts 416 / 1024):
# H200 10-18 µs (session 36), H100 4.6-11.8, median 8.4 (session 37; the 1B's four: -1.2 to 9.0); none
# measured on the other GPUs.
GPU_SPECS: dict[str, dict[str, float]] = {
    "H200": dict(mem_gbps=4800, matmul_tflops=989, memory_gb=141, link_gbps=450, graph_step_us=13.0),
    "H100": dict(mem_gbps=3350, matmul_tflops=989, memory_gb=80, link_gbps=450, graph_step_us=8.4),
    "A100": dict(mem_gbps=2039, matmul_tflops=312, memory_gb=80, link_gbps=300),
    "L40S": dict(mem_gbps=864, matmul_tflops=362, memory_gb=48, link_gbps=0),
}

# Public architecture shapes of the `random:<preset>` models, for engines that do not report a config.
MODEL_SHAPES: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                               head_dim=64, intermediate_size=8192, vocab_size=128256),
    "llama-3.1-8b": ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                               head_dim=128, intermediate_size=14336, vocab_size=128256),
    "qwen3-8b": ModelShape(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                           head_dim=128, intermediate_size=12288, vocab_size=151936),
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}

PER_LAYER_OPS = ("add_rmsnorm", "qkv_proj", "qk_rope_store", "attention", "o_proj",
                 "gate_up_proj", "silu_and_mul", "down_proj")
# Weight-streaming projections: one kind of kernel on weights of different sizes. Each one's own
# rooflines barely move with the batch (its weights dominate), so it fits a factor, never a line; the
# family spans 8-250 µs of bytes and fits one (``PROJECTION_FAMILY``), which says how a projection's
# time scales when a tensor-parallel rank streams 1/N of its weights.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
PROJECTION_FAMILY = "projections"
# The plan ops behind what a decode step runs once, whatever its layer count.
HEAD_OPS = ("embedding", "rmsnorm", "lm_head", "argmax")
# What a decode graph of a plan with the ``lm_head_argmax`` fusion runs in place of lm_head and argmax
# (the engine times it apart, ``engine/benchmark.py``). Predicted as the two until it is timed; then as
# itself: session 37 (bench/layer_sweep.py, 1B, H100) found the two 18 µs over it at batch 1, an excess
# the 2-layer step factor took out of the layers' part, and so 8 times over in the whole model's step.
FUSED_HEAD = "lm_head_argmax"
# The fits of the collectives a split engine times as ops of their own (``plan.COLLECTIVES``) are keyed
# ``<collective>/link``: one link, whatever the plan.
COLLECTIVE_IMPL = "link"


def once_a_step_ms(per_op_ms: dict[str, float]) -> float | None:
    """What a decode step runs once, from the engine's per-op timing of it: the embedding, the first
    layer's input norm (``rmsnorm``: the layers after it, and the final norm, take ``add_rmsnorm``)
    and the head. A plan with the fused lm_head + argmax runs that in its graph in place of lm_head and
    argmax (the engine times it beside its eager steps, which still call the two). A split engine
    times the gather of the head's logits apart (``gather_logits``). None when the timing has no head
    (a prompt step's, a fake engine's)."""
    if "lm_head_argmax" in per_op_ms:
        head = per_op_ms["lm_head_argmax"]
    elif "lm_head" in per_op_ms:
        head = per_op_ms["lm_head"] + per_op_ms.get("argmax", 0.0)
    else:
        return None
    once = ("embedding", "rmsnorm", "gather_logits")
    return head + sum(per_op_ms.get(op, 0.0) for op in once)


def _head_key(plan: Plan, spec: BenchSpec) -> tuple[int, str]:
    """What the once-a-step part of a decode step depends on: the batch and the head's choices."""
    head = {op: plan.choice(op).model_dump(mode="json") for op in HEAD_OPS}
    head["lm_head_argmax"] = bool(plan.fusions.get("lm_head_argmax"))
    return spec.batch_size, json.dumps(head, sort_keys=True)


def shape_from_state(state: EngineState) -> ModelShape:
    """The model's shape from the engine's reported config, else from the preset table."""
    dtype_bytes = _DTYPE_BYTES.get(state.dtype.replace("torch.", ""), 2)
    cfg = state.config or {}
    name = state.model.split(":", 1)[-1].lower()
    if not cfg and state.model.startswith("random:"):
        try:  # torch-free: the engine's own preset table
            from anneal.engine.presets import PRESETS

            cfg = dict(PRESETS.get(name, {}))
        except ImportError:
            cfg = {}
    if cfg:
        return shape_from_config(cfg, dtype_bytes, default_layers=state.num_layers_total or 1)
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name].model_copy(update={"dtype_bytes": dtype_bytes})
    raise ValueError(
        f"no shape for model {state.model!r}: the engine reports no config and it is not one of "
        f"{sorted(MODEL_SHAPES)}"
    )


def shape_from_config(cfg: dict[str, Any], dtype_bytes: int = 2, default_layers: int = 1) -> ModelShape:
    """A ModelShape from a Hugging Face-style config dict (the engine's ``config``)."""
    H = int(cfg.get("hidden_size"))
    heads = int(cfg.get("num_attention_heads", cfg.get("num_heads", 1)))
    return ModelShape(
        hidden_size=H,
        num_layers=int(cfg.get("num_hidden_layers", cfg.get("num_layers", default_layers))),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", cfg.get("num_kv_heads", heads))),
        head_dim=int(cfg.get("head_dim") or H // heads),
        intermediate_size=int(cfg.get("intermediate_size")),
        vocab_size=int(cfg.get("vocab_size")),
        dtype_bytes=dtype_bytes,
    )


def hardware_from_state(state: EngineState, num_devices: int = 1) -> HardwareSpec:
    """Data-sheet numbers for the GPU, overridden by the engine's own microbenchmarks."""
    name = state.gpu_name or state.device
    sheet = next((v for k, v in GPU_SPECS.items() if k.lower() in name.lower()), None)
    gpu = state.device.startswith("cuda")
    hw = HardwareSpec(name=name, mem_gbps=50.0, matmul_tflops=0.5, memory_gb=16, num_devices=num_devices,
                      launch_us=5.0 if gpu else 20.0)
    if not gpu:  # ranks on one CPU talk through gloo over loopback: session 34 measured 0.8 ms an all-reduce
        # of 256 B under torchrun, ~1.2 ms a collective inside the engine's degree-2 tiny step (2 cores)
        hw = hw.model_copy(update={"link_gbps": 5.0, "link_latency_us": 1000.0})
    if sheet:
        hw = hw.model_copy(update=sheet)
    upd: dict[str, float] = {}
    if state.hardware.copy_gbps:
        upd["mem_gbps"] = state.hardware.copy_gbps
    if state.hardware.matmul_tflops:
        upd["matmul_tflops"] = state.hardware.matmul_tflops
    if state.hardware.memory_gb:
        upd["memory_gb"] = state.hardware.memory_gb
    return hw.model_copy(update=upd)


@dataclass
class OpCost:
    bytes: float
    flops: float
    launches: int = 1


def op_costs(shape: ModelShape, spec: BenchSpec, tp: int = 1) -> dict[str, OpCost]:
    """Bytes moved and FLOPs of each op for one step of ``spec`` (per layer for the layer ops)."""
    B, L, T = spec.batch_size, spec.prompt_len, step_tokens(spec)
    if spec.mode == "prefill":  # causal: each query sees half the prompt on average
        return _costs(shape, tokens=T, rows=B, keys=L / 2, tp=tp)
    if spec.mode == "mixed":  # B decode rows at context_len and one L-token prompt chunk, one step
        out = _costs(shape, tokens=T, rows=B + 1, keys=0, tp=tp)
        rows = _costs(shape, tokens=B, rows=B, keys=spec.context_len, tp=tp)["attention"]
        chunk = _costs(shape, tokens=L, rows=1, keys=L / 2, tp=tp)["attention"]
        out["attention"] = OpCost(bytes=rows.bytes + chunk.bytes, flops=rows.flops + chunk.flops)
        return out
    return _costs(shape, tokens=T, rows=B, keys=spec.context_len, tp=tp)


def padded_costs(costs: dict[str, OpCost], shape: ModelShape, tokens: int, tp: int = 1) -> dict[str, OpCost]:
    """A token graph's step: every per-token op runs the bucket's ``tokens`` rows, padding included;
    attention, the final norm, lm_head and sampling see only the step's own rows."""
    padded = _costs(shape, tokens=tokens, rows=1, keys=0, tp=tp)
    own = ("attention", "rmsnorm", "lm_head", "argmax")
    return {op: c if op in own else padded[op] for op, c in costs.items()}


def step_tokens(spec: BenchSpec) -> int:
    """Tokens one step of ``spec`` runs through the layers."""
    return {"prefill": spec.batch_size * spec.prompt_len, "mixed": spec.batch_size + spec.prompt_len}.get(
        spec.mode, spec.batch_size)


def projection_weight_elems(shape: ModelShape, op: str, tp: int) -> float:
    """Elements of a projection's weight on one rank (what ``_costs`` counts for its W; lm_head's split
    by vocabulary rows)."""
    H, D, I = shape.hidden_size, shape.head_dim, shape.intermediate_size
    Hq, Hkv = shape.num_heads / tp, max(1.0, shape.num_kv_heads / tp)
    return {"qkv_proj": (Hq + 2 * Hkv) * D * H, "o_proj": H * Hq * D, "gate_up_proj": 2 * I / tp * H,
            "down_proj": H * I / tp, "lm_head": shape.vocab_size / tp * H}[op]


COPY_BYTES = {"fp8": 1.0, "bf12": 1.5}  # bytes a weight of each second-copy format (engine/weight_copies.py)


def second_copy_bytes(shape: ModelShape) -> int:
    """The most bytes of second weight copies one plan can hold on ``shape``: folded_norm's folded
    qkv / gate_up in the model's dtype (``weights.fold_norms``) and bf12 copies of every layer
    projection (of the folded ones then) and of lm_head (the fp8 copies, opt-in, are smaller). On the
    8B: 9.1 + 11.3 GB. What a locally started slow tier leaves room for (``local_engines``)."""
    elems = {op: projection_weight_elems(shape, op, 1) for op in PROJECTIONS}
    layer = sum(n for op, n in elems.items() if op != "lm_head")
    folded = shape.num_layers * (elems["qkv_proj"] + elems["gate_up_proj"]) * shape.dtype_bytes
    return int(folded + (shape.num_layers * layer + elems["lm_head"]) * COPY_BYTES["bf12"])


def copy_costs(costs: dict[str, OpCost], shape: ModelShape, copies: dict[str, str], tp: int) -> dict[str, OpCost]:
    """``costs`` with the W of each projection in ``copies`` (op -> format, ``plan.weight_copies``)
    read from that copy: one byte an element as e4m3, 1.5 as bf12."""
    out = dict(costs)
    for op, fmt in copies.items():
        if op in out:
            c = out[op]
            cut = (shape.dtype_bytes - COPY_BYTES[fmt]) * projection_weight_elems(shape, op, tp)
            out[op] = OpCost(bytes=max(0.0, c.bytes - cut), flops=c.flops, launches=c.launches)
    return out


def _costs(shape: ModelShape, tokens: float, rows: float, keys: float, tp: int) -> dict[str, OpCost]:
    """``tokens`` through the layers, ``rows`` sequences, each attending ``keys`` positions (floats:
    a replay's mean batch and context give its decode steps' summed bytes exactly)."""
    b = shape.dtype_bytes
    H, D, I, V = shape.hidden_size, shape.head_dim, shape.intermediate_size, shape.vocab_size
    Hq, Hkv = shape.num_heads / tp, max(1.0, shape.num_kv_heads / tp)
    T, B = tokens, rows

    def linear(n_out: float, k_in: float) -> OpCost:
        return OpCost(bytes=b * (n_out * k_in + T * (n_out + k_in)), flops=2.0 * T * n_out * k_in)

    qkv_out = (Hq + 2 * Hkv) * D
    return {
        "embedding": OpCost(bytes=2.0 * b * T * H, flops=0),
        "add_rmsnorm": OpCost(bytes=2 * 4.0 * b * T * H, flops=2 * 6.0 * T * H, launches=2),
        "qkv_proj": linear(qkv_out, H),
        "qk_rope_store": OpCost(bytes=b * T * qkv_out * 2, flops=6.0 * T * (Hq + Hkv) * D),
        "attention": OpCost(
            bytes=b * (2.0 * B * keys * Hkv * D + 2 * T * Hq * D),
            flops=4.0 * T * Hq * keys * D,
        ),
        "o_proj": linear(H, Hq * D),
        "gate_up_proj": linear(2 * I / tp, H),
        "silu_and_mul": OpCost(bytes=b * T * 3 * I / tp, flops=4.0 * T * I / tp),
        "down_proj": linear(H, I / tp),
        "rmsnorm": OpCost(bytes=3.0 * b * B * H, flops=6.0 * B * H),
        "lm_head": OpCost(bytes=b * (V * H / tp + B * (H + V / tp)), flops=2.0 * B * V * H / tp),
        # the greedy pick, by the name the engine times it (its benchmarks decode greedily; before
        # session 36 this was "sample", which no timing matched, so it was never calibrated)
        "argmax": OpCost(bytes=4.0 * B * V * 2, flops=10.0 * B * V),
    }


def _op_key(op: str, spec: BenchSpec) -> str:
    """Plan op names for the model's op slots (attention is prefill or decode by mode)."""
    if op == "attention":
        return "attention_prefill" if spec.mode in ("prefill", "mixed") else "attention_decode"
    return op


LINE_SPREAD = 1.2  # the rooflines seen must span this ratio before a line is fitted through them


@dataclass
class _Fit:
    """One (op, impl[, params])'s observed times against its roofline.

    ``factor``: the running geometric mean of observed / roofline (launch cost included), the only
    correction one shape can give. ``line``: observed ms a call = ``fixed + slope * bare roofline``
    (no launch cost), least squares on relative errors, once the bare rooflines seen span
    ``LINE_SPREAD``. Why a line: an op's time is a fixed part (launch, memory ramp, decode
    attention's merge: ~8 µs a call at any size, bench/attention_floor.py) plus its bytes at a rate,
    and one factor fitted at short contexts over-predicted decode attention at long ones by 2-3x
    (session 30, bench/cost_model_replay.py on the 30-minute chat compile's ledger, 7386 per-op
    timings: median error at held-out shapes 3.0-6.4% with lines against 8.3-12.6% with factors)."""

    log_sum: float = 0.0
    n: int = 0
    sw: float = 0.0  # weighted sums over (x = bare roofline ms a call, y = observed ms a call), w = 1/y^2
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    x_min: float = math.inf
    x_max: float = 0.0
    ratios: list[float] = field(default_factory=list)  # every ratio seen, for ``median``
    sizes: list[float | None] = field(default_factory=list)  # the step size each ratio was seen at, for ``median_near``

    def add(self, ratio: float, bare: float | None = None, observed: float | None = None,
            size: float | None = None) -> None:
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        self.log_sum += math.log(ratio)
        self.n += 1
        self.ratios.append(ratio)
        self.sizes.append(size)
        if bare is not None and observed is not None and 0 < bare < math.inf and 0 < observed < math.inf:
            w = 1.0 / observed ** 2
            self.sw += w
            self.sx += w * bare
            self.sy += w * observed
            self.sxx += w * bare * bare
            self.sxy += w * bare * observed
            self.x_min, self.x_max = min(self.x_min, bare), max(self.x_max, bare)

    @property
    def factor(self) -> float:
        return math.exp(self.log_sum / self.n) if self.n else 1.0

    @property
    def median(self) -> float:
        """The median ratio: what the whole-step factors use, so a few plans whose eager per-op
        timings say little about their graphed step (the reference attention's: x0.3-x1.8, session
        31's chat compile) do not move every other plan's prediction."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def median_near(self, size: float) -> float:
        """The median ratio among those seen at the step size nearest ``size`` (by ratio of sizes):
        what a whole-step factor is at the batch asked. Session 37 (bench/layer_sweep.py, 1B, H100):
        the bs=1 GEMV plan's graphed step is 0.61 of its eager per-op sum at batch 1 and 0.73 at 16;
        one median over both put the whole model's step at batch 16 15% low."""
        seen = [s for s in self.sizes if s and s > 0]
        if not seen or size <= 0:
            return self.median
        near = min(seen, key=lambda s: abs(math.log(s / size)))
        return statistics.median(r for r, s in zip(self.ratios, self.sizes) if s == near)

    @property
    def line(self) -> tuple[float, float] | None:
        """``(fixed ms, slope)`` a call, or None until the rooflines seen span ``LINE_SPREAD`` (or
        when the fit is not a cost: a negative fixed part or a slope <= 0)."""
        if self.x_max < LINE_SPREAD * self.x_min:
            return None
        det = self.sw * self.sxx - self.sx * self.sx
        if det <= 0:
            return None
        slope = (self.sw * self.sxy - self.sx * self.sy) / det
        fixed = (self.sy - slope * self.sx) / self.sw
        return (fixed, slope) if fixed >= 0 and slope > 0 else None


@dataclass
class CostModel:
    """Roofline prediction of step time for a plan, with online per-(op, impl) corrections."""

    shape: ModelShape
    hw: HardwareSpec
    layers: int | None = None  # layers the engine runs (fast tier loads a few)
    lines: bool = True  # fit fixed + slope lines where the shapes allow (False: factors only, as before session 30)
    fusion_steps: bool = True  # whole-step factor: median, per set of fusions (False: one geometric mean over every plan, as before session 31)
    layer_steps: bool = True  # the step factor scales the per-layer ops' part only (False: the whole sum, as before session 35)
    step_constant: bool = True  # a graphed decode step's fixed cost counted once (hw.graph_step_us; False: folded into the factor, as before session 36)
    size_steps: bool = True  # the step factor from the steps seen at the nearest size (False: from every size, as before session 37)
    fused_head: bool = True  # a graph's fused lm_head + argmax predicted as timed (False: as lm_head and argmax, as before session 37)
    _fits: dict[str, _Fit] = field(default_factory=dict)
    _once: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # _head_key -> once_a_step_ms
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_state(cls, state: EngineState) -> "CostModel":
        return cls(shape=shape_from_state(state), hw=hardware_from_state(state),
                   layers=state.num_layers_loaded or None)

    # ---- prediction ----------------------------------------------------------------------------

    def roofline_ms(self, cost: OpCost, graphs: bool = False, launch: bool = True) -> float:
        mem_s = cost.bytes / (self.hw.mem_gbps * 1e9)
        flop_s = cost.flops / (self.hw.matmul_tflops * 1e12)
        launch_us = (self.hw.graph_launch_us if graphs else self.hw.launch_us) * cost.launches if launch else 0.0
        return 1e3 * max(mem_s, flop_s) + launch_us / 1e3

    def _fit(self, op: str, plan: Plan) -> _Fit | None:
        """The op's correction: fitted for its params, else for its impl, else none."""
        ch = plan.choice(op)
        with self._lock:
            for key in (_fit_key(op, ch.impl, ch.params), _fit_key(op, ch.impl)):
                fit = self._fits.get(key)
                if fit and fit.n:
                    return fit
        return None

    def _known(self, op: str, plan: Plan) -> bool:
        return self._fit(op, plan) is not None

    def _rooflines(self, plan: Plan, spec: BenchSpec, tp: int) -> dict[str, tuple[float, float, int]]:
        """Per plan op of one step: (roofline ms with launch costs, bare roofline ms a call, calls)."""
        layers = self.layers or self.shape.num_layers
        gpu = self.hw.name.lower() != "cpu"
        costs = op_costs(self.shape, spec, tp)
        if spec.mode == "decode":
            graphs = gpu and spec.batch_size <= max(plan.cuda_graph_batch_sizes or [0])
        else:
            seqs = spec.batch_size + (spec.mode == "mixed")
            bucket = token_graph_size(plan.cuda_graph_token_sizes, step_tokens(spec), seqs,
                                      plan.scheduler.max_num_seqs) if gpu else None
            graphs = bucket is not None
            if graphs:
                costs = padded_costs(costs, self.shape, bucket, tp)
        costs = copy_costs(costs, self.shape, weight_copies(plan), tp)
        out = {}
        for op, cost in costs.items():
            n = layers if op in PER_LAYER_OPS else 1
            out[_op_key(op, spec)] = (n * self.roofline_ms(cost, graphs), self.roofline_ms(cost, launch=False), n)
        if self.fused_head and _fused_head(plan, spec, graphs):  # what the graph runs in their place, fitted apart (``predict``)
            (raw_l, bare_l, _), (raw_a, bare_a, _) = out["lm_head"], out["argmax"]
            out[FUSED_HEAD] = (raw_l + raw_a, bare_l + bare_a, 1)
        return out

    def predict(
        self, plan: Plan, spec: BenchSpec, tp: int | None = None, *, calibrated: bool = True,
        step_factor: bool = True,
    ) -> Prediction:
        """Predicted ms of one benchmark step (decode/prefill) of ``plan``.

        ``calibrated=False`` gives the bare roofline; ``step_factor=False`` leaves out the fitted
        whole-step overhead factor.
        """
        tp = tp or plan.parallelism.tensor_parallel
        layers = self.layers or self.shape.num_layers
        per_op: dict[str, float] = {}
        corrected = False
        at_one = self._rooflines(plan, spec, 1) if tp != 1 and calibrated else {}
        for name, (raw, bare, n) in self._rooflines(plan, spec, tp).items():
            fit = self._fit(name, plan) if calibrated else None
            line = fit.line if fit and self.lines else None
            family = self._family_line(name, plan) if fit and not line and name in at_one else None
            if line:
                per_op[name] = n * (line[0] + line[1] * bare)
            elif family:  # the factor holds at degree 1's bytes; a rank's share scales as the family's line
                raw1, bare1, _ = at_one[name]
                per_op[name] = raw1 * fit.factor * (family[0] + family[1] * bare) / (family[0] + family[1] * bare1)
            else:
                per_op[name] = raw * (fit.factor if fit else 1.0)
            corrected |= fit is not None
        if FUSED_HEAD in per_op:  # the graph's fused head once it is timed, else its two ops' predictions
            if self._known(FUSED_HEAD, plan) and calibrated:
                per_op.pop("lm_head"), per_op.pop("argmax")
            else:
                per_op.pop(FUSED_HEAD)
        total = sum(per_op.values())
        if calibrated and step_factor:
            step = self._step_fit(plan, spec.mode)
            if step is not None:
                if not self.fusion_steps:
                    factor = step.factor
                else:
                    factor = step.median_near(_step_size(spec)) if self.size_steps else step.median
                scaled = self._layers_part(per_op) if self.layer_steps else total
                total += (factor - 1.0) * scaled
                corrected = True
        total += sum(self.collective_ms(c, spec, tp, calibrated=calibrated) for c in COLLECTIVES)
        total += self.step_constant_ms(plan, spec) if calibrated else 0.0
        return Prediction(ms=total, per_op_ms=per_op, corrected=corrected)

    def step_constant_ms(self, plan: Plan, spec: BenchSpec) -> float:
        """What a graphed decode step of ``plan`` costs once beyond its ops (``hw.graph_step_us``).
        Session 36 (bench/layer_sweep.py, 8B, H200): the step over 1-32 layers is a line whose
        intercept exceeds the timed once-a-step ops by 10-18 µs. Fitted into the layers' factor on the
        2-layer fast tier, it was counted 16 times in the whole model's step: predicted 4-7% slow."""
        if not self.step_constant or spec.mode != "decode":
            return 0.0
        graphed = spec.batch_size <= max(plan.cuda_graph_batch_sizes or [0])
        return self.hw.graph_step_us / 1e3 if graphed else 0.0

    def _layers_part(self, per_op: dict[str, float]) -> float:
        """The ms of a prediction's per-op sum the model's layers run (what the step factor scales):
        eager per-op timings overstate a graphed layer's kernels, which overlap their neighbours'
        tails, by ~10% at the 8B's decode shapes; lm_head, one large GEMV a step, not. Session 35:
        a factor on the whole sum, fitted on the 2-layer fast tier where lm_head is ~43% of the
        step, corrected the whole model's 32 layers by 0.95 where they needed ~0.90, and the
        compile's TP table read the 8B step 11% slow (5.386 ms predicted, 4.859 measured)."""
        return sum(ms for op, ms in per_op.items() if _per_layer(op))

    def _family_line(self, op: str, plan: Plan) -> tuple[float, float] | None:
        """The projections' shared line for ``op``'s implementation (``PROJECTIONS``), if fitted."""
        if op not in PROJECTIONS or not self.lines:
            return None
        with self._lock:
            fit = self._fits.get(_fit_key(PROJECTION_FAMILY, plan.choice(op).impl))
        line = fit.line if fit else None
        return line if line and line[0] + line[1] > 0 else None

    def full_model_factor(self, op: str) -> float:
        """How many times the whole model runs ``op`` in a step for each time the loaded layers do:
        the fast tier's 2 layers time o_proj twice, the 8B model runs it 32 times; lm_head runs
        once in both. What a fast-tier millisecond of ``op`` is worth on the deployment."""
        per_layer = _per_layer(op)
        return self.shape.num_layers / self.layers if per_layer and self.layers else 1.0

    def whole_model_ms(self, plan: Plan, spec: BenchSpec, step_ms: float) -> float:
        """A fast-tier decode step of ``plan`` as the whole model would run it: the part run once a
        step as measured, the layers' part scaled to the model's layer count. What plans are ranked
        by: on the 8B's 2-layer fast tier lm_head is ~43% of the step (0.25 of 0.58 ms) against ~5%
        of the whole model's, so on the raw step a few µs of lm_head outweighed 16 times as many of
        the layers' (session 26's top fast-tier plans differed mostly there). The once-a-step part
        is the median of the per-op timings of the plans with the same head choices at this batch;
        untimed there, the same head's at other batches (lm_head reads its weights once, whatever
        the batch), then any head's at this batch, then any; none timed, the calibrated prediction
        of the ops run once. Beside it, once too, a graphed step's constant (``step_constant_ms``).
        On an engine with every layer, the step itself."""
        if not self.layers or self.layers >= self.shape.num_layers:
            return step_ms
        batch, head = _head_key(plan, spec)
        with self._lock:
            seen = (self._once.get((batch, head))
                    or [x for (b, h), xs in self._once.items() if h == head for x in xs]
                    or [x for (b, h), xs in self._once.items() if b == batch for x in xs]
                    or [x for xs in self._once.values() for x in xs])
        once = statistics.median(seen) if seen else sum(
            ms for op, ms in self.predict(plan, spec).per_op_ms.items() if self.full_model_factor(op) == 1.0)
        once = min(once + self.step_constant_ms(plan, spec), step_ms)
        return once + (step_ms - once) * self.shape.num_layers / self.layers

    def whole_model_ratio(self, base: Plan, spec: BenchSpec, base_ms: float, ms: float, per_layer: bool) -> float:
        """A fast-tier step of ``ms`` against the base's ``base_ms`` (plans one change apart: a fusion,
        an op's choice) as the whole model would see it: the difference counted in every layer when
        the change is in each (``per_layer``), once when it runs once a step, against the base's step
        projected to the whole model (``whole_model_ms``). Session 20: on the 8B's 2-layer fast tier
        ``folded_norm`` read x1.004, on the whole model x0.976."""
        scale = self.shape.num_layers / self.layers if per_layer and self.layers else 1.0
        return 1.0 + (ms - base_ms) * scale / self.whole_model_ms(base, spec, base_ms)

    def roofline_step_ms(self, tokens: float, rows: float, keys: float, copies: dict[str, str] | None = None) -> float:
        """One step of ``tokens`` from ``rows`` sequences, each token attending ``keys`` positions,
        at the roofline alone: every op at the larger of its bytes / copy bandwidth and FLOPs /
        matmul rate, no launch cost, no fitted correction. What no plan's kernels can beat without
        reading less or computing less. A decode step: ``tokens == rows``. ``copies``: projections
        whose W a plan reads from a smaller copy (``plan.weight_copies``: op -> format)."""
        layers = self.layers or self.shape.num_layers
        costs = copy_costs(_costs(self.shape, tokens=tokens, rows=rows, keys=keys, tp=1), self.shape, copies or {}, 1)
        return sum(self.roofline_ms(OpCost(c.bytes, c.flops, launches=0)) * (layers if op in PER_LAYER_OPS else 1)
                   for op, c in costs.items())

    def _collective(self, name: str, spec: BenchSpec, tp: int) -> tuple[float, float, int]:
        """The step's ``name`` collectives at degree ``tp`` by the link's figures: (ms of all its calls,
        bare ms a call: its bytes over the link without the latency, calls a step)."""
        b = self.shape.dtype_bytes
        if name == "all_reduce":  # a ring: each rank sends and receives 2 (tp - 1) / tp of the hidden state
            nbytes, share = step_tokens(spec) * self.shape.hidden_size * b, 2.0 * (tp - 1) / tp
            calls = 2 * (self.layers or self.shape.num_layers)  # after o_proj and after down_proj
        else:  # gather_logits: the sampled rows' logits, each rank holding V / tp of them
            nbytes, share, calls = spec.batch_size * self.shape.vocab_size * b, (tp - 1) / tp, 1
        bare = share * nbytes / (self.hw.link_gbps * 1e9) * 1e3
        return calls * (bare + self.hw.link_latency_us / 1e3), bare, calls

    def collective_ms(self, name: str, spec: BenchSpec, tp: int, calibrated: bool = True) -> float:
        """The ms a step spends in ``name`` (``plan.COLLECTIVES``) at degree ``tp``. From the link's
        figures (the data sheet's bandwidth and latency) until a split engine's per-op profile has
        timed the collective; then, calibrated, from its fit: the line ``fixed + slope x bytes over
        the link`` a call once the sizes seen span ``LINE_SPREAD`` (the fixed part is the measured
        latency), else the figures times the measured factor. One fit serves every degree: a compile
        times the degree its engines run, and other degrees take its latency with their own bytes."""
        if tp <= 1:
            return 0.0
        if self.hw.link_gbps <= 0:
            return math.inf
        figure, bare, calls = self._collective(name, spec, tp)
        if calibrated:
            with self._lock:
                fit = self._fits.get(_fit_key(name, COLLECTIVE_IMPL))
            if fit and fit.n:
                line = fit.line if self.lines else None
                return calls * (line[0] + line[1] * bare) if line else figure * fit.factor
        return figure

    def allreduce_ms(self, spec: BenchSpec, tp: int, calibrated: bool = True) -> float:
        """A layer's two all-reduces of the hidden state under tensor parallelism."""
        return self.collective_ms("all_reduce", spec, tp, calibrated) / (self.layers or self.shape.num_layers)

    def gather_ms(self, spec: BenchSpec, tp: int, calibrated: bool = True) -> float:
        """The step's one all-gather of its sampled rows' logits (each rank holds V/tp of them)."""
        return self.collective_ms("gather_logits", spec, tp, calibrated)

    # ---- calibration ---------------------------------------------------------------------------

    def observe(self, plan: Plan, spec: BenchSpec, m: Measurement) -> None:
        """Fit the corrections from one measurement (per op when the engine reports per-op times)."""
        rooflines = self._rooflines(plan, spec, plan.parallelism.tensor_parallel)
        once = once_a_step_ms(m.per_op_ms) if m.per_op_ms and spec.mode == "decode" else None
        if once is not None:
            with self._lock:
                self._once.setdefault(_head_key(plan, spec), []).append(once)
        tp = plan.parallelism.tensor_parallel
        if m.per_op_ms:
            # An engine that times its collectives apart reports projections without them; one that
            # does not (before session 35) has them inside o/down/lm_head, taken out by the figures.
            apart = any(c in m.per_op_ms for c in COLLECTIVES)
            figures = {c: self._collective(c, spec, tp) for c in COLLECTIVES
                       if c in m.per_op_ms and tp > 1 and self.hw.link_gbps > 0}
            with self._lock:
                for op, ms in m.per_op_ms.items():
                    if op in figures:
                        figure, bare, calls = figures[op]
                        self._fits.setdefault(_fit_key(op, COLLECTIVE_IMPL), _Fit()).add(ms / figure, bare, ms / calls)
                        continue
                    raw, bare, n = rooflines.get(op, (0.0, 0.0, 1))
                    if raw > 0:
                        if not apart:
                            ms = max(ms - self._collectives_in(op, spec, tp, n), 0.05 * ms)
                        ch = plan.choice(op)
                        keys = [_fit_key(op, ch.impl, ch.params), _fit_key(op, ch.impl)]
                        if op in PROJECTIONS:
                            keys.append(_fit_key(PROJECTION_FAMILY, ch.impl))
                        for key in keys:
                            self._fits.setdefault(key, _Fit()).add(ms / raw, bare, ms / n)
        if spec.mode in ("decode", "prefill", "mixed"):
            # What the per-op model still misses (kernels overlapping in a graph, framework overhead
            # between ops, fusions) as one factor on the layers' part (``_layers_part``).
            pred = self.predict(plan, spec, step_factor=False)  # the step's constant included
            scaled = self._layers_part(pred.per_op_ms) if self.layer_steps else pred.ms
            ratio = (m.median_ms - (pred.ms - scaled)) / scaled if scaled > 0 else 0.0
            if ratio > 0:
                size = _step_size(spec)
                with self._lock:
                    self._fits.setdefault(_step_key(spec.mode), _Fit()).add(ratio, size=size)
                    if self.fusion_steps:
                        self._fits.setdefault(_step_key(spec.mode, plan.fusions), _Fit()).add(ratio, size=size)

    def _collectives_in(self, op: str, spec: BenchSpec, tp: int, calls: int) -> float:
        """The ms of collectives a split model ran inside ``op``'s measured time (the all-reduce after
        each o_proj / down_proj, the logits' gather in lm_head), by the link's figures: taken out
        before the fit, since ``predict`` adds them on their own. Without it a compile at degree 2
        fitted them into o/down and its predictions for other degrees counted them twice. Only for
        per-op timings from before the engine timed its collectives apart (ledgers of session 34)."""
        if tp <= 1 or self.hw.link_gbps <= 0:
            return 0.0
        if op in ("o_proj", "down_proj"):
            return calls * self.allreduce_ms(spec, tp, calibrated=False) / 2
        return self.gather_ms(spec, tp, calibrated=False) if op == "lm_head" else 0.0

    def _step_fit(self, plan: Plan, mode: str) -> _Fit | None:
        """The whole-step factor for ``plan``: fitted on plans with its fusions, else on the plans whose
        fusions overlap its own most (Jaccard; the most observed on a tie), else on every plan.
        Why per fusion set: a fused plan's engine reports its fused ops (``rope_attention``,
        ``o_proj_residual_``, ...), not the op slots they replace, so its per-op prediction is the
        unfused plan's and only the step factor can learn what the fusions save. One factor over all
        plans put session 31's fused chat plans 6-10% high (0.611 predicted, 0.556 measured)."""
        with self._lock:
            if self.fusion_steps:
                own = self._fits.get(_step_key(mode, plan.fusions))
                if own and own.n:
                    return own
                mine, best, best_rank = set(plan.fusions), None, (0.0, 0)
                prefix = _step_key(mode) + "|"
                for key, fit in self._fits.items():
                    if not key.startswith(prefix) or not fit.n:
                        continue
                    theirs = set(filter(None, key[len(prefix):].split(",")))
                    union = mine | theirs
                    rank = (len(mine & theirs) / len(union) if union else 1.0, fit.n)
                    if rank[0] > 0 and rank > best_rank:
                        best, best_rank = fit, rank
                if best is not None:
                    return best
            step = self._fits.get(_step_key(mode))
            return step if step and step.n else None

    def calibrations(self) -> dict[str, dict[str, float]]:
        """Each fit's factor and observation count, with its line's fixed µs a call and slope once it has
        one; the whole-step fits (``step/<mode>[|fusions]``) give the factor ``predict`` uses."""
        with self._lock:
            out = {}
            for k, f in sorted(self._fits.items()):
                step = k.startswith("step/") and self.fusion_steps
                out[k] = {"factor": f.median if step else f.factor, "n": f.n}
                if self.lines and f.line:
                    out[k].update(fixed_us=f.line[0] * 1e3, slope=f.line[1])
            return out

    # ---- decisions -----------------------------------------------------------------------------

    # ---- one-op deltas: what a choice does to the whole step, when the engine reports no per-op times

    def observe_delta(self, base: Plan, plan: Plan, spec: BenchSpec, base_ms: float, ms: float) -> None:
        """``plan`` differs from ``base`` in one op: its step-time ratio is that op choice's effect."""
        diff = _op_diff(base, plan)
        if len(diff) == 1 and base_ms > 0 and ms > 0:
            with self._lock:
                self._fits.setdefault(_delta_key(diff[0], plan, spec), _Fit()).add(ms / base_ms)

    def predict_from_base(self, base: Plan, plan: Plan, spec: BenchSpec, base_ms: float) -> float | None:
        """``base_ms`` times the learned effect of each op ``plan`` changes; None if one is unknown."""
        ms = base_ms
        with self._lock:
            for op in _op_diff(base, plan):
                fit = self._fits.get(_delta_key(op, plan, spec))
                if fit is None or not fit.n:
                    return None
                ms *= fit.factor
        return ms

    def should_prune(
        self, plan: Plan, spec: BenchSpec, best_ms: float, margin: float = 0.25,
        base: Plan | None = None, base_ms: float | None = None,
    ) -> bool:
        """Prune only on a calibrated prediction of a clear loss: every op's impl fitted from per-op
        timings, or every changed op's effect learned from one-op experiments against ``base``."""
        if not math.isfinite(best_ms):
            return False
        pred = self.predict(plan, spec)
        calibrated = all(self._known(op, plan) for op in pred.per_op_ms)
        if calibrated and pred.ms > best_ms * (1.0 + margin):
            return True
        if base is not None and base_ms is not None and plan.fusions == base.fusions and (
                plan.cuda_graph_batch_sizes == base.cuda_graph_batch_sizes) and (
                plan.cuda_graph_token_sizes == base.cuda_graph_token_sizes):
            est = self.predict_from_base(base, plan, spec, base_ms)
            return est is not None and est > best_ms * (1.0 + margin)
        return False

    def whole_model(self, num_devices: int | None = None) -> "CostModel":
        """A copy of this model predicting every layer of the model (its fits are per call, so the fast
        tier's carry over) on ``num_devices`` GPUs: what ``choose_tp`` is asked at the end of a compile.
        Why the fits and not the bare roofline: a rank of degree N runs the same kernels on 1/N of the
        bytes, and their fixed part does not shrink. Session 33 (bench/tp_probe.py, H200): one rank's
        share of the 8B step at degree 2 measured 0.59-0.66 of degree 1's at batches 1-64; the bare
        roofline said 0.53-0.54, the lines fitted by session 31's compiles 0.58-0.61."""
        with self._lock:
            fits, once = copy.deepcopy(self._fits), copy.deepcopy(self._once)
        hw = self.hw if num_devices is None else self.hw.model_copy(update={"num_devices": num_devices})
        return CostModel(shape=self.shape, hw=hw, layers=None, lines=self.lines, fusion_steps=self.fusion_steps,
                         layer_steps=self.layer_steps, step_constant=self.step_constant, size_steps=self.size_steps,
                         fused_head=self.fused_head, _fits=fits, _once=once)

    def choose_tp(
        self, spec: BenchSpec, objective: str = "latency", kv_gb: float = 0.0, plan: Plan | None = None,
    ) -> tuple[int, dict[int, float]]:
        """The tensor-parallel degree for this hardware: 1, 2, 4, 8 up to the GPU count.

        ``latency`` minimises the step time; ``throughput`` maximises tokens/s per GPU. A degree whose
        weights and KV cache do not fit in memory is skipped. ``plan``: whose step (default the reference
        plan's ops).
        """
        table: dict[int, float] = {}
        tp = 1
        while tp <= self.hw.num_devices:
            fits = (self.shape.weight_bytes / 1e9 + kv_gb) / tp < 0.9 * self.hw.memory_gb
            if fits:
                ms = self.predict(plan or Plan(), spec, tp=tp).ms
                table[tp] = ms if objective == "latency" else ms * tp
            tp *= 2
        if not table:
            raise ValueError(
                f"the model ({self.shape.weight_bytes / 1e9:.0f} GB) does not fit on "
                f"{self.hw.num_devices} x {self.hw.memory_gb:.0f} GB"
            )
        best = min(table, key=lambda k: (table[k], k))
        return best, table


def _fused_head(plan: Plan, spec: BenchSpec, graphs: bool) -> bool:
    """Whether a step of ``spec`` runs ``FUSED_HEAD``: a graphed decode step of a plan with the fusion."""
    return bool(plan.fusions.get(FUSED_HEAD)) and spec.mode == "decode" and graphs


def _per_layer(op: str) -> bool:
    """Whether every layer runs ``op`` (a prediction's keys name attention by mode: ``attention_decode``)."""
    return op in PER_LAYER_OPS or op.startswith("attention")


def _fit_key(op: str, impl: str, params: dict[str, Any] | None = None) -> str:
    if params is None:
        return f"{op}/{impl}"
    return f"{op}/{impl}/{json.dumps(params, sort_keys=True)}"


def _op_diff(base: Plan, plan: Plan) -> list[str]:
    from anneal.engine.plan import OP_NAMES

    return [op for op in OP_NAMES if base.choice(op) != plan.choice(op)]


def _delta_key(op: str, plan: Plan, spec: BenchSpec) -> str:
    ch = plan.choice(op)
    return f"delta/{_fit_key(op, ch.impl, ch.params)}|{spec.key()}"


def _step_size(spec: BenchSpec) -> float:
    """The size a whole-step factor is kept by: a decode step's batch, another step's tokens."""
    return float(spec.batch_size if spec.mode == "decode" else step_tokens(spec))


def _step_key(mode: str, fusions: dict[str, bool] | None = None) -> str:
    """The whole-step factor's key: over every plan, or (``fusions`` given) over plans with those fusions."""
    if fusions is None:
        return f"step/{mode}"
    return f"step/{mode}|" + ",".join(sorted(f for f, on in fusions.items() if on))


def replay_headroom(split: dict[str, float], model: CostModel,
                    speculation: dict[str, Any] | None = None, plan: Plan | None = None) -> dict[str, float] | None:
    """How much faster a workload replay (``time_split`` of a slow-tier benchmark) could get from
    plan changes that keep its tokens: every step at the roofline (``roofline_step_ms`` at the
    steps' mean tokens, rows and positions attended), nothing between steps.

    Bytes and FLOPs are linear in those, so the mean step gives max(summed bytes time, summed FLOPs
    time) per op, never more than the steps' own rooflines summed: ``bound`` is an upper bound on
    the tokens/s any plan can multiply this replay's by without reading or computing less per token
    (quantization, speculative decoding). None when the split lacks what it needs (an engine from
    before it reported the positions attended).

    With ``speculation`` (the replay's n-gram drafter figures, engine/ngram_draft.py), also the bound
    with speculative decoding: the decode tokens in ``tokens_per_step`` times fewer steps, each a
    verify step at the roofline computing ``1 + drafted_per_step`` rows a sequence (``spec_bound``).

    ``plan``: the replayed plan, so the decode steps of its projections on fp8 / bf12 copies are held to the roofline of the
    bytes they read (prompt steps run the bf16 weights); without it every W counts as bf16."""
    need = ("total_ms", "decode_ms", "decode_steps", "decode_mean_batch", "decode_mean_context",
            "prefill_ms", "prefill_steps", "tokens_in_prefill_steps", "prefill_mean_rows", "prefill_mean_context")
    if not split or any(k not in split for k in need) or not split["decode_steps"]:
        return None
    rows = split["decode_mean_batch"]
    copies = weight_copies(plan) if plan is not None else {}
    decode = model.roofline_step_ms(rows, rows, split["decode_mean_context"], copies)
    prefill = 0.0
    if split["prefill_steps"]:
        per_step = split["tokens_in_prefill_steps"] / split["prefill_steps"]
        prefill = split["prefill_steps"] * model.roofline_step_ms(
            per_step, split["prefill_mean_rows"], split["prefill_mean_context"])
    step = split["decode_ms"] / split["decode_steps"]
    best = prefill + split["decode_steps"] * decode
    out = {"roofline_step_ms": decode, "decode_step_ms": step, "of_roofline": decode / step,
           "prefill_roofline_ms": prefill, "prefill_ms": split["prefill_ms"],
           "bound_ms": best, "bound": split["total_ms"] / best if best > 0 else math.inf}
    if speculation and speculation.get("verify_steps"):
        per_step = speculation["tokens_per_step"]
        verify = model.roofline_step_ms(rows * (1 + speculation["drafted_per_step"]), rows,
                                        split["decode_mean_context"], copies)
        spec = prefill + split["decode_steps"] / per_step * verify
        out.update(spec_tokens_per_step=per_step, spec_verify_roofline_ms=verify, spec_bound_ms=spec,
                   spec_bound=split["total_ms"] / spec if spec > 0 else math.inf)
    return out
