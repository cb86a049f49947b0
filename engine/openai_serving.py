"""The two generation endpoints: validated request -> engine request -> OpenAI response or SSE stream.

``prepare_completion`` / ``prepare_chat`` turn a request into token ids and SamplingParams, and
raise :class:`APIError` for anything the model cannot serve (unknown model, empty prompt, ids
outside the vocabulary, prompt + max_tokens beyond the context). Nothing reaches the engine before
those checks pass. ``complete`` collects a whole response; ``stream`` yields SSE events. Both stop
the engine request as soon as a stop string matched, and abort it if the consumer goes away.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from anneal.engine import openai_protocol as p
from anneal.engine.async_engine import (
    AsyncEngine,
    EngineShuttingDown,
    EngineStepError,
    RequestStream,
)
from anneal.engine.output_stream import Delta, OutputAssembler, TokenInfo
from anneal.engine.sampling_params import SamplingParams
from anneal.engine.tokenizer import Tokenizer, TokenizerError


class APIError(Exception):
    """An error the client sees as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump(mode="json")


@dataclass
class ServingContext:
    """What the endpoints need to know about the loaded model."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int


@dataclass
class Generation:
    """A request ready for the engine, plus how its response must be shaped."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    logprobs: int | None
    return_token_ids: bool
    include_usage: bool
    arrival: float


# ---- preparing requests -----------------------------------------------------------------------


