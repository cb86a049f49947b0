"""The plan's fusions: callables that replace a chain of ops with one Triton kernel (GPU, or the
Triton interpreter in tests).

Each fused GEMV takes the params of the projection it replaces (when that projection is the Triton
GEMV) and, above that variant's ``max_m`` rows (prefill), runs the unfused ops of the plan instead.
The names bound on the op table are ``OpTable.FUSED``; ``anneal.engine.plan.FUSIONS`` says what each
plan fusion replaces.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from anneal.engine.plan import (
    GEMV_BLOCK_N, GEMV_FUSION_PROJECTIONS, WEIGHT_COPY_IMPLS, fused_gemv_params, head_copy_params,
)


def build_fusions(names: list[str], fns: dict[str, Callable], choices: dict[str, tuple[str, dict]]) -> dict[str, Callable]:
    """The callables behind a plan's fusions, keyed by their ``OpTable.FUSED`` names. Each GEMV
    fusion runs with the params of its projections in ``GEMV_FUSION_PROJECTIONS``."""
    from anneal.engine.kernels import gemv

    out: dict[str, Callable] = {}
    for name in names:
        projs = GEMV_FUSION_PROJECTIONS.get(name, ())
        gemv_params = {proj: fused_gemv_params(*choices[proj], proj) for proj in projs}
        if name == "lm_head_argmax":
            out[name] = _lm_head_argmax(gemv, *choices.get("lm_head", ("reference", {})))
        elif name == "silu_mul_down":  # down_proj
            out[name] = _silu_mul_down(gemv, fns, *gemv_params[projs[0]])
        elif name == "linear_norm":  # o_proj, down_proj
            for proj in projs:
                out[f"{proj}_add_rmsnorm"] = _linear_norm(gemv, fns, proj, *gemv_params[proj])
        elif name == "gate_up_silu" and "folded_norm" in names:  # gate_up_proj, its 1/rms from o_proj's statistics
            out["folded_gate_up_silu"] = _folded_gate_up_silu(gemv, fns, out, *gemv_params[projs[0]])
        elif name == "gate_up_silu":  # gate_up_proj
            out["gate_up_silu"] = _gate_up_silu(gemv, fns, *gemv_params[projs[0]])
        elif name == "qkv_rope":  # qkv_proj
            out["qkv_rope_store"] = _qkv_rope(gemv, fns, *gemv_params[projs[0]])
        elif name == "norm_linear":  # qkv_proj, gate_up_proj
            for proj in projs:
                out[f"norm_{proj}"] = _norm_linear(gemv, fns, proj, *gemv_params[proj])
        elif name == "folded_norm":  # o_proj, down_proj add the residual (cuBLAS, or the GEMV's epilogue)
            out.update(_folded_norm(gemv, fns, choices, gemv_params, stats_for_silu="gate_up_silu" in names))
        elif name == "rope_attention":
            out["rope_attention"] = _rope_attention(choices)
        elif name == "norm_stats":  # o_proj and down_proj leave the statistics, qkv_proj and gate_up_proj use them
            for proj in ("o_proj", "down_proj"):
                out[f"{proj}_add_stats"] = _add_stats(gemv, fns, proj, *gemv_params[proj])
            out["norm_stats_qkv"] = _norm_stats_qkv(gemv, fns, out, *gemv_params["qkv_proj"],
                                                    rotate_in_attention="rope_attention" in names)
            out["norm_stats_gate_up"] = _norm_stats_gate_up(gemv, fns, out, *gemv_params["gate_up_proj"])
    return out


def _lm_head_argmax(gemv, impl: str, params: dict) -> Callable:
    """lm_head + argmax in one GEMV: over lm_head's weight copy with its tiles when the plan runs
    lm_head on one (bf12: ~0.8 of the bf16 GEMV's time on the layer projections), else at the fused kernel's own
    defaults, as before copies existed."""
    copy = head_copy_params(impl, params)
    if copy is None:
        return gemv.lm_head_argmax
    p, _ = copy
    own = {prm.name for prm in gemv.LM_HEAD_ARGMAX_PARAMS}
    kw = {k: v for k, v in p.items() if k in own or k in ("weights", "unpack")}
    return functools.partial(gemv.lm_head_argmax, **kw)


def _folded_norm(gemv, fns: dict[str, Callable], choices: dict[str, tuple[str, dict]],
                 gemv_params: dict[str, tuple[dict, int]], stats_for_silu: bool = False) -> dict[str, Callable]:
    """``folded_norm``: a layer's RMSNorms spread over the kernels around them (the model's
    ``_forward_folded``). The residual stream ``s`` is never normalised in memory: qkv and gate_up
    project ``s`` itself through weights with the norm weight folded in (``weights.fold_norms``; their
    fp8 / bf12 copies are made of those), RoPE + store and SiLU-mul scale each row by ``s``'s 1/rms as
    they load it, and o / down add their output to ``s`` in place: in the GEMM (``s.addmm_``: cuBLAS's
    beta = 1) when they are the reference, in the epilogue of the Triton GEMV they are (on their
    weight copy, if any) up to its ``max_m`` rows. No add kernel, no norm kernel, no copy. The Triton
    RoPE and SiLU kernels take the plan's params for those ops when it chose them; the op table
    refuses o / down on another variant before this is built (``plan.folded_norm_blockers``). With
    ``stats_for_silu`` (the plan fuses ``gate_up_silu`` too) o_proj's GEMV also leaves the new
    stream's row statistics for the gate_up GEMV's folded SiLU (``o_proj_residual_stats_``)."""
    from anneal.engine.kernels import activation, rope

    rope_params = dict(choices["qk_rope_store"][1]) if choices["qk_rope_store"][0] == "triton" else {}
    silu_params = dict(choices["silu_and_mul"][1]) if choices["silu_and_mul"][0] == "triton" else {}

    def folded_rope_store(qkv_raw, stream, eps, positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm,
                          k_norm, rope_eps):
        return rope.qk_rope_store(qkv_raw, positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm, k_norm,
                                  rope_eps, rms_of=stream, rms_eps=eps, **rope_params)

    def folded_silu_and_mul(gu_raw, stream, eps):
        return activation.silu_and_mul(gu_raw, rms_of=stream, rms_eps=eps, **silu_params)

    out = {"folded_rope_store": folded_rope_store, "folded_silu_and_mul": folded_silu_and_mul,
           **{f"{proj}_residual_": _linear_residual(gemv, choices[proj][0], *gemv_params[proj])
              for proj in ("o_proj", "down_proj")}}
    if stats_for_silu:
        out["o_proj_residual_stats_"] = _linear_residual(gemv, choices["o_proj"][0], *gemv_params["o_proj"],
                                                         stats=True)
    return out


def _linear_residual(gemv, impl: str, params: dict, max_m: int, stats: bool = False) -> Callable:
    """``stream += x @ w.T`` in place for a projection chosen as ``impl``: the Triton GEMV's residual
    epilogue up to ``max_m`` rows, else (prompt rows, or the reference projection) cuBLAS's beta = 1.
    With ``stats`` it returns the new stream's per-tile sums of squares from the GEMV, or None where
    cuBLAS added (the consumer then computes the 1/rms itself)."""
    on_gemv = impl == "triton_gemv_splitk" or impl in WEIGHT_COPY_IMPLS

    def linear_residual_(x, w, stream):
        if on_gemv and x.shape[0] <= max_m:
            out = gemv.linear_residual_(x, w, stream, stats=stats, **params)
            return out[1] if stats else out
        stream.addmm_(x, w.t())
        return None if stats else stream

    return linear_residual_


def _folded_gate_up_silu(gemv, fns: dict[str, Callable], fused: dict[str, Callable], params: dict,
                         max_m: int) -> Callable:
    """``gate_up_silu`` under ``folded_norm``: ``silu_and_mul(rms_scaled(gate_up_proj(s, w_folded), s))``
    with the 1/rms from o_proj's statistics in the GEMV's SiLU epilogue; without statistics (o_proj on
    cuBLAS) or above ``max_m`` rows, the plan's gate_up_proj and the folded SiLU kernel."""
    gate_up = fns["gate_up_proj"]

    def folded_gate_up_silu(s, ss, w, eps):
        if ss is None or s.shape[0] > max_m:  # folded_norm's SiLU kernel (looked up per call: built in any order)
            return fused["folded_silu_and_mul"](gate_up(s, w), s, eps)
        return gemv.gate_up_silu(s, w, folded_stats=(ss, eps), **params)

    return folded_gate_up_silu


