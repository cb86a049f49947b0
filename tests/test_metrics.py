"""EngineMetrics: the contract names and buckets, per-request and per-step updates."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from anneal.engine import metric_names as names
from anneal.engine.llm import EngineStats
from anneal.engine.metrics import EngineMetrics


def stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_free_blocks=10, num_blocks=10, last_batch_size=0,
                last_num_tokens=0, prefix_queried_tokens=0, prefix_hit_tokens=0, num_preemptions=0, steps=0)
    return EngineStats(**{**base, **kw})


def samples(m: EngineMetrics) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_contract_name_is_exported_with_its_type():
    m = EngineMetrics()
    m.set_plan("abc")
    types = {f.name: f.type for f in text_string_to_metric_families(m.render().decode())}
    for name in (names.PROMPT_TOKENS, names.GENERATION_TOKENS, names.TTFT, names.ITL,
                 names.REQUEST_LATENCY, names.BATCH_SIZE):
        assert types[name] == "histogram", name
    for name in (names.NUM_RUNNING, names.NUM_WAITING, names.KV_FREE_BLOCKS, names.PLAN_INFO):
        assert types[name] == "gauge", name
    for name in (names.PREFIX_QUERIED, names.PREFIX_HIT, names.PROMPT_TOKENS_TOTAL,
                 names.GENERATION_TOKENS_TOTAL, names.REQUESTS, names.SPEC_DRAFTED, names.SPEC_ACCEPTED):
        assert types[name] == "counter", name


def test_token_histograms_use_the_contract_buckets_up_to_128k():
    m = EngineMetrics()
    m.observe_request(prompt_tokens=100_000, generation_tokens=5, latency_s=0.3,
                      finish_reason="length", status="success")
    s = samples(m)
    le = lambda v: (names.PROMPT_TOKENS + "_bucket", (("le", v),))  # noqa: E731
    assert s[le("65536.0")] == 0 and s[le("131072.0")] == 1
    assert {k[1][0][1] for k in s if k[0] == names.PROMPT_TOKENS + "_bucket"} == {
        *(str(b) for b in names.TOKEN_BUCKETS), "+Inf"}
    assert s[(names.PROMPT_TOKENS_TOTAL + "_total", ())] == 100_000
    assert s[(names.REQUESTS + "_total", (("finish_reason", "length"), ("status", "success")))] == 1


def test_plan_info_names_only_the_current_plan():
    m = EngineMetrics()
    m.set_plan("old")
    m.set_plan("new")
    s = samples(m)
    assert s[(names.PLAN_INFO, (("plan_hash", "new"),))] == 1
    assert (names.PLAN_INFO, (("plan_hash", "old"),)) not in s


def test_engine_turns_update_gauges_batch_size_and_prefix_deltas():
    m = EngineMetrics()
    m.observe_engine(stats(num_running=3, num_waiting=2, num_free_blocks=4, last_batch_size=3,
                           prefix_queried_tokens=64, prefix_hit_tokens=32, steps=1), stepped=True)
    m.observe_engine(stats(num_running=1, num_free_blocks=7, last_batch_size=3,
                           prefix_queried_tokens=80, prefix_hit_tokens=32, steps=1), stepped=True)
    m.observe_engine(stats(num_running=1, num_free_blocks=7, last_batch_size=3,
                           prefix_queried_tokens=80, prefix_hit_tokens=32, steps=1), stepped=False)
    s = samples(m)
    assert s[(names.NUM_RUNNING, ())] == 1 and s[(names.NUM_WAITING, ())] == 0
    assert s[(names.KV_FREE_BLOCKS, ())] == 7
    assert s[(names.BATCH_SIZE + "_count", ())] == 1  # only turns whose step ran a batch
    assert s[(names.PREFIX_QUERIED + "_total", ())] == 80  # cumulative engine counters, not summed twice
    assert s[(names.PREFIX_HIT + "_total", ())] == 32


def test_each_server_has_its_own_registry():
    a, b = EngineMetrics(), EngineMetrics()
    a.observe_ttft(0.5)
    assert samples(a)[(names.TTFT + "_count", ())] == 1
    assert samples(b)[(names.TTFT + "_count", ())] == 0


def test_speculative_decoding_counters_add_the_engines_deltas():
    m = EngineMetrics()
    m.observe_engine(stats(drafted_tokens=12, accepted_tokens=5, steps=3), stepped=True)
    m.observe_engine(stats(drafted_tokens=20, accepted_tokens=5, steps=4), stepped=True)
    m.observe_engine(stats(drafted_tokens=20, accepted_tokens=5, steps=4), stepped=False)
    s = samples(m)
    assert s[(names.SPEC_DRAFTED + "_total", ())] == 20 and s[(names.SPEC_ACCEPTED + "_total", ())] == 5
