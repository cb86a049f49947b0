"""Block manager: block accounting and prefix caching, pure Python.

The randomized test drives allocate / compute / append / free in a seeded random order and keeps a
shadow of what each cache slot *holds* (the exact token prefix whose KV was written there). Every
prefix-cache hit must point at slots holding exactly the hitting sequence's own prefix: that is the
property that matters (wrong reuse = wrong output), checked even when every hash collides.
"""

from __future__ import annotations

import random

import pytest

import anneal.engine.block_manager as bm_mod
from anneal.engine.block_manager import BlockManager
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.sequence import Sequence

PARAMS = SamplingParams()


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), PARAMS, seed=1)


def rand_tokens(rng: random.Random, n: int, alphabet: int = 500) -> list[int]:
    return [rng.randrange(1, alphabet) for _ in range(n)]


def compute(m: BlockManager, s: Sequence, n: int | None = None) -> None:
    """What the engine does after a step: the next ``n`` tokens' KV is written, blocks hashed."""
    s.num_computed_tokens += len(s) - s.num_computed_tokens if n is None else n
    m.mark_computed(s)


def snapshot(m: BlockManager, *seqs: Sequence):
    return (
        list(m._free),
        [(b.ref_count, b.hash, b.token_ids, getattr(b, "parent", None), getattr(b, "generation", 0))
         for b in m.blocks],
        dict(m._by_hash),
        m.queried_tokens,
        m.hit_tokens,
        [(list(s.block_table), s.num_computed_tokens, s.num_cached_tokens, s.num_hashed_blocks,
          s.last_block_hash, list(s.token_ids)) for s in seqs],
    )


def check_accounting(m: BlockManager, live: list[Sequence]) -> None:
    m.check_consistency()
    refs = [0] * m.num_blocks
    for s in live:
        assert len(s.block_table) == m.blocks_needed(len(s)), s.request_id
        for b in s.block_table:
            refs[b] += 1
        for j in range(s.num_hashed_blocks):  # hashed blocks hold exactly this sequence's tokens
            blk = m.blocks[s.block_table[j]]
            assert blk.token_ids == tuple(s.token_ids[j * m.block_size : (j + 1) * m.block_size])
    assert [b.ref_count for b in m.blocks] == refs
    assert m.num_free_blocks == refs.count(0)
    for h, bid in m._by_hash.items():
        assert m.blocks[bid].hash == h
    assert 0 <= m.hit_tokens <= m.queried_tokens


# ---- randomized property test ----------------------------------------------------------------


