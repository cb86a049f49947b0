"""TrafficShape, presets, loading, and the synthetic workload generator (torch-free)."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys

import pytest

from anneal.engine.traffic import (
    PRESET_NAMES,
    LengthHistogram,
    PrefixSharing,
    TrafficShape,
    TrafficShapeError,
    dump_traffic,
    load_traffic,
    preset,
)
from anneal.engine.workload import RESERVED_LOW, make_workload


def test_presets_are_valid_and_match_their_descriptions():
    shapes = {name: load_traffic(name) for name in PRESET_NAMES}
    assert set(shapes) == {"chat", "rag", "agentic", "batch"}
    for name, s in shapes.items():
        assert s.name == name
        assert TrafficShape.model_validate(s.model_dump()) == s
    chat, rag, agentic, batch = (shapes[n] for n in ("chat", "rag", "agentic", "batch"))
    assert 100 <= chat.prompt_len.quantile(0.5) <= 1024
    assert 100 <= chat.output_len.quantile(0.5) <= 500
    assert 2048 <= rag.prompt_len.quantile(0.05) and rag.prompt_len.quantile(0.95) <= 8192
    assert rag.output_len.mean() < chat.output_len.mean()
    assert 4096 <= agentic.prompt_len.quantile(0.01) and agentic.prompt_len.max_len < 32768
    assert 0.7 <= agentic.prefix.ratio <= 0.9
    assert batch.output_len.mean() > chat.output_len.mean() * 3
    assert batch.concurrency >= 64 and batch.concurrency > chat.concurrency
    # presets are copies: nothing a caller does leaks into the next load
    assert load_traffic("chat") is not load_traffic("chat")


def test_histogram_mean_quantile_and_sampling_agree():
    h = LengthHistogram(edges=[10, 20, 40], weights=[3, 1])
    assert h.mean() == pytest.approx(0.75 * 14.5 + 0.25 * 29.5)
    assert h.quantile(0.0) == 10 and h.quantile(1.0) == 40
    assert h.quantile(0.375) == pytest.approx(15.0)
    assert h.cdf(h.quantile(0.9)) == pytest.approx(0.9)
    rng = random.Random(0)
    xs = [h.sample(rng) for _ in range(20000)]
    assert min(xs) >= 10 and max(xs) <= 39
    assert statistics.mean(xs) == pytest.approx(h.mean(), rel=0.02)
    assert sum(x < 20 for x in xs) / len(xs) == pytest.approx(0.75, abs=0.02)


@pytest.mark.parametrize(
    "edges, weights, message",
    [
        ([10, 5], [1], "strictly increasing"),
        ([0, 5], [1], "edges[0] must be >= 1"),
        ([1, 5, 9], [1], "weights has 1 values but edges define 2 buckets"),
        ([1, 5], [-1], "weights[0]=-1"),
        ([1, 5, 9], [0, 0], "must not all be zero"),
    ],
)
def test_bad_histograms_say_what_is_wrong(edges, weights, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LengthHistogram(edges=edges, weights=weights)


def test_from_cumulative_reads_prometheus_buckets():
    # le=2 holds length 2 (le=1 held length 1: empty, dropped), le=4 holds 3-4, le=8 holds 5-8;
    # +Inf closes at 2x the last finite edge
    h = LengthHistogram.from_cumulative([(1, 0), (2, 5), (4, 5), (8, 9), (float("inf"), 10)])
    assert h.edges == [2, 3, 5, 9, 16]
    assert h.weights == [5, 0, 4, 1]
    # extrapolated increase() values may dip: counts are made monotone, never negative
    h = LengthHistogram.from_cumulative([(4, 3.2), (8, 3.1), (16, 6.0)])
    assert h.weights == [3.2, 0.0, pytest.approx(2.8)]
    assert LengthHistogram.from_cumulative([(4, 0), (float("inf"), 0)]) is None
    assert LengthHistogram.from_cumulative([]) is None


def test_clamp_and_scale_fit_a_context():
    chat = preset("chat")
    clamped = chat.clamped(512)
    assert clamped.prompt_len.max_len == 511
    # the mass above 511 now sits exactly at 511; mass below is untouched
    assert clamped.prompt_len.cdf(510.999) == pytest.approx(chat.prompt_len.cdf(511))
    assert clamped.output_len.max_len <= 512 - chat.prompt_len.edges[0]
    agentic = preset("agentic")
    small = agentic.scaled(2048)
    assert small.max_total_len <= 2048
    # scaling keeps the relative shape: agentic stays far longer than chat on the same model
    assert small.prompt_len.mean() > 2 * chat.scaled(2048).prompt_len.mean()
    assert small.prompt_len.quantile(0.5) / small.prompt_len.quantile(0.1) == pytest.approx(
        agentic.prompt_len.quantile(0.5) / agentic.prompt_len.quantile(0.1), rel=0.05
    )
    assert chat.scaled(1 << 20) is chat  # already fits: unchanged


def test_yaml_and_json_round_trip(tmp_path):
    for name in PRESET_NAMES:
        for suffix in (".yaml", ".json"):
            path = tmp_path / f"{name}{suffix}"
            dump_traffic(preset(name), path)
            assert load_traffic(str(path)) == preset(name)


def test_hand_written_yaml_loads(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text(
        "name: support-bot\n"
        "prompt_len: {edges: [200, 400, 800], weights: [2, 1]}\n"
        "output_len: {edges: [50, 150], weights: [1]}\n"
        "arrival_rate: 3\n"
        "prefix: {ratio: 0.5, num_prefixes: 2}\n"
    )
    s = load_traffic(path)
    assert s.arrival_rate == 3 and s.concurrency is None and s.prefix.ratio == 0.5


def test_a_file_can_start_from_a_preset(tmp_path):
    path = tmp_path / "busy-agents.yaml"
    path.write_text("preset: agentic\nname: busy-agents\nconcurrency: 32\nprefix: {ratio: 0.9}\n")
    s = load_traffic(path)
    agentic = preset("agentic")
    assert s.name == "busy-agents" and s.concurrency == 32 and s.prompt_len == agentic.prompt_len
    assert s.prefix.ratio == 0.9 and s.prefix.num_prefixes == agentic.prefix.num_prefixes
    path.write_text("preset: agentik\n")
    with pytest.raises(TrafficShapeError, match="preset: unknown preset 'agentik'"):
        load_traffic(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("prompt_len: [1, 2\n", "not valid YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
        (
            "prompt_len: {edges: [200, 100], weights: [1]}\noutput_len: {edges: [1, 9], weights: [1]}\n"
            "concurrency: 4\n",
            "prompt_len: .*strictly increasing",
        ),
        (
            "prompt_len: {edges: [1, 9], weights: [1]}\noutput_len: {edges: [1, 9], weights: [1]}\n",
            "give concurrency .* or arrival_rate",
        ),
        (
            "prompt_len: {edges: [1, 9], weights: [1]}\noutput_len: {edges: [1, 9], weights: [1]}\n"
            "concurrency: 4\nprefix: {ratio: 1.5}\n",
            "prefix.ratio: ",
        ),
        (
            "prompt_lenn: {edges: [1, 9], weights: [1]}\noutput_len: {edges: [1, 9], weights: [1]}\n"
            "concurrency: 4\n",
            "prompt_lenn: Extra inputs are not permitted",
        ),
    ],
)
def test_bad_files_give_field_level_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(TrafficShapeError, match=message) as info:
        load_traffic(str(path))
    assert str(path) in str(info.value)


def test_unknown_spec_lists_the_presets(tmp_path):
    with pytest.raises(TrafficShapeError, match="neither a preset .*chat, rag, agentic, batch.* nor an existing file"):
        load_traffic("chatty")
    bad_json = tmp_path / "t.json"
    bad_json.write_text("{'single': 'quotes'}")
    with pytest.raises(TrafficShapeError, match="not valid JSON"):
        load_traffic(bad_json)


def test_bench_pairs_are_representative():
    pairs = preset("rag").to_bench_pairs()
    assert len(pairs) == 3
    isl = [p[0] for p in pairs]
    assert isl == sorted(isl) and 2048 <= isl[0] and isl[-1] < 8192


def test_workload_is_seeded_and_deterministic():
    shape = preset("chat")
    a = make_workload(shape, 50, seed=7)
    b = make_workload(shape, 50, seed=7)
    c = make_workload(shape, 50, seed=8)
    assert a == b
    assert a.prompt_lens() != c.prompt_lens()
    # also across processes (no dependence on hash randomization)
    code = (
        "from anneal.engine.traffic import preset, make_workload;"
        "w = make_workload(preset('chat'), 50, seed=7);"
        "print(sum(sum(r.prompt_token_ids) for r in w.requests), sum(w.output_lens()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    expect = f"{sum(sum(r.prompt_token_ids) for r in a.requests)} {sum(a.output_lens())}"
    assert out.strip() == expect


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_workload_matches_the_shape(name):
    shape = preset(name)
    n = 400 if name != "agentic" else 150
    w = make_workload(shape, n, seed=3, vocab_size=50000)
    # lengths: bucket frequencies follow the weights (binomial tolerance), means agree
    for hist, lens in ((shape.prompt_len, w.prompt_lens()), (shape.output_len, w.output_lens())):
        got = LengthHistogram.from_samples(lens, hist.edges).probabilities()
        for p, q in zip(hist.probabilities(), got):
            assert abs(p - q) <= 4 * (p * (1 - p) / n) ** 0.5 + 1e-9
        assert statistics.mean(lens) == pytest.approx(hist.mean(), rel=0.1)
    # prefix sharing, measured on the token ids alone
    assert w.prefix_hit_ratio() == pytest.approx(shape.prefix.ratio, abs=0.02)
    assert w.prefix_hit_ratio(block_size=16) == pytest.approx(shape.prefix.ratio, abs=0.04)
    # arrivals: Poisson at the shape's rate, or a closed loop at its concurrency
    if shape.arrival_rate:
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(w.requests, w.requests[1:])]
        assert w.arrival == "poisson"
        assert 1 / statistics.mean(gaps) == pytest.approx(shape.arrival_rate, rel=0.25)
    else:
        assert w.arrival == "closed_loop" and w.concurrency == round(shape.concurrency)
    ids = [t for r in w.requests for t in r.prompt_token_ids]
    assert min(ids) >= RESERVED_LOW and max(ids) < 50000


def test_no_sharing_means_no_hits_and_ids_avoid_reserved():
    shape = preset("chat").model_copy(update={"prefix": PrefixSharing(ratio=0.0, num_prefixes=1)})
    w = make_workload(shape, 200, seed=1, vocab_size=1000, low=3, reserved={5, 6, 7})
    assert w.prefix_hit_ratio() < 0.01
    ids = {t for r in w.requests for t in r.prompt_token_ids}
    assert min(ids) == 3 and not ids & {5, 6, 7} and max(ids) <= 999


def test_high_prefix_reuse_shares_identical_leading_ids():
    shape = preset("agentic").scaled(4096)
    w = make_workload(shape, 300, seed=2)
    groups: dict[int, list] = {}
    for r in w.requests:
        if r.prefix_group is not None:
            groups.setdefault(r.prefix_group, []).append(r)
    g = max(groups.values(), key=len)
    k = min(r.shared_len for r in g)
    assert k > 0 and len({tuple(r.prompt_token_ids[:k]) for r in g}) == 1
    assert w.prefix_hit_ratio() == pytest.approx(0.8, abs=0.02)
    # too few requests per prefix: the first, cold request of each of the 16 prefixes caps what
    # can be shared, and the workload says so rather than pretending
    few = make_workload(shape, 40, seed=2)
    assert few.prefix_hit_ratio() < 0.75


@pytest.mark.parametrize("name, max_model_len", [("agentic", 4096), ("chat", 1024)])
def test_max_model_len_is_respected(name, max_model_len):
    w = make_workload(preset(name), 200, seed=0, max_model_len=max_model_len)
    totals = [len(r.prompt_token_ids) + r.max_tokens for r in w.requests]
    assert max(totals) <= max_model_len and min(w.output_lens()) >= 1
    assert max(totals) == max_model_len  # long requests are trimmed to fit, not dropped


def test_workload_serializes_for_the_admin_api():
    w = make_workload(preset("rag").scaled(512), 5, seed=0)
    again = type(w).model_validate(json.loads(w.model_dump_json()))
    assert again == w


def test_tiny_contexts_still_give_valid_shapes():
    for name in PRESET_NAMES:
        small = preset(name).scaled(64)
        assert small.max_total_len <= 64
        w = make_workload(small, 20, seed=0, max_model_len=64)
        assert all(len(r.prompt_token_ids) + r.max_tokens <= 64 for r in w.requests)


def test_schemas_and_clients_import_without_torch():
    code = (
        "import sys; import anneal.engine.traffic, anneal.engine.workload, "
        "anneal.operator.traffic_reader, anneal.operator.drift; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
