"""Triton kernel variants. Each module: reference-compatible wrapper, kernel, tunable params as data.

``register_all()`` imports the kernel modules; importing a module registers its variants with the
op registry (``anneal.engine.ops.registry`` calls this lazily).

Registered variants (every one also takes ``pdl``: programmatic dependent launch, sm_90+):

| op | impl | params |
|---|---|---|
| rmsnorm, add_rmsnorm | triton | num_warps |
| silu_and_mul | triton | block, num_warps |
| qk_rope_store | triton | num_warps |
| attention_decode | triton_splitk | split_k (0 = auto), block_n, num_warps, num_stages, pv_precision, merge |
| attention_prefill | triton | block_m, block_n, num_warps, num_stages, pv_precision |
| argmax | triton | block, num_warps |
| qkv_proj, o_proj, gate_up_proj, down_proj, lm_head | triton_gemv_splitk | block_m, block_n, block_k, split_k, num_warps, num_stages, m1, reduce, max_m |
| qkv_proj, o_proj, gate_up_proj, down_proj, lm_head | triton_gemv_fp8 (W's e4m3 copy; lossy, opt-in) | as triton_gemv_splitk |
| qkv_proj, o_proj, gate_up_proj, down_proj, lm_head | triton_gemv_bf12 (W's 12-bit copy, engine/bf12_weights.py) | as triton_gemv_splitk, less m1 and ahead (the dot path), plus unpack |

Fused entry points, whose signatures are not those of a single reference op, for the plan's
fusions (``fused_entry_points()`` lists them with their tunable params, as data):

* ``lm_head_argmax(x[B, K], weight[V, K]) -> tokens[B] int64`` (``anneal.engine.kernels.lm_head_argmax``)
  = ``reference.lm_head`` followed by greedy argmax, without writing the ``[B, V]`` logits;
  ``norm_lm_head_argmax(x, residual | None, norm_weight, eps, weight)`` folds the final norm in too.
* ``qkv_rope_store(x, weight, positions, cos_sin, k_cache, v_cache, slot_mapping, H, Hkv) -> q``
  (``anneal.engine.kernels.gemv``) = ``qk_rope_store(qkv_proj(x, weight), ...)`` for Llama: the
  rotation and the cache store in the GEMV's last-split epilogue.
* ``gate_up_silu(x, weight) -> [T, I]`` = ``silu_and_mul(gate_up_proj(x, weight))``: each tile takes gate
  rows with their up rows and the last split applies the activation.
* ``linear_add_rmsnorm(x, weight, residual, norm_weight, eps) -> (normed, summed)`` =
  ``add_rmsnorm(linear(x, weight), residual, ...)``: the last tile of the GEMV to finish does the norm.
* ``silu_mul_down_proj(gate_up[T, 2*I], weight[N, I]) -> [T, N]`` (``anneal.engine.kernels.gemv``)
  = ``reference.down_proj(reference.silu_and_mul(gate_up), weight)``, the activation applied while
  the GEMV loads its input.
* ``add_rmsnorm_linear(x, residual, norm_weight, eps, weight) -> (y, x + residual)`` and
  ``rmsnorm_linear(x, norm_weight, eps, weight) -> y`` (``anneal.engine.kernels.gemv``) = the norm
  in front of qkv_proj / gate_up_proj done in the GEMV's prologue.

Kernels run on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (set before
triton is first imported), which is how the CPU tests run them.
"""

from __future__ import annotations

_MODULES = ("norm", "activation", "argmax", "rope", "attention_decode", "attention_prefill", "gemv")


def register_all() -> None:
    """Import every kernel module (each registers its variants once, on first import)."""
    import importlib

    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")


def fused_entry_points() -> dict:
    """The fused kernels that replace a *sequence* of reference ops, as data for the plan's fusions:
    name -> ``{"fn", "params", "replaces", "signature"}``; ``fn(*args, **params)`` with params
    chosen from ``params`` (``Param`` tuples, like a variant's)."""
    from anneal.engine.kernels import gemv

    return {
        "lm_head_argmax": {
            "fn": gemv.lm_head_argmax,
            "params": gemv.LM_HEAD_ARGMAX_PARAMS,
            "replaces": ("lm_head", "sample (all requests greedy)"),
            "signature": "lm_head_argmax(x[B, K], weight[V, K]) -> tokens[B] int64",
        },
        "norm_lm_head_argmax": {
            "fn": gemv.norm_lm_head_argmax,
            "params": gemv.LM_HEAD_ARGMAX_PARAMS,
            "replaces": ("add_rmsnorm | rmsnorm (final norm)", "lm_head", "sample (all requests greedy)"),
            "signature": "norm_lm_head_argmax(x[B, K], residual[B, K] | None, norm_weight[K], eps, "
                         "weight[V, K]) -> tokens[B] int64",
        },
        "add_rmsnorm_linear": {
            "fn": gemv.add_rmsnorm_linear,
            "params": gemv.NORM_LINEAR_PARAMS,
            "replaces": ("add_rmsnorm", "qkv_proj | gate_up_proj"),
            "signature": "add_rmsnorm_linear(x[T, K], residual[T, K], norm_weight[K], eps, weight[N, K]) "
                         "-> (y[T, N], x + residual)",
        },
        "rmsnorm_linear": {
            "fn": gemv.rmsnorm_linear,
            "params": gemv.NORM_LINEAR_PARAMS,
            "replaces": ("rmsnorm", "qkv_proj | gate_up_proj"),
            "signature": "rmsnorm_linear(x[T, K], norm_weight[K], eps, weight[N, K]) -> y[T, N]",
        },
        "qkv_rope_store": {
            "fn": gemv.qkv_rope_store,
            "params": gemv.KERNEL_PARAMS,
            "replaces": ("qkv_proj", "qk_rope_store (Llama: no q/k norm)"),
            "signature": "qkv_rope_store(x[T, K], weight[(H + 2*Hkv) * D, K], positions[T], cos_sin[P, D], "
                         "k_cache, v_cache, slot_mapping[T], num_heads, num_kv_heads) -> q[T, H, D]",
        },
        "gate_up_silu": {
            "fn": gemv.gate_up_silu,
            "params": gemv.KERNEL_PARAMS,
            "replaces": ("gate_up_proj", "silu_and_mul"),
            "signature": "gate_up_silu(x[T, K], weight[2*I, K]) -> silu(x @ gate.T) * (x @ up.T)  [T, I]",
        },
        "linear_add_rmsnorm": {
            "fn": gemv.linear_add_rmsnorm,
            "params": gemv.KERNEL_PARAMS,
            "replaces": ("o_proj | down_proj", "add_rmsnorm"),
            "signature": "linear_add_rmsnorm(x[T, K], weight[N, K], residual[T, N], norm_weight[N], eps) "
                         "-> (rmsnorm(x @ weight.T + residual), x @ weight.T + residual)",
        },
        "silu_mul_down_proj": {
            "fn": gemv.silu_mul_down_proj,
            "params": gemv.SILU_MUL_DOWN_PROJ_PARAMS,
            "replaces": ("silu_and_mul", "down_proj"),
            "signature": "silu_mul_down_proj(gate_up[T, 2*I], weight[N, I]) -> [T, N]",
        },
    }