def _rope_attention(choices: dict[str, tuple[str, dict]]) -> Callable:
    """``attention_decode(qk_rope_store(qkv, ...))`` of a decode step in the split-K attention kernel,
    with the plan's params for it (the op table refuses another attention_decode first); under
    ``folded_norm`` the stream's 1/rms scales q, k and v there too. Prompt steps never call it."""
    from anneal.engine.kernels import attention_decode

    params = dict(choices["attention_decode"][1])

    def rope_attention(qkv, positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm, k_norm, eps,
                       block_tables, context_lens, scale, rms_of=None, rms_eps=0.0):
        return attention_decode.rope_decode_attention(
            qkv, positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm, k_norm, eps, block_tables,
            context_lens, scale, rms_of=rms_of, rms_eps=rms_eps, **params)

    return rope_attention


def _silu_mul_down(gemv, fns: dict[str, Callable], params: dict, max_m: int) -> Callable:
    """``down_proj(silu_and_mul(gu), w)`` with the activation applied as the GEMV loads its input;
    the unfused ops above ``max_m`` rows (prefill)."""
    silu, down = fns["silu_and_mul"], fns["down_proj"]

    def silu_mul_down(gu, w):
        if gu.shape[0] > max_m:
            return down(silu(gu), w)
        return gemv.silu_mul_down_proj(gu, w, **params)

    return silu_mul_down


