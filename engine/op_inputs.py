"""Fresh random inputs for any op at a model's shapes, and the comparison of two implementations.

Used to check a kernel in isolation against its reference (run-time registered kernels, the
kernel lab) and to time one op. Inputs are never zeros; paged-cache inputs use shuffled block
tables and random context lengths so a kernel that ignores them is wrong.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from anneal.engine.config import ModelConfig
from anneal.engine.ops.registry import get_op

LINEAR_SHAPES = {  # op -> (in_features, out_features) as functions of the config
    "qkv_proj": lambda c: (c.hidden_size, c.q_size + 2 * c.kv_size),
    "o_proj": lambda c: (c.q_size, c.hidden_size),
    "gate_up_proj": lambda c: (c.hidden_size, 2 * c.intermediate_size),
    "down_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "lm_head": lambda c: (c.hidden_size, c.vocab_size),
}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _paged(cfg: ModelConfig, batch: int, context: int, block_size: int, device, dtype, g):
    Hkv, D = cfg.num_key_value_heads, cfg.head_dim
    nb_per_seq = -(-context // block_size)
    num_blocks = batch * nb_per_seq + 3
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=g)[: batch * nb_per_seq]
    block_tables = perm.view(batch, nb_per_seq).to(torch.int32).to(device)
    lens = torch.randint(max(1, context // 2), context + 1, (batch,), generator=g)
    lens[0] = context
    return k_cache, v_cache, block_tables, lens.to(torch.int32).to(device)


def make_inputs(
    op: str, cfg: ModelConfig, *, tokens: int = 4, context: int = 64, block_size: int = 16,
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[Any, ...]:
    """Positional arguments for ``op``'s reference signature (``tokens`` = T or batch B)."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, Hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    eps = cfg.rms_norm_eps

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    if op == "embedding":
        return (torch.randint(0, cfg.vocab_size, (tokens,), generator=g).to(device), rnd(cfg.vocab_size, Hd))
    if op == "rmsnorm":
        return (rnd(tokens, Hd), 1 + rnd(Hd, scale=0.1), eps)
    if op == "add_rmsnorm":
        return (rnd(tokens, Hd), rnd(tokens, Hd), 1 + rnd(Hd, scale=0.1), eps)
    if op in LINEAR_SHAPES:
        k, n = LINEAR_SHAPES[op](cfg)
        return (rnd(tokens, k), rnd(n, k, scale=k**-0.5))
    if op == "silu_and_mul":
        return (rnd(tokens, 2 * cfg.intermediate_size),)
    if op == "qk_rope_store":
        from anneal.engine.models.transformer import rope_cos_sin

        k_cache, v_cache, bt, _ = _paged(cfg, 1, max(context, tokens), block_size, device, dtype, g)
        positions = torch.randint(0, context, (tokens,), generator=g).to(device)
        flat = bt.flatten().long()
        slots = (flat[:, None] * block_size + torch.arange(block_size, device=flat.device)).flatten()
        slot_mapping = slots[torch.randperm(slots.numel(), generator=g)[:tokens].to(slots.device)]
        slot_mapping[-1] = -1  # padding rows must be skipped
        qn = 1 + rnd(D, scale=0.1) if cfg.qk_norm else None
        kn = 1 + rnd(D, scale=0.1) if cfg.qk_norm else None
        return (rnd(tokens, cfg.q_size + 2 * cfg.kv_size), positions,
                rope_cos_sin(cfg, context, torch.device(device)), k_cache, v_cache, slot_mapping,
                H, Hkv, qn, kn, eps)
    if op == "attention_decode":
        k_cache, v_cache, bt, lens = _paged(cfg, tokens, context, block_size, device, dtype, g)
        return (rnd(tokens, H, D), k_cache, v_cache, bt, lens, D**-0.5)
    if op == "attention_prefill":
        batch = max(1, min(3, tokens))
        k_cache, v_cache, bt, lens = _paged(cfg, batch, context, block_size, device, dtype, g)
        q_lens = [max(1, int(L) // (b + 1)) for b, L in enumerate(lens.tolist())]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
        return (rnd(int(cu[-1]), H, D), k_cache, v_cache, bt, cu, lens, max(q_lens), D**-0.5)
    if op == "argmax":
        return (rnd(tokens, cfg.vocab_size, scale=3.0),)
    if op == "sample":
        B, V = tokens, cfg.vocab_size
        return (rnd(B, V, scale=3.0).float(),
                torch.rand(B, generator=g).to(device) * 1.5,
                (0.5 + 0.5 * torch.rand(B, generator=g)).to(device),
                torch.randint(0, 50, (B,), generator=g).to(torch.int32).to(device),
                torch.randint(0, 2**40, (B,), generator=g).to(device),
                torch.randint(0, 4096, (B,), generator=g).to(device))
    get_op(op)  # raises a clear error for unknown ops
    raise NotImplementedError(f"no input generator for op {op!r}")


def clone_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def compare(
    op: str, candidate: Callable, args: tuple[Any, ...], dtype: torch.dtype
) -> dict[str, Any]:
    """Run reference and candidate on copies of ``args``; compare outputs and mutated inputs.

    Returns ``{ok, max_rel_err, nonfinite, detail}``. Integer outputs must match exactly.
    """
    ref_args, cand_args = clone_args(args), clone_args(args)
    ref_out = get_op(op).reference(*ref_args)
    cand_out = candidate(*cand_args)
    if cand_out is None and ref_out is not None:
        return {"ok": False, "max_rel_err": float("inf"), "nonfinite": False,
                "detail": "candidate returned None"}
    pairs = list(zip(_tensors(ref_out), _tensors(cand_out)))
    pairs += [(r, c) for r, c in zip(ref_args, cand_args) if isinstance(r, torch.Tensor)]
    if len(_tensors(ref_out)) != len(_tensors(cand_out)):
        return {"ok": False, "max_rel_err": float("inf"), "nonfinite": False,
                "detail": "candidate returned a different number of tensors"}
    worst, nonfinite = 0.0, False
    tol = TOLERANCE.get(dtype, 1e-4)
    for r, c in pairs:
        if r.shape != c.shape:
            return {"ok": False, "max_rel_err": float("inf"), "nonfinite": False,
                    "detail": f"shape {tuple(c.shape)} != reference {tuple(r.shape)}"}
        if not r.is_floating_point():
            if not torch.equal(r.cpu(), c.cpu()):
                return {"ok": False, "max_rel_err": float("inf"), "nonfinite": False,
                        "detail": "integer output differs from the reference"}
            continue
        cf, rf = c.float(), r.float()
        if not torch.isfinite(cf).all() and torch.isfinite(rf).all():
            nonfinite = True
            worst = float("inf")
            continue
        err = ((cf - rf).norm() / rf.norm().clamp_min(1e-12)).item()
        worst = max(worst, err)
    ok = worst <= tol and not nonfinite
    return {"ok": ok, "max_rel_err": worst, "nonfinite": nonfinite,
            "detail": "" if ok else f"relative error {worst:.3g} > tolerance {tol:g}"}
