"""CUDA-graph buckets fitted to the traffic's batch-size distribution."""

from __future__ import annotations

import itertools

import pytest

from anneal.agents.graph_buckets import (
    batch_size_distribution, expected_padding, expected_step_ms, fit_graph_buckets, graph_sizes_to_price,
    quantile_sizes, replayed_distribution,
)


def test_distribution_is_centred_on_concurrency():
    d = batch_size_distribution(16, 256)
    assert sum(d.values()) == pytest.approx(1.0)
    mean = sum(b * p for b, p in d.items())
    assert mean == pytest.approx(16, rel=0.05)
    assert max(d) <= 256 and min(d) >= 1
    assert max(batch_size_distribution(100, 32)) <= 32  # capped by max_num_seqs


def test_fit_is_optimal_for_small_cases_and_beats_powers_of_two():
    d = {1: 0.1, 3: 0.3, 5: 0.2, 6: 0.25, 9: 0.15}
    fit = fit_graph_buckets(d, max_graphs=2)
    assert max(fit) == 9 and len(fit) <= 2
    best = min((list(c) for c in itertools.combinations(sorted(d), 2) if 9 in c),
               key=lambda c: expected_padding(d, c))
    assert expected_padding(d, fit) == pytest.approx(expected_padding(d, best))
    chat = batch_size_distribution(16, 64)
    fitted = fit_graph_buckets(chat, 6)
    assert expected_padding(chat, fitted) < expected_padding(chat, [1, 2, 4, 8, 16, 32, 64])
    assert expected_padding(chat, fit_graph_buckets(chat, 64)) == pytest.approx(1.0)


def test_quantile_sizes():
    d = {1: 0.5, 2: 0.3, 8: 0.2}
    assert quantile_sizes(d, (0.25, 0.5, 0.9)) == [1, 8]


def test_sizes_to_price_are_small_powers_then_multiples_of_8_covering_the_largest_batch():
    assert graph_sizes_to_price(1) == [1]
    assert graph_sizes_to_price(3) == [1, 2, 4]
    assert graph_sizes_to_price(16) == [1, 2, 4, 8, 16]
    assert graph_sizes_to_price(17) == [1, 2, 4, 8, 16, 24]


def _tiled_ms(g: int) -> float:
    """A memory-bound step: a little per row, and a step every 16 rows of the GEMMs' tiles."""
    return 4.6 + 0.03 * g + 0.4 * -(-g // 16)


def test_fit_prices_by_step_time_and_covers_the_drain():
    """Session 10's chat replay: steady at 16 rows, then a drain through every smaller batch.
    Priced by step time over kernel-friendly sizes, the fit keeps a graph for the drain's single
    request and the 16, and is the cheapest subset of those sizes."""
    dist = replayed_distribution({16: 600, **{b: 40 for b in range(1, 16)}})
    assert sum(dist.values()) == pytest.approx(1.0) and max(dist) == 16
    sizes = graph_sizes_to_price(16)
    step = {g: _tiled_ms(g) for g in sizes}
    fit = fit_graph_buckets(dist, 8, sizes=sizes, step_ms=step)
    assert fit[-1] == 16 and fit[0] == 1
    # the optimum over every subset of the priced sizes that covers 16
    subsets = [list(c) + [16] for r in range(0, 5) for c in itertools.combinations(sizes[:-1], r)]
    best = min(expected_step_ms(dist, c, step) for c in subsets)
    assert expected_step_ms(dist, fit, step) == pytest.approx(best)
    # under a flat price (all sizes cost alike up to 16) one graph does: fewest graphs among equals
    assert fit_graph_buckets(dist, 8, sizes=sizes, step_ms={g: 5.0 for g in sizes}) == [16]
    # a batch above every priced size cannot be fitted
    with pytest.raises(ValueError, match="covers batch 16"):
        fit_graph_buckets(dist, 8, sizes=[1, 8], step_ms=step)


def test_expected_step_ms_is_infinite_when_a_batch_has_no_graph():
    assert expected_step_ms({1: 0.5, 9: 0.5}, [1, 8], {1: 1.0, 8: 2.0}) == float("inf")
    assert expected_step_ms({1: 0.5, 9: 0.5}, [1, 16], {1: 1.0, 16: 2.0}) == pytest.approx(1.5)


def test_replayed_distribution_needs_reported_steps():
    assert replayed_distribution(None) is None and replayed_distribution({}) is None
    assert replayed_distribution({"2": 1, "4": 3}) == {2: 0.25, 4: 0.75}
