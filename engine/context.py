"""The one context object a forward pass carries: where each token's KV goes and what it attends to.

Built by the runner from the scheduled sequences; read by the attention ops. In a CUDA graph the
tensors are static buffers that the runner refills before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnContext:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (not stored)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padding entries 0
    context_lens: torch.Tensor  # [B] int32: tokens in cache after this step's tokens are stored
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32 (prefill / extend only)
    max_seqlen_q: int = 1
