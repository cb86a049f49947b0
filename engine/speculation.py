"""Speculative decoding with an n-gram drafter: decode steps that also check drafted tokens.

With ``scheduler.speculative_tokens = k``, a decode step of greedy sequences drafts up to ``k`` tokens
for each from its own context (prompt lookup, engine/ngram_draft.py) and runs one varlen pass over
every sequence's last token and its drafts. The model's argmax at each row says how many drafts it
agrees with; the step emits those and the token after them. Greedy verification emits the tokens
plain decoding would (a different kernel path may round a near-tie otherwise), so the knob changes
speed only: up to ``k + 1`` tokens a sequence for a step that reads the weights once.

A step whose sequences draft nothing stays a plain decode step (its CUDA graph), so a traffic whose
outputs never repeat their context pays only the host's lookups. Sampled requests and requests
asking for log-probs are never drafted for (a step holding one does not speculate). The draft's KV
rows past the accepted ones are left in the cache beyond the sequence's length, where the next
steps overwrite them; their slots come from blocks the sequence would fill next anyway.
"""

from __future__ import annotations

from anneal.engine.ngram_draft import NgramIndex
from anneal.engine.sequence import RequestOutput, Sequence, positions_attended


class Speculator:
    """The n-gram index of each running request (built once from its prompt, then extended with what
    it generates), the drafts of a step, and the step that checks them."""

    def __init__(self) -> None:
        self._index: dict[str, NgramIndex] = {}
        self.steps = self.drafted = self.accepted = 0  # speculative steps and their drafts (stats)

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def propose(self, items: list[tuple[Sequence, int]], k: int, token_budget: int,
                max_model_len: int) -> list[list[int]] | None:
        """Each decode item's drafts, within its ``max_tokens``, the context and the step's token
        budget; None when the step should run as a plain decode step (no drafts, or a sequence that
        samples or wants log-probs)."""
        if k <= 0 or any(s.params.temperature != 0 or s.params.logprobs is not None for s, _ in items):
            return None
        spare = token_budget - len(items)
        drafts = []
        for seq, _ in items:
            room = min(k, spare, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - len(seq) - 1)
            d = self._index_of(seq).propose(room) if room > 0 else []
            spare -= len(d)
            drafts.append(d)
        return drafts if any(drafts) else None

    def _index_of(self, seq: Sequence) -> NgramIndex:
        index = self._index.get(seq.request_id)
        if index is None or len(index.tokens) > len(seq.token_ids):
            index = self._index[seq.request_id] = NgramIndex(seq.token_ids)
        else:
            index.extend(seq.token_ids[len(index.tokens):])
        return index

    def step(self, engine, items: list[tuple[Sequence, int]], drafts: list[list[int]]) -> list[RequestOutput]:
        """Check ``drafts`` (one list per decode item) in one pass; emit what the model agrees with."""
        lens = [len(s) for s, _ in items]
        rows: list[tuple[Sequence, int]] = []
        for (seq, _), d in zip(items, drafts):
            seq.token_ids += d
            if d and not engine.blocks.append_slots(seq):  # no block for the drafts: this one only decodes
                del seq.token_ids[-len(d):]
            rows.append((seq, len(seq) - seq.num_computed_tokens))
        attended = positions_attended(rows)
        greedy = engine.runner.verify_drafts(rows)
        outputs = []
        for (seq, n), length, picks in zip(rows, lens, greedy):
            drafted = seq.token_ids[length:]
            del seq.token_ids[length:]
            a = 0
            while a < len(drafted) and drafted[a] == picks[a]:
                a += 1
            self.drafted += len(drafted)
            self.accepted += a
            new, reason = [], None
            for token in picks[: a + 1]:
                seq.token_ids.append(token)
                new.append(token)
                reason = engine._stop_reason(seq, token)
                if reason:
                    break
            # the cache holds the last token and the accepted drafts; a stop inside them ends it sooner
            seq.num_computed_tokens = min(seq.num_computed_tokens + 1 + a, len(seq))
            engine.blocks.mark_computed(seq)
            if reason:
                engine._finish(seq, reason)
            outputs.append(RequestOutput(
                request_id=seq.request_id, new_token_ids=new, finished=reason is not None, finish_reason=reason,
                num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                num_output_tokens=seq.num_output_tokens))
        self.steps += 1
        engine._note_step(len(rows), sum(n for _, n in rows), True, attended)
        return outputs
