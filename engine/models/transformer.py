"""The decoder of Llama 3.x and Qwen3 dense, written against the op table.

Both families are the same pre-norm GQA transformer; Qwen3 adds a per-head RMSNorm on q and k
before RoPE (the `qk_rope_store` op takes the norm weights, or None). Every computation goes through
``self.ops`` so that a plan can swap implementations without touching this file.
"""

from __future__ import annotations

import math

import torch

from anneal.engine.config import ModelConfig
from anneal.engine.context import AttnContext
from anneal.engine.op_table import OpTable
from anneal.engine.weights import Weights, fold_norms


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 frequency scaling when the config asks for it."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: ModelConfig, max_pos: int, device: torch.device) -> torch.Tensor:
    """``[max_pos, head_dim]`` float32: cos in the first half, sin in the second."""
    inv = rope_inv_freq(cfg)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: Weights, ops: OpTable, max_pos: int):
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        self.num_layers = len(weights.layers)
        self.cos_sin = rope_cos_sin(cfg, max_pos, weights.embed.device)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext, kv: torch.Tensor
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for the ``T`` scheduled tokens.

        ``kv``: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
        """
        if self.ops.folded_rope_store is not None:
            return self._forward_folded(ids, positions, ctx, kv)
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        T = ids.shape[0]
        x = ops.embedding(ids, self.w.embed)
        residual = None
        h = None  # the next layer's normed input, when a fused GEMV epilogue already computed it
        pending = None  # norm_stats: the next norm's input (NormInput), applied by the GEMV that loads it
        layers = self.w.layers
        for i, L in enumerate(layers):
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            rope_args = (positions, self.cos_sin, k_cache, v_cache, ctx.slot_mapping, H, Hkv,
                         L.q_norm, L.k_norm, eps)
            q = qkv = None  # the rotated queries, or the qkv rows still to rotate (with the attention)
            if pending is not None:
                q, qkv, residual = ops.norm_stats_qkv(pending, L.input_norm, eps, L.qkv, *rope_args)
                pending = None
            elif h is None and ops.norm_qkv_proj is not None:  # fused: the norm in the GEMV's prologue
                qkv, residual = ops.norm_qkv_proj(x, residual, L.input_norm, eps, L.qkv)
            else:
                if h is None:
                    if residual is None:
                        residual, h = x, ops.rmsnorm(x, L.input_norm, eps)
                    else:
                        h, residual = ops.add_rmsnorm(x, residual, L.input_norm, eps)
                if ops.qkv_rope_store is not None:  # fused: RoPE + cache store in the GEMV's epilogue
                    q = ops.qkv_rope_store(h, L.qkv, *rope_args)
                else:
                    qkv = ops.qkv_proj(h, L.qkv)
            a = self._attention(q, k_cache, v_cache, ctx) if q is not None else self._rope_attention(qkv, rope_args, ctx)
            a = a.reshape(T, H * D)
            gu = act = None  # gate_up output / activation, when a fusion produced it instead of the normed h
            stats_down = ops.down_proj_add_stats is not None and i + 1 < len(layers)
            if ops.o_proj_add_stats is not None:  # fused: the sum and its statistics; the norm in gate_up's load
                act, gu, residual = ops.norm_stats_gate_up(ops.o_proj_add_stats(a, L.o, residual), L.post_norm,
                                                           eps, L.gate_up)
            elif ops.o_proj_add_rmsnorm is not None:  # fused: the norm in the GEMV's last tile
                h, residual = ops.o_proj_add_rmsnorm(a, L.o, residual, L.post_norm, eps)
            elif ops.norm_gate_up_proj is not None:
                gu, residual = ops.norm_gate_up_proj(ops.o_proj(a, L.o), residual, L.post_norm, eps, L.gate_up)
            else:
                h, residual = ops.add_rmsnorm(ops.o_proj(a, L.o), residual, L.post_norm, eps)
            if act is None and gu is None and ops.gate_up_silu is not None:  # fused: activation in the epilogue
                act = ops.gate_up_silu(h, L.gate_up)
            elif act is None:
                gu = ops.gate_up_proj(h, L.gate_up) if gu is None else gu
                keep_gu = ops.silu_mul_down is not None and ops.down_proj_add_rmsnorm is None and not stats_down
                act = None if keep_gu else ops.silu_and_mul(gu)
            if stats_down:  # the next layer's norm: its qkv GEMV normalises with these statistics
                pending, h = ops.down_proj_add_stats(act, L.down, residual), None
                continue
            if ops.down_proj_add_rmsnorm is not None:  # the next layer's (or the final) norm fused
                h, residual = ops.down_proj_add_rmsnorm(act, L.down, residual, next_norm, eps)
                continue
            h = None
            x = ops.silu_mul_down(gu, L.down) if act is None else ops.down_proj(act, L.down)
        if h is None:
            h, _ = ops.add_rmsnorm(x, residual, self.w.final_norm, eps)
        return h

    def _rope_attention(self, qkv: torch.Tensor, rope_args: tuple, ctx: AttnContext,
                        rms_of: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE + cache store (``rope_args``: ``qk_rope_store``'s after qkv), then attention: one kernel
        in decode steps under the ``rope_attention`` fusion. ``rms_of``: the stream whose 1/rms
        scales the rows (``folded_norm``)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if ops.rope_attention is not None and not ctx.is_prefill:
            return ops.rope_attention(qkv, *rope_args, ctx.block_tables, ctx.context_lens, self.scale,
                                      rms_of=rms_of, rms_eps=eps)
        q = ops.qk_rope_store(qkv, *rope_args) if rms_of is None else ops.folded_rope_store(qkv, rms_of, eps, *rope_args)
        return self._attention(q, rope_args[2], rope_args[3], ctx)

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext):
        if ctx.is_prefill:
            return self.ops.attention_prefill(
                q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens_q, ctx.context_lens, ctx.max_seqlen_q,
                self.scale,
            )
        return self.ops.attention_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.scale)

    def _forward_folded(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext, kv: torch.Tensor
    ) -> torch.Tensor:
        """``forward`` under the ``folded_norm`` fusion: the residual stream ``s`` is what every
        projection reads and what o / down add into (in their GEMM); the norms' weights live in the
        folded qkv / gate_up weights and their 1/rms in the RoPE and SiLU kernels (fusions.py)."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        T = ids.shape[0]
        folded = fold_norms(self.w)
        s = ops.embedding(ids, self.w.embed)
        for i, (L, F) in enumerate(zip(self.w.layers, folded)):
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            rope_args = (positions, self.cos_sin, k_cache, v_cache, ctx.slot_mapping, H, Hkv, L.q_norm, L.k_norm, eps)
            a = self._rope_attention(ops.qkv_proj(s, F.qkv), rope_args, ctx, rms_of=s)
            if ops.folded_gate_up_silu is not None:  # the SiLU and its 1/rms in gate_up's epilogue
                act = ops.folded_gate_up_silu(s, ops.o_proj_residual_stats_(a.reshape(T, H * D), L.o, s), F.gate_up, eps)
            else:
                ops.o_proj_residual_(a.reshape(T, H * D), L.o, s)
                act = ops.folded_silu_and_mul(ops.gate_up_proj(s, F.gate_up), s, eps)
            ops.down_proj_residual_(act, L.down, s)
        return ops.rmsnorm(s, self.w.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.lm_head(hidden, self.w.lm_head)
