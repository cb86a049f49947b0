"""Plain-PyTorch reference implementations: the definition of every op.

Every variant (Triton, fused, agent-written) must compute the same function as these, on any valid
input; verification always has them to compare against. They are written for clarity and numerics
close to Hugging Face `transformers`, and where they run in the decode hot path they avoid host
syncs and data-dependent shapes so the reference plan can be captured in a CUDA graph too.

Shared layouts (see also `anneal.engine.context`):
  * KV cache of one layer: ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  * ``slot_mapping[T]`` int64: cache slot ``block * block_size + offset`` of each new token; ``-1`` =
    do not store (padding).
  * ``block_tables[B, max_blocks]`` int32: physical block of each logical block; entries past a
    sequence's length are padding (0) and must never influence the result.
  * ``context_lens[B]`` int32: tokens of each sequence in the cache, including the new ones.
  * ``cos_sin[max_pos, head_dim]`` float32: ``[:, :D/2]`` = cos, ``[:, D/2:]`` = sin (rotate-half RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from anneal.engine.ops.registry import define_op


@define_op("embedding", "embedding(ids[T] int64, weight[V, H]) -> [T, H]")
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


@define_op("rmsnorm", "rmsnorm(x[T, H], weight[H], eps) -> [T, H]")
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


@define_op(
    "add_rmsnorm",
    "add_rmsnorm(x[T, H], residual[T, H], weight[H], eps) -> (rmsnorm(x + residual), x + residual)",
)
def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return _rms(summed, weight, eps), summed


def rms_scaled(x_raw: torch.Tensor, stream: torch.Tensor, eps: float) -> torch.Tensor:
    """``x_raw`` times each row's ``rsqrt(mean(stream**2) + eps)``, rounded to ``x_raw``'s dtype.

    The ``folded_norm`` fusion projects the un-normalised residual ``stream`` through weights with
    the RMSNorm's weight folded in (``W * norm_w``); this brings the projection back to what the
    normalised input would have given. Not an op: the reference of the kernels that apply it."""
    rstd = torch.rsqrt(stream.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x_raw.float() * rstd).to(x_raw.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


# The projections share one signature but are separate ops, so a plan can choose per projection
# (decode GEMV shapes differ a lot between qkv, o, gate_up, down and lm_head).
for _name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
    define_op(_name, f"{_name}(x[T, K], weight[N, K]) -> [T, N]")(_linear)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as Hugging Face Llama applies it (cos/sin ``[T, D/2]``, in x's dtype)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into the paged cache; slots ``-1`` are skipped (no sync)."""
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    # Padding rows (slot -1) must write nothing, without a host sync. Each is sent to the slot of
    # the first valid row with that row's values, so every write to a slot carries the same data
    # (index_copy_ with duplicate indices and different data is nondeterministic on CUDA: a padding
    # row rewriting slot 0 with its old contents raced a real token stored in slot 0). With no
    # valid row at all, slot 0 is rewritten with its own contents.
    valid = slot_mapping >= 0
    # the first valid row (0 when there is none), as a 1-element index: a 0-d tensor index would
    # be read on the host (a sync, and a failed CUDA-graph capture)
    first = valid.to(torch.int32).argmax().view(1)
    first_ok = valid[first]
    slots = torch.where(valid, slot_mapping, torch.where(first_ok, slot_mapping[first], 0))
    src_k = torch.where(valid[:, None, None], k, k[first])
    src_v = torch.where(valid[:, None, None], v, v[first])
    keep_k = torch.where(valid[:, None, None] | first_ok, src_k.to(flat_k.dtype), flat_k[slots])
    keep_v = torch.where(valid[:, None, None] | first_ok, src_v.to(flat_v.dtype), flat_v[slots])
    flat_k.index_copy_(0, slots, keep_k)
    flat_v.index_copy_(0, slots, keep_v)


