"""The n-gram drafter replayed over greedy outputs (engine/ngram_draft.py) against a brute-force
reference that searches the whole sequence at every step."""

from __future__ import annotations

import random

import pytest

from anneal.engine.ngram_draft import DraftStats, NgramIndex, draft_stats


def _propose_slow(ts: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The drafter by definition: the longest suffix seen before, its latest earlier occurrence,
    and the k tokens after it, continued from the draft itself past the end."""
    for n in range(max_n, min_n - 1, -1):
        if len(ts) <= n:
            continue
        for i in range(len(ts) - n - 1, -1, -1):
            if ts[i:i + n] == ts[-n:]:
                ext = list(ts)
                for t in range(k):
                    ext.append(ext[i + n + t])
                return ext[len(ts):]
    return []


def _stats_slow(prompt: list[int], output: list[int], k: int, min_n: int) -> tuple[int, int, int, int]:
    ctx, j, steps, tokens, drafted, accepted = prompt + output[:1], 1, 0, 0, 0, 0
    while j < len(output):
        d = _propose_slow(ctx, min(k, len(output) - j - 1), min_n=min_n)
        a = 0
        while a < len(d) and d[a] == output[j + a]:
            a += 1
        ctx += output[j:j + a + 1]
        j += a + 1
        steps, tokens, drafted, accepted = steps + 1, tokens + a + 1, drafted + len(d), accepted + a
    return steps, tokens, drafted, accepted


@pytest.mark.parametrize("min_n", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_proposals_match_the_brute_force_drafter(seed, min_n):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12, 40])
    ts = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
    index = NgramIndex(ts[:1], min_n=min_n)
    for i in range(1, len(ts) + 1):
        for k in (1, 3, 6):
            assert index.propose(k) == _propose_slow(ts[:i], k, min_n=min_n), (ts[:i], k)
        if i < len(ts):
            index.extend(ts[i:i + 1])


@pytest.mark.parametrize("min_n", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_replayed_stats_match_the_brute_force_drafter(seed, min_n):
    rng = random.Random(100 + seed)
    vocab = rng.choice([4, 9, 30, 1000])
    pairs = [([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))],
              [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]) for _ in range(5)]
    got = draft_stats(pairs, k=4, min_n=min_n)
    want = [sum(x) for x in zip(*(_stats_slow(p, o, 4, min_n) for p, o in pairs if len(o) >= 2))] or [0, 0, 0, 0]
    assert (got.verify_steps, got.tokens, got.drafted, got.accepted) == tuple(want)
    # every output token after each sequence's first is emitted by exactly one verify step
    assert got.tokens == sum(max(len(o) - 1, 0) for _, o in pairs)


def test_a_loop_is_drafted_whole_and_fresh_tokens_never():
    loop = draft_stats([([7, 8, 9], [1, 2] * 20 + [1])], k=4)  # one token a step until (1, 2) recurs
    assert loop.accepted == loop.drafted == 29 and loop.verify_steps == 11  # 1, 1, 1, 5 x 7, 2 (capped)
    fresh = draft_stats([(list(range(100)), list(range(100, 300)))], k=4)
    assert fresh.drafted == 0 and fresh.tokens_per_step == 1.0 and fresh.verify_steps == 199


def test_a_draft_never_runs_past_the_output():
    stats = draft_stats([([5, 5, 5], [5, 5, 5])], k=8)  # the drafter would propose 8 fives
    assert (stats.verify_steps, stats.tokens, stats.drafted, stats.accepted) == (1, 2, 1, 1)


def test_empty_figures_mean_no_help():
    stats = DraftStats(k=4, max_n=3)
    assert stats.tokens_per_step == 1.0 and stats.drafted_per_step == 0.0
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex([1, 2], max_n=1, min_n=2)


@pytest.mark.parametrize("min_n", [1, 2])
def test_a_long_context_indexed_at_once_proposes_as_one_token_at_a_time(min_n):
    """Prompts are indexed with numpy in one pass (BULK tokens or more), generated tokens one by one:
    the two give the same proposals, on large token ids too."""
    rng = random.Random(7)
    ts = [rng.choice([5, 6, 7, 128_000, 151_935]) for _ in range(400)]
    bulk = NgramIndex(ts[:300], min_n=min_n)
    single = NgramIndex(ts[:1], min_n=min_n)
    for t in ts[1:300]:
        single.extend([t])
    for i in range(300, len(ts)):
        assert bulk.propose(5) == single.propose(5) == _propose_slow(ts[:i], 5, min_n=min_n)
        bulk.extend(ts[i:i + 1])
        single.extend(ts[i:i + 1])
    with pytest.raises(ValueError, match="token ids"):
        bulk.extend([1 << 20])
