"""Fused lm_head + greedy argmax: ``lm_head_argmax(x[B, K], weight[V, K]) -> tokens[B] int64``.

Equal to ``reference.lm_head(x, weight).argmax(-1)`` (logits rounded to x's dtype before the
comparison, ties to the lowest token id), without writing the ``[B, V]`` logits. It is the plan's
``lm_head_argmax`` fusion for all-greedy batches: ``sample`` takes logits, so this cannot be a
variant of ``sample``; the engine calls it in place of lm_head + sample when every request in the
step is greedy. Tunable parameters: ``LM_HEAD_ARGMAX_PARAMS`` (keyword arguments of the function).

``norm_lm_head_argmax(x, residual | None, norm_weight, eps, weight)`` also folds the model's final
(add +) RMSNorm into the same kernel.
"""

from anneal.engine.kernels.gemv import LM_HEAD_ARGMAX_PARAMS, lm_head_argmax, norm_lm_head_argmax

__all__ = ["lm_head_argmax", "norm_lm_head_argmax", "LM_HEAD_ARGMAX_PARAMS"]
