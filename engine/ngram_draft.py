"""What an n-gram drafter would have given a replay: speculative decoding's headroom, measured.

Speculative decoding with greedy verification emits exactly the tokens plain greedy decoding
does, so how many tokens a verify step would have accepted can be read off the outputs a replay
already produced, without building the drafter into the engine. The drafter is prompt lookup
(vLLM's ``ngram`` method): find the longest suffix of the sequence, ``max_n`` tokens down to
``min_n`` (3 and 2), that occurred before, and propose the ``k`` tokens that followed its latest occurrence
(continued periodically when they run into the suffix itself, so a loop is proposed whole).

The figures say whether the lever exists for a traffic before anyone pays for it: on real models,
agentic and code-editing outputs copy their context and accept several tokens a step; on random
weights with a large vocabulary the outputs almost never repeat (session 41 measured 1.000 tokens
a step on the 1B shape), and on a tiny one they loop (nearly ``k + 1``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_K = 4
DEFAULT_MAX_N = 3
# A suffix of one token that occurred before is weak evidence (any token of a 128k vocabulary recurs in
# a long context now and then): on the 8B's random-weight replays such drafts put 5% of the chat
# replay's steps on the eager check path and cost 3.5-7.4% tokens/s, every one rejected (session 41).
DEFAULT_MIN_N = 2


class NgramIndex:
    """A growing token sequence and, per n-gram length, where each n-gram last occurred with at
    least one token after it: a proposal is O(max_n) however long the context is (agentic prompts
    run to 32k tokens)."""

    def __init__(self, tokens: list[int], max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest followed occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending just before ``t`` now have a token after them
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._last[tuple(self.tokens[end - n:end])] = end - n
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens after the sequence (none when no suffix occurred before)."""
        ts = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ts) < n:
                continue
            start = self._last.get(tuple(ts[len(ts) - n:]))
            if start is None:
                continue
            src, out = start + n, []
            for i in range(k):  # continued from the draft itself once it reaches the end: loops whole
                j = src + i
                out.append(ts[j] if j < len(ts) else out[j - len(ts)])
            return out
        return []


@dataclass
class DraftStats:
    """A drafter replayed over greedy outputs: verify steps it would have taken for the tokens
    after each sequence's first (the first comes from its prompt step), and what it proposed."""

    k: int
    max_n: int
    min_n: int = DEFAULT_MIN_N
    verify_steps: int = 0
    tokens: int = 0  # tokens those steps emit: accepted drafts plus the one each step samples
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_step(self) -> float:
        """What multiplies a decode step's tokens (1.0: the drafter never helps)."""
        return self.tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def drafted_per_step(self) -> float:
        """Extra rows a verify step computes per sequence (what it costs beyond a decode step)."""
        return self.drafted / self.verify_steps if self.verify_steps else 0.0

    def add(self, prompt: list[int], output: list[int]) -> None:
        """Replay the drafter over one sequence's greedy ``output`` after ``prompt``."""
        if len(output) < 2:
            return
        index = NgramIndex(prompt + output[:1], self.max_n, self.min_n)
        j = 1
        while j < len(output):
            draft = index.propose(min(self.k, len(output) - j - 1))  # accepted + the sampled one fit
            a = 0
            while a < len(draft) and draft[a] == output[j + a]:
                a += 1
            emit = a + 1
            index.extend(output[j:j + emit])
            j += emit
            self.verify_steps += 1
            self.tokens += emit
            self.drafted += len(draft)
            self.accepted += a

    def as_dict(self) -> dict[str, float | int | str]:
        return {"drafter": "ngram", "k": self.k, "max_n": self.max_n, "min_n": self.min_n, "verify_steps": self.verify_steps,
                "tokens": self.tokens, "drafted": self.drafted, "accepted": self.accepted,
                "tokens_per_step": self.tokens_per_step, "drafted_per_step": self.drafted_per_step}


def draft_stats(sequences: list[tuple[list[int], list[int]]], k: int = DEFAULT_K,
                max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> DraftStats:
    """The drafter over ``(prompt, greedy output)`` pairs, summed."""
    stats = DraftStats(k=k, max_n=max_n, min_n=min_n)
    for prompt, output in sequences:
        stats.add(prompt, output)
    return stats
