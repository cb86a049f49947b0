"""Random paged KV caches for attention tests: shuffled blocks, padded block tables, and a loud value
(100.0) in every block no sequence owns, so a kernel that reads padding blocks gets a wrong answer."""

from __future__ import annotations

import torch

from kernel_testing import randn

PAD_VALUE = 100.0


def paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, device, g, extra_blocks=3):
    """(k_cache, v_cache, block_tables int32 [B, NB], context_lens int32 [B])."""
    need = [(L + block_size - 1) // block_size for L in context_lens]
    nb_max = max(max(need), 1) + 1  # one more column than any sequence needs: padding is exercised
    total = sum(need) + extra_blocks + 1  # block 0 stays unowned: padding entries point at it
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(context_lens), nb_max, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    shape = (total, block_size, num_kv_heads, head_dim)
    k = randn(*shape, dtype=torch.float32, device="cpu", g=g)
    v = randn(*shape, dtype=torch.float32, device="cpu", g=g)
    owned = torch.zeros(total, block_size, dtype=torch.bool)
    for b, L in enumerate(context_lens):
        for t in range(L):
            owned[tables[b, t // block_size], t % block_size] = True
    k[~owned] = PAD_VALUE
    v[~owned] = PAD_VALUE
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return (k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device),
            tables.to(device), lens.to(device))