def run_random_ops(seed: int, block_size: int, num_blocks: int, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    m = BlockManager(num_blocks, block_size)
    # slot -> the token prefix whose last token's KV was written there (the shadow KV cache)
    kv: dict[int, tuple[int, ...]] = {}
    bases = [rand_tokens(rng, rng.randrange(block_size, 5 * block_size), alphabet=4) for _ in range(3)]
    live: list[Sequence] = []
    counts = dict(allocated=0, refused=0, hit_tokens=0, appended=0, append_refused=0, freed=0)

    def slot(s: Sequence, p: int) -> int:
        return s.block_table[p // block_size] * block_size + p % block_size

    for i in range(steps):
        op = rng.random()
        if op < 0.3 or not live:
            base = rng.choice(bases)
            toks = base[: rng.randrange(1, len(base) + 1)] + rand_tokens(rng, rng.randrange(0, 2 * block_size), 4)
            s = seq(f"s{i}", toks)
            before = snapshot(m, s)
            if m.allocate(s):
                counts["allocated"] += 1
                counts["hit_tokens"] += s.num_cached_tokens
                assert s.num_cached_tokens < len(s), "the last token is always computed"
                assert s.num_cached_tokens % block_size == 0
                for p in range(s.num_cached_tokens):  # every hit slot holds *this* prefix
                    assert kv.get(slot(s, p)) == tuple(s.token_ids[: p + 1]), (i, p)
                live.append(s)
            else:
                counts["refused"] += 1
                assert snapshot(m, s) == before, "allocate returned False but changed state"
        elif op < 0.65:
            s = rng.choice(live)
            if s.num_computed_tokens < len(s):
                left = len(s) - s.num_computed_tokens
                n = left if rng.random() < 0.5 else rng.randrange(1, left + 1)
                for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                    blk = m.blocks[s.block_table[p // block_size]]
                    assert blk.ref_count == 1 and blk.hash is None, "a shared/cached block was written"
                    kv[slot(s, p)] = tuple(s.token_ids[: p + 1])
                compute(m, s, n)
            else:  # decode: one more token
                s.token_ids.append(rng.randrange(1, 4))
                before = snapshot(m)
                if m.append_slots(s):
                    counts["appended"] += 1
                else:
                    counts["append_refused"] += 1
                    assert snapshot(m) == before
                    s.token_ids.pop()
        else:
            s = live.pop(rng.randrange(len(live)))
            m.free(s)
            counts["freed"] += 1
            assert s.block_table == [] and s.num_computed_tokens == 0
        check_accounting(m, live)
    for s in live:
        m.free(s)
    check_accounting(m, [])
    assert m.num_free_blocks == num_blocks
    return counts


@pytest.mark.parametrize("seed", [11, 29, 47])
@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_random_operations_keep_accounting_and_never_reuse_wrong_kv(seed, block_size):
    counts = run_random_ops(seed * 7 + block_size, block_size, num_blocks=20, steps=700)
    # Not vacuous: the random walk exercised hits, refusals and frees.
    assert counts["hit_tokens"] > 0, counts
    assert counts["refused"] > 0, counts
    assert counts["freed"] > 20 and counts["appended"] > 20, counts


@pytest.mark.parametrize("fake_hash", ["constant", "three_values"])
def test_random_operations_with_colliding_hashes_never_reuse_wrong_kv(monkeypatch, fake_hash):
    """Every chained hash collides: hits must still only ever serve the exact same prefix."""
    fake = {
        "constant": lambda prev, toks: 12345,
        "three_values": lambda prev, toks: sum(toks) % 3,
    }[fake_hash]
    monkeypatch.setattr(bm_mod, "chain_hash", fake)
    counts = run_random_ops(5, block_size=2, num_blocks=24, steps=700)
    assert counts["hit_tokens"] > 0, counts


# ---- targeted rules ----------------------------------------------------------------------------


def test_allocate_and_free_accounting():
    rng = random.Random(3)
    m = BlockManager(10, 4)
    a = seq("a", rand_tokens(rng, 9))  # 3 blocks
    b = seq("b", rand_tokens(rng, 4))  # 1 block
    assert m.allocate(a) and m.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert m.num_free_blocks == 6
    assert not set(a.block_table) & set(b.block_table)
    check_accounting(m, [a, b])
    m.free(a)
    assert m.num_free_blocks == 9 and a.block_table == []
    m.free(b)
    assert m.num_free_blocks == 10
    check_accounting(m, [])


def test_allocate_that_does_not_fit_changes_nothing():
    rng = random.Random(4)
    m = BlockManager(6, 4)
    prompt = rand_tokens(rng, 12)
    a = seq("a", prompt + [7])
    assert m.allocate(a)
    compute(m, a)
    free_before = m.num_free_blocks  # 2 left
    # Shares 3 cached blocks (in use, so free to share) but needs 3 fresh ones: does not fit.
    big = seq("big", prompt + rand_tokens(rng, 10))
    before = snapshot(m, a, big)
    assert not m.allocate(big)
    assert snapshot(m, a, big) == before
    assert m.num_free_blocks == free_before
    # One that fits thanks to sharing: 3 shared + 1 fresh.
    fits = seq("fits", prompt + rand_tokens(rng, 3))
    assert m.allocate(fits)
    assert fits.block_table[:3] == a.block_table[:3] and m.num_free_blocks == free_before - 1
    m.free(a), m.free(fits)
    assert m.num_free_blocks == 6


def test_prefix_hit_shares_blocks_and_counts_references():
    rng = random.Random(5)
    m = BlockManager(16, 4)
    prefix = rand_tokens(rng, 8)
    a = seq("a", prefix + rand_tokens(rng, 3))
    assert m.allocate(a) and a.num_cached_tokens == 0
    compute(m, a)
    b = seq("b", prefix + rand_tokens(rng, 5))
    assert m.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [m.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    assert m.hit_tokens == 8 and m.queried_tokens == len(a) + len(b)
    check_accounting(m, [a, b])
    m.free(a)
    assert [m.blocks[x].ref_count for x in b.block_table[:2]] == [1, 1]
    check_accounting(m, [b])
    m.free(b)
    assert m.num_free_blocks == 16


def test_a_different_token_in_an_early_block_breaks_the_chain():
    rng = random.Random(6)
    m = BlockManager(16, 4)
    p = rand_tokens(rng, 12)
    a = seq("a", p + [3])
    assert m.allocate(a)
    compute(m, a)
    q = list(p)
    q[5] = q[5] % 400 + 1 if q[5] % 400 + 1 != q[5] else q[5] + 1  # differ in block 1 only
    b = seq("b", q + [3])
    assert m.allocate(b)
    assert b.num_cached_tokens == 4  # block 0 only: block 2's tokens match but follow a different block 1
    m.free(a), m.free(b)


def test_hash_collision_is_a_miss_not_wrong_reuse(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda prev, toks: 7)
    rng = random.Random(7)
    m = BlockManager(16, 4)
    blk, other = rand_tokens(rng, 4), rand_tokens(rng, 4)
    a = seq("a", blk + [9])
    assert m.allocate(a)
    compute(m, a)
    # Same hash, different tokens: a miss.
    b = seq("b", other + [9])
    assert m.allocate(b) and b.num_cached_tokens == 0
    # Same tokens in block 1, but after a different block 0 (its KV differs): a miss too.
    c = seq("c", blk + blk + [9])
    assert m.allocate(c)
    assert c.num_cached_tokens == 4, c.block_table
    assert len(set(c.block_table)) == 3, "one block used twice in a block table"
    for s in (a, b, c):
        m.free(s)
    assert m.num_free_blocks == 16
    check_accounting(m, [])


def test_blocks_are_hashed_only_once_computed():
    rng = random.Random(8)
    m = BlockManager(16, 4)
    prompt = rand_tokens(rng, 12)
    a = seq("a", prompt + [1])
    assert m.allocate(a)
    # a's prefill has not run: another request with the same prompt must not hit.
    b = seq("b", prompt + [2])
    assert m.allocate(b) and b.num_cached_tokens == 0
    # a computed one chunk (6 tokens = 1 full block): only that block can be hit.
    compute(m, a, 6)
    c = seq("c", prompt + [3])
    assert m.allocate(c) and c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    compute(m, a)
    d = seq("d", prompt + [4])
    assert m.allocate(d) and d.num_cached_tokens == 12
    for s in (a, b, c, d):
        m.free(s)
    assert m.num_free_blocks == 16


def test_whole_prompt_hit_leaves_the_last_block_to_compute():
    rng = random.Random(9)
    m = BlockManager(16, 4)
    prompt = rand_tokens(rng, 8)  # exactly two full blocks
    a = seq("a", prompt)
    assert m.allocate(a)
    compute(m, a)
    b = seq("b", prompt)
    assert m.allocate(b)
    assert b.num_cached_tokens == 4, "the last token must be computed, so its block is not shared"
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert m.blocks[b.block_table[1]].ref_count == 1
    # One token past two full blocks: both blocks hit, one token left.
    c = seq("c", prompt + [5])
    assert m.allocate(c) and c.num_cached_tokens == 8
    assert len(c) - c.num_computed_tokens == 1
    for s in (a, b, c):
        m.free(s)
    assert m.num_free_blocks == 16


def test_freed_blocks_keep_their_hash_and_are_reused_lru():
    rng = random.Random(10)
    m = BlockManager(6, 4)
    prompt = rand_tokens(rng, 8)
    a = seq("a", prompt + [1])
    assert m.allocate(a)
    compute(m, a)
    cached = a.block_table[:2]
    m.free(a)
    assert m.num_free_blocks == 6
    # Still cached after the free.
    b = seq("b", prompt + [2])
    assert m.allocate(b) and b.num_cached_tokens == 8 and b.block_table[:2] == cached
    m.free(b)
    # LRU: the least recently freed blocks go first. b freed [tail, cached1, cached0] in that
    # order after the never-used blocks, so the never-used ones (3 of them) are taken first.
    order = list(m._free)
    f = seq("f", rand_tokens(rng, 12))  # 3 blocks
    assert m.allocate(f)
    assert f.block_table == order[:3]
    assert not set(f.block_table) & set(cached)
    g = seq("g", prompt + [3])
    assert m.allocate(g) and g.num_cached_tokens == 8, "cached blocks evicted too early"
    m.free(f), m.free(g)
    # Fill every block with new content: the cached ones get reallocated and lose their hash.
    h = seq("h", rand_tokens(rng, 24))
    assert m.allocate(h) and sorted(h.block_table) == list(range(6))
    assert all(m.blocks[x].hash is None for x in h.block_table)
    m.free(h)
    k = seq("k", prompt + [4])
    assert m.allocate(k) and k.num_cached_tokens == 0
    m.free(k)
    check_accounting(m, [])


def test_prefix_caching_off_never_hits():
    rng = random.Random(12)
    m = BlockManager(16, 4, enable_prefix_caching=False)
    prompt = rand_tokens(rng, 12)
    a = seq("a", prompt + [1])
    assert m.allocate(a)
    compute(m, a)
    b = seq("b", prompt + [1])
    assert m.allocate(b) and b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    assert m.hit_tokens == 0
    m.free(a), m.free(b)
    assert m.num_free_blocks == 16


def test_append_slots_grows_by_one_block_at_the_boundary_and_refuses_without_change():
    rng = random.Random(13)
    m = BlockManager(3, 4)
    a = seq("a", rand_tokens(rng, 8))
    assert m.allocate(a)
    compute(m, a)
    a.token_ids.append(5)
    assert m.append_slots(a) and len(a.block_table) == 3
    for _ in range(3):  # fills block 2: no new block needed
        a.token_ids.append(6)
        assert m.append_slots(a) and len(a.block_table) == 3
    a.token_ids.append(7)  # needs a 4th block: none left
    before = snapshot(m, a)
    assert not m.append_slots(a)
    assert snapshot(m, a) == before
    m.free(a)
    assert m.num_free_blocks == 3


def test_double_free_is_caught():
    m = BlockManager(4, 2)
    a = seq("a", [5, 6, 7])
    assert m.allocate(a)
    table = list(a.block_table)
    m.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        m.free(a)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(8, 0)
