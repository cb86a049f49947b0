"""The OpenAI API of a live `anneal serve` process, driven by the real `openai` client."""

from __future__ import annotations

import openai
import pytest

from anneal.engine.tokenizer import ByteTokenizer
from live_server import LiveServer

MODEL = "random:tiny"
BYTES = ByteTokenizer(512, eos_token_ids=[257])


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "4", "--max-waiting", "4", "--max-model-len", "1024",
                   "--num-kv-blocks", "512").wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(autouse=True)
def no_leaks(server):
    yield
    server.assert_no_leaked_blocks()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def complete(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("prompt", "Hello, world")
    return client.completions.create(**kw)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health_reports_a_full_kv_cache_at_rest(server):
    h = server.health()
    assert h["status"] == "ok" and h["kv"]["num_blocks"] == 512 and h["capacity"] == 8


def test_completion_counts_tokens_and_stops_at_max_tokens(client):
    r = complete(client, max_tokens=12, seed=1, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len("Hello, world".encode())
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == list(b"Hello, world")
    assert len(extra["token_ids"]) == 12
    assert choice.text == BYTES.decode(extra["token_ids"])


def test_seeds_reproduce_and_differ(client):
    a = complete(client, max_tokens=16, seed=7, temperature=1.0).choices[0].text
    b = complete(client, max_tokens=16, seed=7, temperature=1.0).choices[0].text
    c = complete(client, max_tokens=16, seed=8, temperature=1.0).choices[0].text
    assert a == b
    assert a != c


def test_greedy_is_deterministic_without_a_seed(client):
    a = complete(client, max_tokens=10, temperature=0).choices[0].text
    b = complete(client, max_tokens=10, temperature=0).choices[0].text
    assert a == b


def test_stream_equals_the_whole_response(client):
    kw = dict(max_tokens=20, seed=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = complete(client, **kw)
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert "".join(texts) == whole.choices[0].text
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == list(b"Hello, world")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_prompt_as_token_ids_and_one_element_lists(client):
    ids = list(b"abc")
    outs = [
        complete(client, prompt=p, max_tokens=5, seed=2, extra_body={"return_token_ids": True})
        for p in (ids, [ids], "abc", ["abc"])
    ]
    assert {o.choices[0].text for o in outs} == {outs[0].choices[0].text}
    assert all(o.choices[0].model_extra["prompt_token_ids"] == ids for o in outs)


def test_batched_prompts_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="batched prompts"):
        complete(client, prompt=["a", "b"])


def test_n_above_one_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError, match="n > 1 is not supported") as e:
        complete(client, n=2)
    assert e.value.body["param"] == "n"


def test_stop_strings_cut_the_text(client):
    kw = dict(max_tokens=80, seed=11, extra_body={"ignore_eos": True})
    full = complete(client, **kw).choices[0].text
    # A stop string from the middle of the output that contains no replacement character.
    start = next(i for i in range(10, len(full) - 3) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    expected = full[: full.index(stop)]
    cut = complete(client, stop=[stop, "never-generated-\x00"], **kw)
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(complete(client, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = complete(client, max_tokens=6, seed=5, logprobs=3, extra_body={"return_token_ids": True})
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for token_id, token, logprob, top in zip(r.choices[0].model_extra["token_ids"], lp.tokens,
                                              lp.token_logprobs, lp.top_logprobs):
        assert token == BYTES.token_text(token_id)
        assert logprob <= 0.0 and top[token] == pytest.approx(logprob)
        assert 3 <= len(top) <= 4 and max(top.values()) <= 0.0


def test_chat_completion_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=15, seed=4,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    prompt = BYTES.apply_chat_template(messages)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 15
    assert r.model_extra["prompt_token_ids"] == prompt
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_max_completion_tokens_and_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_completion_tokens=4, logprobs=True, top_logprobs=2, seed=1, extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert r.usage.completion_tokens == len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_metrics_follow_the_traffic(server, client):
    from anneal.engine import metric_names as names
    from live_server import metric_value

    before = server.metrics()
    prompt = list(range(1, 65))  # four full 16-token blocks, sent twice: the second run hits the cache
    for _ in range(2):
        complete(client, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    server.wait_idle()
    after = server.metrics()
    delta = lambda series: metric_value(after, series) - metric_value(before, series)  # noqa: E731
    assert delta(names.PROMPT_TOKENS + "_count") == 2
    assert delta(names.PROMPT_TOKENS + "_sum") == 128
    assert delta(names.GENERATION_TOKENS + "_sum") == 6
    assert delta(names.PROMPT_TOKENS_TOTAL + "_total") == 128
    assert delta(names.GENERATION_TOKENS_TOTAL + "_total") == 6
    assert delta(names.TTFT + "_count") == 2
    assert delta(names.ITL + "_count") == 4  # 3 tokens each: two gaps per request
    assert delta(names.REQUEST_LATENCY + "_count") == 2
    assert delta(names.BATCH_SIZE + "_count") >= 2
    assert delta(names.PREFIX_QUERIED + "_total") >= 64
    assert delta(names.PREFIX_HIT + "_total") >= 48
    assert delta('anneal_requests_total{finish_reason="length",status="success"}') == 2
    health = server.health()
    assert metric_value(after, names.KV_FREE_BLOCKS) == health["kv"]["free_blocks"]
    assert metric_value(after, f'{names.PLAN_INFO}{{plan_hash="{health["plan_hash"]}"}}') == 1
    assert metric_value(after, names.NUM_RUNNING) == metric_value(after, names.NUM_WAITING) == 0
