"""The truth verification measures a plan against: the served weights' teacher-forced logits in fp32.

Why: two bf16 plans that compute the same function with other roundings sit about sqrt(2) times as
far from each other as each sits from the exact result, so a gate on the distance to the bf16
reference plan fails plans that are as accurate as the reference (the H200's 8B, session 21: the
reference plan 0.0722 from this truth, `folded_norm` 0.0715, `folded_norm` to the reference 0.0953,
the tolerance 0.0707). Here the reference ops run in fp32 on the very same (bf16) weights, each
weight upcast only while its op runs, so the truth costs a few hundred MB beside a served engine,
not a second copy of the model.

One varlen prompt pass over each prompt followed by its forced tokens gives every position's logits
at once (teacher forcing needs no decode steps); its KV cache is a small fp32 one of its own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from anneal.engine.models.transformer import Transformer
from anneal.engine.op_table import OpTable
from anneal.engine.ops import reference as ref

_CHUNK = 1 << 24  # weight elements upcast at a time (64 MB in fp32): lm_head is 0.5-2 GB in fp32


def _f32(t):
    """Low-precision float tensors in fp32; everything else (indices, fp32 caches, floats) as is."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
        return t.float()
    return t


def _linear32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32, ``w`` upcast a slice of output rows at a time."""
    x = x.float()
    rows = max(1, _CHUNK // max(1, w.shape[1]))
    if w.dtype == torch.float32 or w.shape[0] <= rows:
        return F.linear(x, w.float())
    return torch.cat([F.linear(x, w[i:i + rows].float()) for i in range(0, w.shape[0], rows)], dim=-1)


def _upcast(fn):
    return lambda *args, **kw: fn(*map(_f32, args), **{k: _f32(v) for k, v in kw.items()})


def _fp32_ops() -> OpTable:
    """The reference ops on fp32 activations with each weight upcast while it is used (no fusions)."""
    fns = {name: _upcast(getattr(ref, name)) for name in (
        "rmsnorm", "add_rmsnorm", "qk_rope_store", "attention_decode", "attention_prefill", "silu_and_mul")}
    fns["embedding"] = lambda ids, weight: F.embedding(ids, weight).float()  # rows first, then upcast
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        fns[name] = _linear32
    return OpTable(fns, {})


@contextlib.contextmanager
def _exact_fp32_matmuls():
    """No TF32 (10-bit mantissa products) while the truth runs."""
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was[0], was[1]
        torch.set_float32_matmul_precision(was[2])


@torch.inference_mode()
def truth_logits(engine, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, ``[len(forced) + 1, V]`` fp32 logits on the CPU: the positions verification's
    teacher-forced runs read (the prompt's last token, then each forced token), computed in fp32."""
    return engine.runner.mirror(_truth_logits, prompts, forced)  # every rank: its share of the heads


def _truth_logits(runner, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    cfg = runner.cfg  # this rank's shard at tensor_parallel > 1
    bs = runner.block_size
    seqs = [list(p) + list(f) for p, f in zip(prompts, forced)]
    lens = [len(s) for s in seqs]
    tables, cu, last, next_block = [], [0], [], 0
    for p, n in zip(prompts, lens):  # each sequence on blocks of its own, one after the other
        nb = -(-n // bs)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
        last.extend(range(cu[-1] + len(p) - 1, cu[-1] + n))
        cu.append(cu[-1] + n)
    kv = torch.zeros(runner.model.num_layers, 2, max(1, next_block), bs, cfg.num_key_value_heads, cfg.head_dim,
                     dtype=torch.float32, device=runner.device)
    slots = [t[j // bs] * bs + j % bs for t, n in zip(tables, lens) for j in range(n)]
    model = Transformer(cfg, runner.model.w, runner.tp.wrap(_fp32_ops()), max(lens))
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=runner.device)
    with _exact_fp32_matmuls():
        logits = runner._varlen_logits(model, kv, ids, [j for n in lens for j in range(n)], slots, cu, lens,
                                       tables, False, last).cpu()
    return list(logits.split([len(f) + 1 for f in forced]))