def _linear_norm(gemv, fns: dict[str, Callable], proj: str, params: dict, max_m: int) -> Callable:
    """``add_rmsnorm(proj(x, w), residual, norm_w, eps)`` -> ``(normed, summed)``, the norm done by
    the GEMV's last tile; the unfused ops above ``max_m`` rows (prefill)."""
    linear, add_norm = fns[proj], fns["add_rmsnorm"]

    def proj_add_rmsnorm(x, w, residual, norm_w, eps):
        if x.shape[0] > max_m:
            return add_norm(linear(x, w), residual, norm_w, eps)
        return gemv.linear_add_rmsnorm(x, w, residual, norm_w, eps, **params)

    return proj_add_rmsnorm


def _gate_up_silu(gemv, fns: dict[str, Callable], params: dict, max_m: int) -> Callable:
    """``silu_and_mul(gate_up_proj(h, w))`` with the activation in the GEMV's epilogue; the unfused
    ops above ``max_m`` rows (prefill)."""
    gate_up, silu = fns["gate_up_proj"], fns["silu_and_mul"]

    def gate_up_silu(h, w):
        if h.shape[0] > max_m:
            return silu(gate_up(h, w))
        return gemv.gate_up_silu(h, w, **params)

    return gate_up_silu


def _qkv_rope(gemv, fns: dict[str, Callable], params: dict, max_m: int) -> Callable:
    """``qk_rope_store(qkv_proj(h, w), ...)`` with the rotation and cache store in the GEMV's
    epilogue; the unfused ops where it does not apply (prefill rows, Qwen3's q/k norm, heads the
    tile size cannot hold whole)."""
    qkv_proj, rope = fns["qkv_proj"], fns["qk_rope_store"]
    block_n = params.get("block_n", GEMV_BLOCK_N)

    def qkv_rope_store(h, w, positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm, k_norm, eps):
        if (h.shape[0] > max_m or q_norm is not None
                or not gemv.rope_fusable(block_n, cos_sin.shape[-1], H, Hkv)):
            return rope(qkv_proj(h, w), positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm, k_norm, eps)
        return gemv.qkv_rope_store(h, w, positions, cos_sin, k_cache, v_cache, slots, H, Hkv, **params)

    return qkv_rope_store


def _norm_linear(gemv, fns: dict[str, Callable], proj: str, params: dict, max_m: int) -> Callable:
    """``(proj(rmsnorm(x [+ residual])), x [+ residual])``: the norm in the GEMV's prologue."""
    linear = fns[proj]

    def norm_proj(x, residual, norm_w, eps, w):
        if x.shape[0] > max_m:
            h, summed = _normed(fns, NormInput(x, residual, None), norm_w, eps)
            return linear(h, w), summed
        if residual is None:
            return gemv.rmsnorm_linear(x, norm_w, eps, w, **params), x
        return gemv.add_rmsnorm_linear(x, residual, norm_w, eps, w, **params)

    return norm_proj


