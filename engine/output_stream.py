"""From engine outputs to what a client sees: text deltas, token ids, logprobs, finish reason.

One :class:`OutputAssembler` per request. Each engine output goes through incremental
detokenization (no half UTF-8 characters) and the stop-string matcher (no partial stop strings);
the assembler also keeps the token ids and logprobs that belong to the emitted text, and decides
the finish reason (``stop`` when a stop string matched, else the engine's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from anneal.engine.stop_strings import StopStringMatcher
from anneal.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TokenInfo:
    """One generated token as a client sees it in logprobs."""

    token_id: int
    text: str
    logprob: float | None
    top: list[tuple[str, float]]  # best first; the sampled token included
    text_offset: int


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputAssembler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stops: list[str],
        want_logprobs: bool,
    ):
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stops)
        self._want_logprobs = want_logprobs
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, out: Any) -> Delta:
        """Absorb one engine output; after a finish (stop string or engine end) add nothing more."""
        if self.finish_reason is not None:
            return Delta()
        delta = Delta(token_ids=list(out.new_token_ids))
        if self._want_logprobs:
            delta.tokens = self._token_infos(out)
        text = self._stops.feed(self._detok.add(out.new_token_ids))
        if not self._stops.stopped and out.finished:
            text += self._stops.feed(self._detok.flush())
            if not self._stops.stopped:
                text += self._stops.finish()
        self.text += text
        self.token_ids += delta.token_ids
        delta.text = text
        if self._stops.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = out.finish_reason or "stop"
        delta.finish_reason = self.finish_reason
        return delta

    def _token_infos(self, out: Any) -> list[TokenInfo]:
        logprobs = out.new_logprobs or []
        infos = []
        for i, tid in enumerate(out.new_token_ids):
            lp = logprobs[i] if i < len(logprobs) else None
            top: dict[int, float] = dict(lp.top) if lp is not None else {}
            if lp is not None:
                top.setdefault(tid, lp.logprob)
            ranked = sorted(top.items(), key=lambda kv: -kv[1])
            infos.append(
                TokenInfo(
                    token_id=tid,
                    text=self._tok.token_text(tid),
                    logprob=None if lp is None else lp.logprob,
                    top=[(self._tok.token_text(t), v) for t, v in ranked],
                    text_offset=len(self.text),
                )
            )
        return infos
