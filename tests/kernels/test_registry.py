"""Every Triton variant is registered, declares its params as data, and builds a function with
exactly its reference's signature (names, order, defaults)."""

from __future__ import annotations

import inspect

import pytest

from anneal.engine.kernels import fused_entry_points
from anneal.engine.ops.registry import Param, all_ops, build_op

EXPECTED = {
    "rmsnorm": "triton", "add_rmsnorm": "triton", "silu_and_mul": "triton", "qk_rope_store": "triton",
    "attention_decode": "triton_splitk", "attention_prefill": "triton",
    "qkv_proj": "triton_gemv_splitk", "o_proj": "triton_gemv_splitk", "gate_up_proj": "triton_gemv_splitk",
    "down_proj": "triton_gemv_splitk", "lm_head": "triton_gemv_splitk",
}


def _sig(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("op,impl", sorted(EXPECTED.items()))
def test_variant_contract(op, impl):
    od = all_ops()[op]
    assert impl in od.variants, f"{op}: {sorted(od.variants)}"
    v = od.variants[impl]
    assert v.devices == ("cuda",) and v.description and v.params
    assert all(isinstance(p, Param) and len(p.choices) >= 2 for p in v.params)
    assert any(p.name == "pdl" for p in v.params)
    for p in v.params:  # every choice builds (validated through the registry)
        for choice in p.choices:
            fn = build_op(op, impl, {p.name: choice})
            assert _sig(fn) == _sig(od.reference), f"{op}/{impl} {p.name}={choice}"


def test_unknown_param_is_rejected():
    with pytest.raises(ValueError, match="unknown param"):
        build_op("attention_decode", "triton_splitk", {"splitk": 4})


def test_fused_entry_points_declare_params():
    fused = fused_entry_points()
    assert set(fused) == {"lm_head_argmax", "norm_lm_head_argmax", "silu_mul_down_proj", "add_rmsnorm_linear",
                          "rmsnorm_linear", "qkv_rope_store", "linear_add_rmsnorm", "gate_up_silu"}
    from anneal.engine.kernels.gemv import small_m_gemm

    from anneal.engine.kernels.gemv import lm_head_argmax

    for name, entry in fused.items():
        params = inspect.signature(entry["fn"]).parameters
        inner = lm_head_argmax if "lm_head" in name else small_m_gemm
        names = (set(inspect.signature(inner).parameters) if any(p.kind is p.VAR_KEYWORD for p in params.values())
                 else set(params))
        for p in entry["params"]:
            assert p.name in names, f"{name}: param {p.name} is not a keyword of the function"
