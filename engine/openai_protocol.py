"""The OpenAI-compatible wire types: every request and response body the public API speaks.

Requests are validated strictly (``strict=True``, unknown fields forbidden), so ``"max_tokens":
"5"`` or a misspelt field is a 400 that names the parameter, never a silent coercion. Ranges that
depend on the loaded model (context length) are checked by the server, not here.

Extensions beyond OpenAI, as in vLLM: ``top_k``, ``ignore_eos``, and ``return_token_ids`` (adds
``prompt_token_ids`` and each choice's ``token_ids`` to the response; in a stream the first chunk
carries ``prompt_token_ids`` and every chunk its new ``token_ids``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


class UnsupportedParam(ValueError):
    """A valid OpenAI parameter this server does not implement (a 400 naming ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _omit_none(value: Any) -> bool:
    return value is None


OptionalExt = Field(None, exclude_if=_omit_none)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors and models ------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "anneal"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- shared request fields --------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


TokenIds = list[Annotated[int, Field(ge=0)]]


class _SamplingFields(_Request):
    """Fields both endpoints share."""

    model: str
    # ``null`` means the default for the sampling knobs (some clients send every field).
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(0, ge=-1, description="0 or -1 = off (vLLM extension)")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int | None = Field(1, ge=1, description="only n=1 is served")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, description="not supported: only 0")
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, description="not supported: only 0")
    user: str | None = None
    ignore_eos: bool | None = False
    return_token_ids: bool | None = False

    @model_validator(mode="after")
    def _check_stop(self) -> "_SamplingFields":
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.n not in (None, 1):
            raise UnsupportedParam("n", "n > 1 is not supported; send n separate requests (with seeds)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise UnsupportedParam(name, f"{name} is not supported; leave it at 0")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ---- /v1/completions --------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1, description="None = up to the context length")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = Field(False, description="not supported")
    best_of: int | None = Field(None, ge=1, description="only 1")
    suffix: str | None = Field(None, description="not supported")

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.echo:
            raise UnsupportedParam("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedParam("best_of", "best_of > 1 is not supported")
        if self.suffix:
            raise UnsupportedParam("suffix", "suffix is not supported")
        return self


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    prompt_token_ids: list[int] | None = OptionalExt
    token_ids: list[int] | None = OptionalExt


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# Streamed chunks have the same shape (OpenAI uses object "text_completion" for both).
CompletionStreamResponse = CompletionResponse


# ---- /v1/chat/completions ---------------------------------------------------------------------


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    token_ids: list[int] | None = OptionalExt


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = OptionalExt


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = OptionalExt
    content: str | None = OptionalExt


class ChatStreamChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    token_ids: list[int] | None = OptionalExt


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = OptionalExt
