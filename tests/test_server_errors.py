"""Bad input, floods and disconnects against a live server: OpenAI-style errors, nothing changed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from live_server import LiveServer, metric_value

MODEL = "random:tiny"
PROMPTS_SEEN = "anneal_request_prompt_tokens_count"
ABORTED = 'anneal_requests_total{finish_reason="abort",status="aborted"}'
REJECTED = 'anneal_requests_total{finish_reason="",status="error"}'


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "2", "--max-waiting", "2", "--max-model-len", "1024",
                   "--num-kv-blocks", "256").wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(autouse=True)
def no_leaks(server):
    yield
    server.assert_no_leaked_blocks()


def post(server, path, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json"}, **kw)


GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_REQUESTS = [
    # (id, path, body, status, param, message fragment)
    ("malformed-json", "/v1/completions", b'{"model": "random:tiny", "prompt": ', 400, None, "not valid JSON"),
    ("invalid-utf8", "/v1/completions", b'{"model": "random:tiny", "prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("lone-surrogate", "/v1/completions", b'{"model": "random:tiny", "prompt": "\\udc80"}', 400, None, "surrogate"),
    ("missing-model", "/v1/completions", {"prompt": "hi"}, 400, "model", "Field required"),
    ("max-tokens-string", "/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("temperature-string", "/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "valid number"),
    ("prompt-number", "/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt", "prompt"),
    ("negative-token-id", "/v1/completions", {**GOOD, "prompt": [1, -2]}, 400, "prompt", "prompt"),
    ("token-id-outside-vocab", "/v1/completions", {**GOOD, "prompt": [1, 512]}, 400, "prompt", "outside the vocabulary"),
    ("empty-prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    ("empty-id-prompt", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", "empty"),
    ("unknown-field", "/v1/completions", {**GOOD, "max_tokenz": 5}, 400, "max_tokenz", "Extra inputs"),
    ("unknown-model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model", "does not exist"),
    ("negative-max-tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 1"),
    ("zero-max-tokens", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("absurd-max-tokens", "/v1/completions", {**GOOD, "max_tokens": 10**12}, 400, "max_tokens", "maximum context length is 1024"),
    ("prompt-too-long", "/v1/completions", {**GOOD, "prompt": [1] * 1024}, 400, "prompt", "maximum context length is 1024"),
    ("prompt-plus-output-too-long", "/v1/completions", {**GOOD, "prompt": [1] * 1000, "max_tokens": 30}, 400, "max_tokens", "Lower max_tokens to at most 24"),
    ("n-2", "/v1/completions", {**GOOD, "n": 2}, 400, "n", "n > 1"),
    ("echo", "/v1/completions", {**GOOD, "echo": True}, 400, "echo", "not supported"),
    ("penalty", "/v1/completions", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("temperature-range", "/v1/completions", {**GOOD, "temperature": 3.0}, 400, "temperature", "less than or equal to 2"),
    ("top-p-zero", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("logprobs-range", "/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("empty-stop", "/v1/completions", {**GOOD, "stop": [""]}, 400, None, "stop strings must not be empty"),
    ("stream-options-without-stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, None, "stream_options"),
    ("empty-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1 item"),
    ("blank-messages", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}]}, 400, "messages", "empty"),
    ("bad-role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    ("image-part", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages", "messages"),
    ("chat-unknown-model", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "does not exist"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, None, "requires logprobs"),
    ("chat-context", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages", "maximum context length"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error_and_changes_nothing(server, case):
    _, path, body, status, param, fragment = case
    before = server.metrics()
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    after = server.metrics()
    assert metric_value(after, PROMPTS_SEEN) == metric_value(before, PROMPTS_SEEN)  # never reached the engine
    assert metric_value(after, REJECTED) == metric_value(before, REJECTED) + 1
    assert post(server, path, GOOD if "chat" not in path else CHAT).status_code == 200  # still serving


def test_unknown_route_and_method_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_the_public_port_serves_no_admin_paths(server):
    for method, path in [("GET", "/admin/state"), ("PUT", "/admin/plan"), ("POST", "/admin/benchmark")]:
        r = httpx.request(method, server.url + path, headers={"Authorization": "Bearer x"})
        assert r.status_code in (404, 405), (path, r.status_code)


def test_the_admin_port_is_closed_without_a_token(server):
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{server.admin_port}/admin/state", timeout=2)


def test_an_oversized_body_is_refused_with_413(server):
    r = post(server, "/v1/completions", b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}')
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_explicit_nulls_mean_defaults(server):
    body = {**GOOD, "temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None,
            "stop": None, "seed": None, "logprobs": None, "presence_penalty": None, "echo": None,
            "max_tokens": None, "prompt": [1] * 1000}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 24  # max_tokens null = the rest of the context


def test_flood_beyond_capacity_gets_429_with_retry_after(server):
    """Capacity is max_num_seqs (2) + max_waiting (2): the rest of a burst is refused, not queued."""
    body = {**GOOD, "prompt": "flood", "max_tokens": 150, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body) for _ in range(16)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 4
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 150
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = metric_value(server.metrics(), ABORTED)
    body = {**GOOD, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            busy = server.health()
            assert busy["num_inflight"] == 1 and busy["kv"]["free_blocks"] < busy["kv"]["num_blocks"]
    t0 = time.monotonic()
    idle = server.wait_idle(timeout=10)
    assert idle["num_inflight"] == 0 and time.monotonic() - t0 < 5
    text = server.metrics()
    assert metric_value(text, ABORTED) == before + 1
    # It was cut short: fewer than 1000 tokens were generated for it.
    assert metric_value(text, 'anneal_request_generation_tokens_bucket{le="512.0"}') >= 1


def test_non_stream_disconnect_aborts(server):
    before = metric_value(server.metrics(), ABORTED)
    body = {**GOOD, "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    server.wait_idle(timeout=10)
    assert metric_value(server.metrics(), ABORTED) == before + 1
