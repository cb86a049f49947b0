"""Speculative decoding with an n-gram drafter: decode steps that also check drafted tokens.

With ``scheduler.speculative_tokens = k``, a decode step of greedy sequences drafts up to ``k`` tokens
for each from its own context (prompt lookup, engine/ngram_draft.py) and runs one varlen pass over
every sequence's last token and its drafts. The model's argmax at each row says how many drafts it
agrees with; the step emits those and the token after them. Greedy verification emits the tokens
plain decoding would (a different kernel path may round a near-tie otherwise), so the knob changes
speed only: up to ``k + 1`` tokens a sequence for a step that reads the weights once.

A step whose sequences draft nothing stays a plain decode step (its CUDA graph), so a traffic whose
outputs never repeat their context pays only the host's lookups, and those back off (a sequence, or
a whole step, whose lookups keep giving nothing is looked up every 2nd, 4th, ... 64th step). Sampled
requests and requests asking for log-probs are never drafted for (a step holding one does not
speculate). The draft's KV rows past the accepted ones are left in the cache beyond the sequence's
length, where the next steps overwrite them; their slots come from blocks the sequence would fill
next anyway.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from anneal.engine.ngram_draft import NgramIndex
from anneal.engine.sequence import RequestOutput, Sequence, positions_attended

# A sequence whose lookup found nothing to draft, or whose drafts were all rejected, skips its next
# lookups: 1, 2, 4, ... up to this many steps, and back to every step once a draft is accepted. So
# does the whole step when no sequence in it drafted anything. On outputs that never repeat their
# context (the 8B's random weights) the lookups were the knob's whole cost: ~10-20 µs a sequence a
# step on the step's critical path (session 41: 2-4% of the replays with nothing drafted), and the
# per-sequence loop alone still 3-5% on the H100's host (session 42). A sequence that starts copying
# its context is found again within this many steps.
MAX_BACKOFF = 64
# Contexts at least this long are indexed on a helper thread (numpy does most of it outside the GIL)
# while the sequence decodes without drafts; shorter ones inline (under ~0.3 ms). A 32k-token agentic
# prompt took 14-22 ms to index, all of it one decode step's latency.
BACKGROUND_INDEX_MIN = 512


@dataclass
class _Backoff:
    """When to look up next: after a miss at step t with backoff b, at step t + b + 1 (b doubling up
    to MAX_BACKOFF); after a hit, every step again."""

    next_step: int = 0
    backoff: int = 1

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def missed(self, step: int) -> None:
        self.next_step, self.backoff = step + self.backoff + 1, min(2 * self.backoff, MAX_BACKOFF)

    def hit(self) -> None:
        self.next_step, self.backoff = 0, 1


@dataclass
class _Drafting(_Backoff):
    """One request's drafting state: its index (or the build that will give it), and its backoff."""

    index: NgramIndex | None = None
    build: Future | None = None


class Speculator:
    """The n-gram index of each running request (built once from its context, then extended with what
    it generates), the drafts of a step, and the step that checks them."""

    def __init__(self) -> None:
        self._state: dict[str, _Drafting] = {}
        self._pool: ThreadPoolExecutor | None = None  # builds of long contexts' indexes
        self._tick = -1  # decode steps proposed for (the backoffs' clock)
        self._steps = _Backoff()  # the whole step's: no sequence drafted anything
        self.steps = self.drafted = self.accepted = 0  # speculative steps and their drafts (stats)

    def forget(self, request_id: str) -> None:
        st = self._state.pop(request_id, None)
        if st is not None and st.build is not None:
            st.build.cancel()

    def propose(self, items: list[tuple[Sequence, int]], k: int, token_budget: int,
                max_model_len: int) -> list[list[int]] | None:
        """Each decode item's drafts, within its ``max_tokens``, the context and the step's token
        budget; None when the step should run as a plain decode step (no drafts, or a sequence that
        samples or wants log-probs)."""
        self._tick += 1
        tick = self._tick
        if k <= 0 or not self._steps.due(tick):
            return None
        if any(s.params.temperature != 0 or s.params.logprobs is not None for s, _ in items):
            return None
        spare = token_budget - len(items)
        drafts = []
        for seq, _ in items:
            room = min(k, spare, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - len(seq) - 1)
            d: list[int] = []
            if room > 0:
                st = self._state_of(seq)
                if st.due(tick):
                    index = self._index_of(seq, st)
                    d = index.propose(room) if index is not None else []
                    if not d and index is not None:
                        st.missed(tick)
            spare -= len(d)
            drafts.append(d)
        if any(drafts):
            return drafts
        self._steps.missed(tick)
        return None

    def _state_of(self, seq: Sequence) -> _Drafting:
        st = self._state.get(seq.request_id)
        if st is None:
            st = self._state[seq.request_id] = _Drafting()
        return st

    def _index_of(self, seq: Sequence, st: _Drafting) -> NgramIndex | None:
        """``seq``'s index, caught up with its tokens; None while a helper thread still builds it."""
        if st.index is None and st.build is not None:
            if not st.build.done():
                return None
            st.index, st.build = st.build.result(), None
        if st.index is None or len(st.index.tokens) > len(seq.token_ids):  # new, or preempted and shorter
            if len(seq.token_ids) >= BACKGROUND_INDEX_MIN:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngram-index")
                st.index, st.build = None, self._pool.submit(NgramIndex, list(seq.token_ids))
                return None
            st.index = NgramIndex(seq.token_ids)
        else:
            st.index.extend(seq.token_ids[len(st.index.tokens):])
        return st.index

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
        outputs, any_accepted = [], False
        for (seq, n), length, picks in zip(rows, lens, greedy):
            drafted = seq.token_ids[length:]
            del seq.token_ids[length:]
            a = 0
            while a < len(drafted) and drafted[a] == picks[a]:
                a += 1
            self.drafted += len(drafted)
            self.accepted += a
            any_accepted |= a > 0
            if drafted:
                st = self._state_of(seq)
                if a:
                    st.hit()
                else:
                    st.missed(self._tick)
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
        if any_accepted:
            self._steps.hit()
        else:
            self._steps.missed(self._tick)
        self.steps += 1
        engine._note_step(len(rows), sum(n for _, n in rows), True, attended)
        return outputs
