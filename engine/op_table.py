"""The op table: the callables a plan selects, bound as attributes the model calls.

Building a table validates every choice (unknown op, variant or parameter -> OpError) before
anything is swapped, so a bad plan never leaves the engine half-rebound.
"""

from __future__ import annotations

from typing import Callable

from anneal.engine.fusions import build_fusions
from anneal.engine.ops.registry import OpError, all_ops, build_op, get_variant, interpreting
from anneal.engine.plan import Plan, fusion_blockers, fusion_conflicts


class OpTable:
    FUSED = ("lm_head_argmax", "silu_mul_down", "norm_qkv_proj", "norm_gate_up_proj", "qkv_rope_store",
             "o_proj_add_rmsnorm", "down_proj_add_rmsnorm", "gate_up_silu", "o_proj_add_stats",
             "down_proj_add_stats", "norm_stats_qkv", "norm_stats_gate_up", "folded_rope_store",
             "folded_silu_and_mul", "o_proj_residual_", "down_proj_residual_", "o_proj_residual_stats_",
             "folded_gate_up_silu", "rope_attention")
    # Fused entry points, None unless the plan enables them.
    lm_head_argmax: Callable | None = None
    silu_mul_down: Callable | None = None
    norm_qkv_proj: Callable | None = None  # (x, residual | None, norm_w, eps, w) -> (qkv, residual)
    norm_gate_up_proj: Callable | None = None
    qkv_rope_store: Callable | None = None  # qk_rope_store's signature with (h, w) in place of qkv
    o_proj_add_rmsnorm: Callable | None = None  # (x, w, residual, norm_w, eps) -> (normed, summed)
    down_proj_add_rmsnorm: Callable | None = None
    gate_up_silu: Callable | None = None  # (h, w) -> silu_and_mul(gate_up_proj(h, w))
    # norm_stats: (x, w, residual) -> NormInput (x @ w.T + residual with its rows' sums of squares)
    o_proj_add_stats: Callable | None = None
    down_proj_add_stats: Callable | None = None
    # (NormInput, norm_w, eps, w, *qk_rope_store args) -> (q, qkv, summed): q rotated and stored, or under
    # rope_attention the unrotated qkv
    norm_stats_qkv: Callable | None = None
    norm_stats_gate_up: Callable | None = None  # (NormInput, norm_w, eps, w) -> (act | None, gate_up | None, summed)
    # folded_norm: (qkv of the residual stream through folded weights, stream, eps, *qk_rope_store args) -> q
    folded_rope_store: Callable | None = None
    folded_silu_and_mul: Callable | None = None  # (gate_up of the stream through folded weights, stream, eps) -> act
    o_proj_residual_: Callable | None = None  # (x, w, stream) -> stream += x @ w.T, in place
    down_proj_residual_: Callable | None = None
    # folded_norm + gate_up_silu: (x, w, stream) -> the new stream's per-tile sums of squares, or None
    # (cuBLAS added); (stream, those, folded w, eps) -> the activation, its 1/rms in the GEMV's epilogue
    o_proj_residual_stats_: Callable | None = None
    folded_gate_up_silu: Callable | None = None
    # rope_attention: (qkv, *qk_rope_store args, block_tables, context_lens, scale, rms_of=, rms_eps=) -> a
    # decode step's attention output; rms_of is the stream under folded_norm (its 1/rms scales q, k, v)
    rope_attention: Callable | None = None

    def __init__(self, fns: dict[str, Callable], choices: dict[str, tuple[str, dict]],
                 fusions: dict[str, Callable] | None = None):
        self._fns = fns
        self.choices = choices  # op -> (impl, resolved params)
        for name, fn in fns.items():
            setattr(self, name, fn)
        for name, fn in (fusions or {}).items():
            setattr(self, name, fn)

    @staticmethod
    def resolve(plan: Plan, device: str = "cpu", skip: frozenset = frozenset()) -> dict[str, tuple[str, dict]]:
        """``op -> (impl, resolved params)``, building nothing; raises OpError for an unknown
        variant, one that does not run on ``device``, a parameter outside its choices, or fusions
        off the GPU. ``(op, impl)`` pairs in ``skip`` (a plan's own kernels, not registered yet)
        are left out."""
        choices: dict[str, tuple[str, dict]] = {}
        for name in all_ops():
            c = plan.choice(name)
            if (name, c.impl) in skip:
                continue
            v = get_variant(name, c.impl)
            if device not in v.devices and not (device == "cpu" and interpreting()):
                raise OpError(f"{name}/{c.impl} does not run on {device} (runs on {v.devices})")
            choices[name] = (c.impl, v.resolve_params(c.params))
        if plan.fusions and device != "cuda" and not interpreting():
            raise OpError(f"fusions {sorted(plan.fusions)} need a CUDA GPU")
        clash = fusion_conflicts(plan.fusions)
        if clash:
            raise OpError("fusions that rewrite the same ops cannot be combined: "
                          + ", ".join(f"{a} with {b}" for a, b in clash))
        blocked = fusion_blockers(plan)
        if blocked:
            raise OpError("; ".join(blocked.values()))
        return choices

    @classmethod
    def from_plan(cls, plan: Plan, device: str = "cpu") -> "OpTable":
        choices = cls.resolve(plan, device)
        fns = {name: build_op(name, impl, params) for name, (impl, params) in choices.items()}
        return cls(fns, choices, build_fusions(sorted(plan.fusions), fns, choices))

    @classmethod
    def reference(cls) -> "OpTable":
        return cls.from_plan(Plan())