def _check_model(ctx: ServingContext, model: str) -> None:
    if model != ctx.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{ctx.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _completion_prompt_ids(ctx: ServingContext, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"batched prompts are not supported: send one prompt per request ({len(prompt)} given)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        bad = [t for t in ids if t >= ctx.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary (0..{ctx.vocab_size - 1})",
                param="prompt",
            )
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _sampling_params(
    ctx: ServingContext, req: p._SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    room = ctx.max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for output. Shorten the prompt.",
            param="messages" if isinstance(req, p.ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
            f"for the output). Lower max_tokens to at most {room}.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else room,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        seed=None if req.seed is None else req.seed % (2**63),
        stop_token_ids=[] if req.ignore_eos else list(ctx.tokenizer.eos_token_ids),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
    )


def prepare_completion(ctx: ServingContext, req: p.CompletionRequest, arrival: float) -> Generation:
    _check_model(ctx, req.model)
    ids = _completion_prompt_ids(ctx, req.prompt)
    return Generation(
        kind="completion",
        request_id=f"cmpl-{uuid.uuid4().hex}",
        model=req.model,
        prompt_ids=ids,
        params=_sampling_params(ctx, req, len(ids), req.max_tokens, req.logprobs),
        stops=req.stop_strings(),
        logprobs=req.logprobs,
        return_token_ids=bool(req.return_token_ids),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        arrival=arrival,
    )


def prepare_chat(ctx: ServingContext, req: p.ChatCompletionRequest, arrival: float) -> Generation:
    _check_model(ctx, req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    if not any(m["content"] for m in messages):
        raise APIError(400, "all messages are empty", param="messages")
    try:
        ids = ctx.tokenizer.apply_chat_template(messages)
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from e
    top = (req.top_logprobs or 0) if req.logprobs else None
    return Generation(
        kind="chat",
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        model=req.model,
        prompt_ids=ids,
        params=_sampling_params(ctx, req, len(ids), req.output_limit(), top),
        stops=req.stop_strings(),
        logprobs=top,
        return_token_ids=bool(req.return_token_ids),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        arrival=arrival,
    )


# ---- running them -----------------------------------------------------------------------------


async def _start(ctx: ServingContext, gen: Generation) -> RequestStream:
    try:
        return await ctx.engine.add_request(gen.request_id, gen.prompt_ids, gen.params, gen.arrival)
    except ValueError as e:  # the engine's own validation (same rules, last line of defence)
        raise APIError(400, str(e)) from e


async def _deltas(ctx: ServingContext, gen: Generation, stream: RequestStream) -> AsyncIterator[Delta]:
    assembler = OutputAssembler(ctx.tokenizer, gen.prompt_ids, gen.stops, gen.logprobs is not None)
    try:
        async for out in stream:
            delta = assembler.add(out)
            if delta.finished and not out.finished:
                stream.stop()  # a stop string matched: free the engine request now
            yield delta
            if delta.finished:
                return
    finally:
        stream.close()


def _usage(gen: Generation, completion_tokens: int) -> p.UsageInfo:
    n = len(gen.prompt_ids)
    return p.UsageInfo(prompt_tokens=n, completion_tokens=completion_tokens, total_tokens=n + completion_tokens)


def _completion_logprobs(tokens: list[TokenInfo]) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(
        tokens=[t.text for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[dict(t.top) for t in tokens],
        text_offset=[t.text_offset for t in tokens],
    )


def _chat_logprobs(tokens: list[TokenInfo], top_n: int) -> p.ChatLogprobs:
    def entry(text: str, lp: float) -> p.TopLogprob:
        return p.TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

    content = [
        p.ChatTokenLogprob(
            token=t.text,
            logprob=t.logprob if t.logprob is not None else float("-inf"),
            bytes=list(t.text.encode("utf-8")),
            top_logprobs=[entry(s, v) for s, v in t.top[:top_n]],
        )
        for t in tokens
    ]
    return p.ChatLogprobs(content=content)


async def complete(ctx: ServingContext, gen: Generation) -> dict[str, Any]:
    """Run the request to its end; the whole OpenAI response body."""
    stream = await _start(ctx, gen)
    text, ids, tokens, finish = "", [], [], None
    async for delta in _deltas(ctx, gen, stream):
        text += delta.text
        ids += delta.token_ids
        tokens += delta.tokens
        finish = delta.finish_reason
    usage = _usage(gen, len(ids))
    out_ids = ids if gen.return_token_ids else None
    if gen.kind == "completion":
        choice = p.CompletionChoice(
            text=text,
            finish_reason=finish,
            logprobs=_completion_logprobs(tokens) if gen.logprobs is not None else None,
            prompt_token_ids=gen.prompt_ids if gen.return_token_ids else None,
            token_ids=out_ids,
        )
        resp: Any = p.CompletionResponse(id=gen.request_id, model=gen.model, choices=[choice], usage=usage)
    else:
        choice = p.ChatChoice(
            message=p.ChatResponseMessage(content=text),
            finish_reason=finish,
            logprobs=_chat_logprobs(tokens, gen.logprobs) if gen.logprobs is not None else None,
            token_ids=out_ids,
        )
        resp = p.ChatCompletionResponse(
            id=gen.request_id,
            model=gen.model,
            choices=[choice],
            usage=usage,
            prompt_token_ids=gen.prompt_ids if gen.return_token_ids else None,
        )
    return resp.model_dump(mode="json")


def _sse(model: Any) -> str:
    return f"data: {json.dumps(model.model_dump(mode='json'), separators=(',', ':'))}\n\n"


async def start_stream(ctx: ServingContext, gen: Generation) -> RequestStream:
    """Admit the request before any byte of the stream is sent, so refusals are plain errors."""
    return await _start(ctx, gen)


async def stream(ctx: ServingContext, gen: Generation, engine_stream: RequestStream) -> AsyncIterator[str]:
    """SSE events of an admitted request, ending with ``data: [DONE]``."""
    created = int(time.time())
    num_tokens = 0
    first = True
    try:
        if gen.kind == "chat":
            # OpenAI opens a chat stream with the role.
            yield _sse(
                p.ChatCompletionStreamResponse(
                    id=gen.request_id,
                    created=created,
                    model=gen.model,
                    choices=[p.ChatStreamChoice(delta=p.DeltaMessage(role="assistant", content=""))],
                    prompt_token_ids=gen.prompt_ids if gen.return_token_ids else None,
                )
            )
            first = False
        try:
            async for delta in _deltas(ctx, gen, engine_stream):
                # One event per engine output, even when its text is held back (half a UTF-8
                # character, a possible stop string): clients can time every token.
                num_tokens += len(delta.token_ids)
                yield _sse(_chunk(gen, delta, created, first))
                first = False
        except (EngineStepError, EngineShuttingDown) as e:
            # The status line is long gone: say what happened in the stream, as vLLM does.
            err = APIError(503 if isinstance(e, EngineShuttingDown) else 500, str(e), type="server_error")
            yield f"data: {json.dumps(err.body(), separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"
            return
        if gen.include_usage:
            usage = _usage(gen, num_tokens)
            cls = p.CompletionStreamResponse if gen.kind == "completion" else p.ChatCompletionStreamResponse
            yield _sse(cls(id=gen.request_id, created=created, model=gen.model, choices=[], usage=usage))
        yield "data: [DONE]\n\n"
    finally:
        engine_stream.close()


def _chunk(gen: Generation, delta: Delta, created: int, first: bool) -> Any:
    ids = delta.token_ids if gen.return_token_ids else None
    if gen.kind == "completion":
        choice = p.CompletionChoice(
            text=delta.text,
            finish_reason=delta.finish_reason,
            logprobs=_completion_logprobs(delta.tokens) if gen.logprobs is not None else None,
            prompt_token_ids=gen.prompt_ids if gen.return_token_ids and first else None,
            token_ids=ids,
        )
        return p.CompletionStreamResponse(id=gen.request_id, created=created, model=gen.model, choices=[choice])
    choice = p.ChatStreamChoice(
        delta=p.DeltaMessage(content=delta.text),
        finish_reason=delta.finish_reason,
        logprobs=_chat_logprobs(delta.tokens, gen.logprobs) if gen.logprobs is not None else None,
        token_ids=ids,
    )
    return p.ChatCompletionStreamResponse(id=gen.request_id, created=created, model=gen.model, choices=[choice])
