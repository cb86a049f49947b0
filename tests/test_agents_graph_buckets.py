"""CUDA-graph buckets fitted to the traffic's batch-size distribution."""

from __future__ import annotations

import itertools

import pytest

from anneal.agents.graph_buckets import (
    batch_size_distribution, expected_padding, fit_graph_buckets, quantile_sizes,
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
