"""Paged KV-cache bookkeeping: which physical block holds which tokens, and prefix caching.

Pure Python (no torch), so every accounting rule is unit-tested on the CPU.

Prefix caching: a *full* block is identified by a chained hash of (previous block's hash, its
token ids). A block is entered in the hash table only once its KV has been computed, so a
sequence can never hit a block that another sequence is still prefilling. Hits are verified by
token ids and by the identity of the block before them (its id and generation), so a hash
collision anywhere in the chain is a miss, not wrong output. Freed blocks keep their hash until they
are reused, so a later request with the same prefix still hits; free blocks are reused in LRU order.
Shared blocks are never written: when a whole prompt hits, its last block is recomputed in a fresh
block so the step still has a token to compute.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from anneal.engine.sequence import Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    # Identity of the block before this one when it was hashed: (id, generation), None for the
    # first block. With token_ids it verifies the whole chain, so a hash collision is a miss.
    parent: tuple[int, int] | None = None
    generation: int = 0  # bumped each time the block is reused for new content


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        # Cumulative prefix-cache accounting (for the metrics).
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (e.g. after a plan change: KV computed
        by the old forward pass is not what the new one would compute)."""
        for bid in self._free:
            b = self.blocks[bid]
            if b.hash is not None and self._by_hash.get(b.hash) == bid:
                del self._by_hash[b.hash]
            b.hash, b.token_ids, b.parent = None, (), None

    def reuse_first(self, block_ids: list[int]) -> None:
        """Hand these free blocks out next (verification recycles the very blocks it just used)."""
        for bid in reversed(block_ids):
            if bid in self._free:
                self._free.move_to_end(bid, last=False)

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -----------------------------------------------------------------------------

    def _take_free(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, _ = self._free.popitem(last=False)
            b = self.blocks[block_id]
            if b.hash is not None and self._by_hash.get(b.hash) == block_id:
                del self._by_hash[b.hash]
            b.hash, b.token_ids, b.parent = None, (), None
            b.generation += 1
        else:
            del self._free[block_id]
            b = self.blocks[block_id]
        b.ref_count = 1
        return b

    def _cached_prefix(self, token_ids: list[int]) -> tuple[list[int], int | None]:
        """Block ids of the longest cached, computed prefix (never the whole sequence), last hash."""
        if not self.enable_prefix_caching:
            return [], None
        bs = self.block_size
        hits: list[int] = []
        prev = None
        # The last token is always computed, so at most (len - 1) tokens come from the cache.
        for j in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[j * bs : (j + 1) * bs])
            h = chain_hash(prev, chunk)
            bid = self._by_hash.get(h)
            parent = (hits[-1], self.blocks[hits[-1]].generation) if hits else None
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            if self.blocks[bid].parent != parent:  # same tokens after a different prefix
                break
            hits.append(bid)
            prev = h
        return hits, prev

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that ``allocate`` would take from the prefix cache now (no change)."""
        return len(self._cached_prefix(seq.token_ids)[0]) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._cached_prefix(seq.token_ids)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(len(seq)) - in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> bool:
        """Blocks for all of ``seq``'s current tokens, reusing cached prefix blocks. No change on False."""
        assert not seq.block_table, "sequence already holds blocks"
        hits, last_hash = self._cached_prefix(seq.token_ids)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        total = self.blocks_needed(len(seq))
        if total - in_use > self.num_free_blocks:
            return False
        for bid in hits:
            b = self.blocks[bid]
            if b.ref_count == 0:
                self._take_free(bid)
            else:
                b.ref_count += 1
            seq.block_table.append(bid)
        for _ in range(total - len(hits)):
            seq.block_table.append(self._take_free().id)
        cached = len(hits) * self.block_size
        seq.num_cached_tokens = cached
        seq.num_computed_tokens = cached
        seq.num_hashed_blocks, seq.last_block_hash = len(hits), last_hash
        self.queried_tokens += len(seq)
        self.hit_tokens += cached
        return True

    def append_slots(self, seq: Sequence) -> bool:
        """Make the block table cover all of ``seq``'s tokens. False (no change) when out of blocks."""
        need = self.blocks_needed(len(seq)) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free().id)
        return True

    def free(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            assert b.ref_count >= 0, f"block {bid} freed twice"
            if b.ref_count == 0:
                self._free[bid] = None  # most recently freed goes last: LRU reuse
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks, seq.last_block_hash = 0, None

    def mark_computed(self, seq: Sequence) -> None:
        """Enter the newly computed full blocks of ``seq`` in the prefix-cache table."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        prev = seq.last_block_hash
        full = seq.num_computed_tokens // bs
        for j in range(seq.num_hashed_blocks, full):
            b = self.blocks[seq.block_table[j]]
            chunk = tuple(seq.token_ids[j * bs : (j + 1) * bs])
            if b.hash is None:
                b.hash, b.token_ids = chain_hash(prev, chunk), chunk
                if j:
                    pb = self.blocks[seq.block_table[j - 1]]
                    b.parent = (pb.id, pb.generation)
                self._by_hash.setdefault(b.hash, b.id)
            prev = b.hash
        if full > seq.num_hashed_blocks:
            seq.num_hashed_blocks, seq.last_block_hash = full, prev

    def check_consistency(self) -> None:
        """Invariants, for tests: every block is either free or referenced, never both."""
        for b in self.blocks:
            assert (b.ref_count == 0) == (b.id in self._free), f"block {b.id} ref={b.ref_count}"