class NormInput(NamedTuple):
    """The input of an RMSNorm not applied yet (``norm_stats``): ``x`` plus ``residual`` when one is
    given (above the GEMV's ``max_m`` rows: the unfused add_rmsnorm, one kernel), else ``x`` is the
    sum already and ``ss`` its rows' sums of squares per tile (the next GEMV normalises as it loads)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    ss: torch.Tensor | None


def _add_stats(gemv, fns: dict[str, Callable], proj: str, params: dict, max_m: int) -> Callable:
    """``proj(x, w) + residual`` and its statistics as a ``NormInput``; above ``max_m`` rows
    (prefill) the projection alone, the add left to the norm's own kernel."""
    linear = fns[proj]

    def proj_add_stats(x, w, residual) -> NormInput:
        if x.shape[0] > max_m:
            return NormInput(linear(x, w), residual, None)
        summed, ss = gemv.linear_add_stats(x, w, residual, **params)
        return NormInput(summed, None, ss)

    return proj_add_stats


def _normed(fns: dict[str, Callable], pending: NormInput, norm_w, eps):
    """``(rmsnorm(x [+ residual]), x [+ residual])`` by the plan's norm kernels (the unfused path)."""
    if pending.residual is None:
        return fns["rmsnorm"](pending.x, norm_w, eps), pending.x
    return fns["add_rmsnorm"](pending.x, pending.residual, norm_w, eps)


def _norm_stats_qkv(gemv, fns: dict[str, Callable], fused: dict[str, Callable], params: dict, max_m: int,
                    rotate_in_attention: bool = False) -> Callable:
    """``(q, qkv, summed)`` from a ``NormInput``, one of ``q`` (rotated, stored) and ``qkv`` (not yet)
    set: with statistics the qkv GEMV normalises as it loads, with RoPE and the cache store in its
    epilogue when the plan fuses ``qkv_rope`` and the heads allow; without them the plan's norm
    kernel, then its qkv path. With ``rotate_in_attention`` (the plan's ``rope_attention``) the
    unrotated ``qkv``, which the model's attention path rotates and stores."""
    qkv_proj, rope = fns["qkv_proj"], fns["qk_rope_store"]
    block_n = params.get("block_n", GEMV_BLOCK_N)

    def norm_stats_qkv(pending: NormInput, norm_w, eps, w, positions, cos_sin, k_cache, v_cache, slots, H, Hkv,
                       q_norm, k_norm, rope_eps):
        rope_args = (positions, cos_sin, k_cache, v_cache, slots, H, Hkv, q_norm, k_norm, rope_eps)
        fused_rope = fused.get("qkv_rope_store")  # looked up per call: the fusions are built in any order
        x, ss = pending.x, pending.ss
        if ss is None or x.shape[0] > max_m:
            h, summed = _normed(fns, pending, norm_w, eps)
            if rotate_in_attention:
                return None, qkv_proj(h, w), summed
            q = fused_rope(h, w, *rope_args) if fused_rope is not None else rope(qkv_proj(h, w), *rope_args)
            return q, None, summed
        if rotate_in_attention:
            return None, gemv.norm_stats_linear(x, ss, norm_w, eps, w, **params), x
        if fused_rope is not None and q_norm is None and gemv.rope_fusable(block_n, cos_sin.shape[-1], H, Hkv):
            return gemv.qkv_rope_store(x, w, positions, cos_sin, k_cache, v_cache, slots, H, Hkv,
                                       norm_stats=(ss, norm_w, eps), **params), None, x
        return rope(gemv.norm_stats_linear(x, ss, norm_w, eps, w, **params), *rope_args), None, x

    return norm_stats_qkv


def _norm_stats_gate_up(gemv, fns: dict[str, Callable], fused: dict[str, Callable], params: dict,
                        max_m: int) -> Callable:
    """``(act, None, summed)`` when the plan fuses ``gate_up_silu``, else ``(None, gate_up, summed)``,
    from a ``NormInput`` (the norm applied as the GEMV loads when it has statistics)."""
    gate_up = fns["gate_up_proj"]

    def norm_stats_gate_up(pending: NormInput, norm_w, eps, w):
        fused_silu = fused.get("gate_up_silu")
        x, ss = pending.x, pending.ss
        if ss is None or x.shape[0] > max_m:
            h, summed = _normed(fns, pending, norm_w, eps)
            return (fused_silu(h, w), None, summed) if fused_silu is not None else (None, gate_up(h, w), summed)
        if fused_silu is not None:
            return gemv.gate_up_silu(x, w, norm_stats=(ss, norm_w, eps), **params), None, x
        return None, gemv.norm_stats_linear(x, ss, norm_w, eps, w, **params), x

    return norm_stats_gate_up