@define_op(
    "qk_rope_store",
    "qk_rope_store(qkv[T, (H + 2*Hkv) * D], positions[T], cos_sin[P, D], k_cache, v_cache, "
    "slot_mapping[T], num_heads, num_kv_heads, q_norm[D] | None, k_norm[D] | None, eps) -> q[T, H, D]; "
    "splits qkv, applies the optional per-head q/k RMSNorm (Qwen3), rotates q and k, stores k and v",
)
def qk_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    T = qkv.shape[0]
    D = cos_sin.shape[-1]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = q.reshape(T, num_heads, D)
    k = k.reshape(T, num_kv_heads, D)
    v = v.reshape(T, num_kv_heads, D)
    if q_norm is not None:
        q = _rms(q, q_norm, eps)
        k = _rms(k, k_norm, eps)
    cs = cos_sin[positions]
    cos, sin = cs[:, : D // 2], cs[:, D // 2 :]
    q = rotate_half_rope(q, cos, sin)
    k = rotate_half_rope(k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor
) -> torch.Tensor:
    """``[B, max_blocks * block_size, Hkv, D]``: each sequence's blocks laid end to end."""
    B, nb = block_tables.shape
    g = cache[block_tables.long()]  # [B, nb, bs, Hkv, D]
    return g.reshape(B, nb * cache.shape[1], *cache.shape[2:])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q ``[B, Tq, H, D]``, k/v ``[B, Tk, Hkv, D]``, mask ``[B, Tq, Tk]`` bool -> ``[B, Tq, H, D]``."""
    H, Hkv = q.shape[2], k.shape[2]
    rep = H // Hkv
    # Slots past a sequence's length hold whatever the block held before (even NaN): they must
    # contribute nothing, and 0 * NaN is NaN, so they are zeroed, not just given zero weight.
    seen = mask.any(dim=1)[:, :, None, None]  # [B, Tk, 1, 1]: a key some query may read
    k = torch.where(seen, k, torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(seen, v, torch.zeros((), dtype=v.dtype, device=v.device))
    # Query head h reads kv head h // rep: group the queries instead of copying k/v rep times.
    B, Tq, _, D = q.shape
    qg = q.reshape(B, Tq, Hkv, rep, D).float()
    scores = torch.einsum("bqgrd,bkgd->bgrqk", qg, k.float()) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # fully masked rows (padding) give zeros, not NaN
    out = torch.einsum("bgrqk,bkgd->bqgrd", probs, v.float())
    return out.reshape(B, Tq, Hkv * rep, D).to(q.dtype)


@define_op(
    "attention_decode",
    "attention_decode(q[B, H, D], k_cache, v_cache, block_tables[B, NB] int32, "
    "context_lens[B] int32, scale) -> [B, H, D]; one query per sequence at position context_len-1",
)
def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    k = gather_kv(k_cache, block_tables)
    v = gather_kv(v_cache, block_tables)
    Tk = k.shape[1]
    mask = torch.arange(Tk, device=q.device)[None, :] < context_lens[:, None]
    return _attend(q[:, None], k, v, mask[:, None, :], scale)[:, 0]


@define_op(
    "attention_prefill",
    "attention_prefill(q[T, H, D], k_cache, v_cache, block_tables[B, NB] int32, "
    "cu_seqlens_q[B+1] int32, context_lens[B] int32, max_seqlen_q, scale) -> [T, H, D]; "
    "varlen causal attention over the paged cache (the new tokens' k/v are already stored; "
    "query i of sequence b sits at position context_lens[b] - q_len[b] + i)",
)
def attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    bs = k_cache.shape[1]
    for b in range(len(lens)):
        s, e, L = cu[b], cu[b + 1], lens[b]
        if e == s:
            continue
        nblk = (L + bs - 1) // bs
        bt = block_tables[b : b + 1, :nblk]
        k = gather_kv(k_cache, bt)[:, :L]
        v = gather_kv(v_cache, bt)[:, :L]
        qpos = torch.arange(L - (e - s), L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
        out[s:e] = _attend(q[None, s:e], k, v, mask[None], scale)[0]
    return out


@define_op("silu_and_mul", "silu_and_mul(x[T, 2*I]) -> silu(x[:, :I]) * x[:, I:]  [T, I]")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- sampling -----------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (products stay below 2**63: no overflow)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    return x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), ``[B, V]``: a function of (seed, step, token) only.

    No generator state and no host sync; a request's samples do not depend on its batch.
    """
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    h = _mix32(seeds[:, None] & _MASK32)
    h = _mix32(h ^ (seeds[:, None] >> 32) & _MASK32)
    h = _mix32(h ^ (steps[:, None] & _MASK32))
    h = _mix32(h ^ idx)
    return ((h >> 8).float() + 0.5) / float(1 << 24)


@define_op(
    "argmax",
    "argmax(logits[B, V]) -> tokens[B] int64; the greedy choice, the lowest index on ties",
)
def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@define_op(
    "sample",
    "sample(logits[B, V], temperature[B] f32, top_p[B] f32, top_k[B] int32, seeds[B] int64, "
    "steps[B] int64) -> tokens[B] int64; greedy where temperature == 0, else Gumbel-max over the "
    "top-k / top-p filtered distribution with counter-based noise (deterministic per seed and step)",
)
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    V = logits.shape[-1]
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).long()
    keep = rank < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    keep &= (before < top_p[:, None]) | (rank == 0)
    u = uniform_noise(seeds, steps, V).gather(1, sorted_idx)
    gumbel = -torch.log(-torch.log(u))
    choice = (sorted_logits.masked_fill(~keep, float("-inf")) + gumbel).argmax(dim=-1)
    sampled = sorted_idx.gather(1, choice[:, None])[:, 0]
    return torch.where(temperature > 0, sampled, greedy)
