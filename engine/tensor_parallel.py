"""Tensor parallelism: what one rank of a degree-N engine holds and the collectives its ops add.

Megatron's split of the decoder (``models/transformer.py`` runs it unchanged on a rank's shard):

* q/k/v heads and the gate/up rows by column, so each rank's attention and MLP run on its own heads
  and rows; o_proj and down_proj by row, each followed by an all-reduce of its output (before the
  residual add, which every rank then does on the same sums);
* the KV cache by kv head (the rank's shard config has ``num_key_value_heads / N``);
* lm_head by vocabulary rows, its logits gathered so every rank holds the whole row and picks the
  same token (greedy or seeded sampling) without a broadcast;
* the embedding whole on every rank: a lookup reads one row, so splitting it saves memory only,
  and would cost an all-reduce a step.

Fusions that add the residual inside o_proj / down_proj would add it before the all-reduce, N times
over: ``plan.check_parallelism`` refuses them at degree > 1.
The process side (workers mirroring rank 0's runner calls) is in ``tp_workers.py``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import threading
from typing import Callable

import torch
import torch.distributed as dist

from anneal.engine.config import ModelConfig
from anneal.engine.op_table import OpTable
from anneal.engine.weights import LayerWeights, Weights

TIMEOUT = datetime.timedelta(minutes=10)  # a collective no other rank joins fails after this


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one rank of ``tp`` runs: the engine's decoder on fewer heads, rows and vocabulary."""
    err = cfg.split_error(tp)
    if err:
        raise ValueError(err)
    return cfg.model_copy(update={
        "num_attention_heads": cfg.num_attention_heads // tp, "num_key_value_heads": cfg.num_key_value_heads // tp,
        "intermediate_size": cfg.intermediate_size // tp, "vocab_size": cfg.vocab_size // tp})


def shard_weights(w: Weights, cfg: ModelConfig, tp: int, rank: int) -> Weights:
    """Rank ``rank``'s copy of its slices of the whole weights ``w`` (``cfg``: the whole model's);
    the embedding stays whole (shared, not copied)."""
    def part(n: int) -> slice:
        return slice(rank * n // tp, (rank + 1) * n // tp)

    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layers = []
    for L in w.layers:
        qkv = torch.cat([L.qkv[:q][part(q)], L.qkv[q:q + kv][part(kv)], L.qkv[q + kv:][part(kv)]])
        gate_up = torch.cat([L.gate_up[:inter][part(inter)], L.gate_up[inter:][part(inter)]])
        layers.append(LayerWeights(
            input_norm=L.input_norm, qkv=qkv.contiguous(), o=L.o[:, part(q)].contiguous(),
            post_norm=L.post_norm, gate_up=gate_up.contiguous(), down=L.down[:, part(inter)].contiguous(),
            q_norm=L.q_norm, k_norm=L.k_norm))
    return Weights(embed=w.embed, layers=layers, final_norm=w.final_norm,
                   lm_head=w.lm_head[part(cfg.vocab_size)].contiguous())


class TensorParallel:
    """One rank's place in a degree-``size`` group and the collectives of its step. Collectives are
    skipped on a thread inside ``local_only()``: a call one rank makes alone (the per-op profile's
    extra lm_head + argmax; bench/tp_probe.py timing one rank's share in one process). Compile-ahead
    passes need none of it: they run the plan's own ops, unwrapped."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._local = threading.local()

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: torch.device) -> "TensorParallel":
        """Join the process group (NCCL on GPUs, gloo on the CPU); blocks until every rank has."""
        if dist.is_initialized():
            raise RuntimeError("this process already holds a process group: one tensor-parallel engine a process")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                rank=rank, world_size=size, timeout=TIMEOUT,
                                **({"device_id": device} if device.type == "cuda" else {}))
        return cls(rank, size)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextlib.contextmanager
    def local_only(self):
        self._local.only = True
        try:
            yield
        finally:
            self._local.only = False

    def _communicating(self) -> bool:
        return self.size > 1 and not getattr(self._local, "only", False)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._communicating():
            dist.all_reduce(t)
        return t

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """``[rows, V/N]`` on each rank -> ``[rows, V]`` on every rank, rank 0's columns first."""
        if not self._communicating():
            return logits.repeat(1, self.size) if self.size > 1 else logits  # the whole row's shape
        rows, part = logits.shape
        out = torch.empty(self.size * rows, part, dtype=logits.dtype, device=logits.device)
        dist.all_gather_into_tensor(out, logits.contiguous())  # the ranks' blocks one under the other
        return out.view(self.size, rows, part).permute(1, 0, 2).reshape(rows, self.size * part)

    def smallest(self, n: int, device: torch.device) -> int:
        """The least of every rank's ``n`` (KV blocks: each rank sizes its cache from its free memory)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def rank0s(self, obj):
        """Rank 0's ``obj`` on every rank (a choice made from rank 0's timings)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wrap(self, ops: OpTable, around: Callable[[str, Callable], Callable] | None = None) -> OpTable:
        """``ops`` with the rank's collectives: an all-reduce after o_proj and down_proj (and the fused
        SiLU + down), the lm_head's logits gathered, the fused lm_head + argmax on the whole row.
        ``around(name, fn)`` wraps each collective (``plan.COLLECTIVES``) as an op of its own: the per-op
        profile times them apart from the projections they follow."""
        if self.size == 1:
            return ops
        out = copy.copy(ops)
        all_reduce, gather = self.all_reduce, self.gather_vocab
        if around is not None:
            all_reduce, gather = around("all_reduce", all_reduce), around("gather_logits", gather)

        def reduced(fn):
            def run(*args, **kw):
                return all_reduce(fn(*args, **kw))
            return run

        def lm_head(h, w):
            return gather(ops.lm_head(h, w))

        out.o_proj, out.down_proj, out.lm_head = reduced(ops.o_proj), reduced(ops.down_proj), lm_head
        if ops.silu_mul_down is not None:
            out.silu_mul_down = reduced(ops.silu_mul_down)
        if ops.lm_head_argmax is not None:
            out.lm_head_argmax = lambda h, w: ops.argmax(lm_head(h, w))
        return out


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the GPU ``rank`` places after the engine's (``cuda:1`` -> 1, 2, ...)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)
