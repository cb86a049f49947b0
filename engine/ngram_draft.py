"""What an n-gram drafter would have given a replay: speculative decoding's headroom, measured.

Speculative decoding with greedy verification emits exactly the tokens plain greedy decoding
does, so how many tokens a verify step would have accepted can be read off the outputs a replay
already produced, without building the drafter into the engine. The drafter is prompt lookup
(vLLM's ``ngram`` method): find the longest suffix of the sequence, ``max_n`` tokens down to
``min_n`` (3 and 2), that occurred before, and propose the ``k`` tokens that followed its latest
occurrence (continued periodically when they run into the suffix itself, so a loop is proposed whole).

The figures say whether the lever exists for a traffic before anyone pays for it: on real models,
agentic and code-editing outputs copy their context and accept several tokens a step; on random
weights with a large vocabulary the outputs almost never repeat (session 41 measured 1.000 tokens
a step on the 1B shape), and on a tiny one they loop (nearly ``k + 1``). Torch-free (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_K = 4
DEFAULT_MAX_N = 3
# A suffix of one token that occurred before is weak evidence (any token of a 128k vocabulary recurs in
# a long context now and then): on the 8B's random-weight replays such drafts put 5% of the chat
# replay's steps on the eager check path and cost 3.5-7.4% tokens/s, every one rejected (session 41).
DEFAULT_MIN_N = 2


# An n-gram's key: its tokens packed into one int, RADIX_BITS each (60 bits for three tokens). A prompt
# (BULK tokens or more at once) is indexed by numpy as sorted key arrays, generated tokens one at a time
# in a dict: a tuple-keyed dict of a 32k-token agentic prompt took 67-114 ms of the engine's step on a
# loaded CPU and 30x the garbage collections (session 41: agentic ITL p90 8.4 -> 11.4 ms on the H100
# with nothing drafted); int keys in a dict still 26-43 ms.
RADIX_BITS = 20
BULK = 64


class NgramIndex:
    """A growing token sequence and, per n-gram length, where each n-gram last occurred with at
    least one token after it: a proposal is O(max_n log L) however long the context is (agentic
    prompts run to 32k tokens)."""

    def __init__(self, tokens: list[int], max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N):
        if not 1 <= min_n <= max_n or max_n * RADIX_BITS > 63:
            raise ValueError(f"need 1 <= min_n <= max_n <= {63 // RADIX_BITS}, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n -> packed n-gram -> start of its latest occurrence with a token after it (tokens added one
        # at a time), and n -> (sorted keys, their starts) per bulk extend, oldest first
        self._last: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._bulk: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {n: [] for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        if tokens and (max(tokens) >> RADIX_BITS or min(tokens) < 0):
            raise ValueError(f"token ids must be in [0, 2**{RADIX_BITS}) for the n-gram index")
        if len(tokens) >= BULK:
            old = len(self.tokens)
            self.tokens += tokens
            self._index_bulk(old)
            return
        ts = self.tokens
        for t in tokens:  # the n-grams ending just before t gain a follower; keys built from the end
            end, key = len(ts), 0
            ts.append(t)
            for n in range(1, min(self.max_n, end) + 1):
                key |= ts[end - n] << (RADIX_BITS * (n - 1))
                if n >= self.min_n:
                    self._last[n][key] = end - n

    def _index_bulk(self, old: int) -> None:
        """Every n-gram that gained a follower since length ``old``, as keys sorted by (key, start)."""
        ts = np.asarray(self.tokens, dtype=np.int64)
        for n, segments in self._bulk.items():
            first, stop = max(0, old - n), len(ts) - n  # starts s with s + n <= len - 1
            if stop <= first:
                continue
            keys = np.zeros(stop - first, dtype=np.int64)
            for j in range(n):
                keys = (keys << RADIX_BITS) | ts[first + j:stop + j]
            order = np.argsort(keys, kind="stable")  # equal keys stay in start order: the last is the latest
            # Kept as arrays: searchsorted on a scalar takes ~1.3 µs against bisect's ~0.6 on a list, but
            # turning a 32k prompt's arrays into lists held the GIL ~7 ms, stalling the engine's step
            # while a helper thread built the index (engine/speculation.py; session 42).
            segments.append((keys[order], order + first))

    def _latest(self, n: int, key: int) -> int | None:
        start = self._last[n].get(key)  # tokens added one at a time come after every bulk one
        if start is not None:
            return start
        for keys, starts in reversed(self._bulk[n]):
            i = int(keys.searchsorted(key, side="right")) - 1
            if i >= 0 and keys[i] == key:
                return int(starts[i])
        return None

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens after the sequence (none when no suffix occurred before)."""
        ts, keys, key = self.tokens, {}, 0
        for n in range(1, min(self.max_n, len(ts)) + 1):  # the suffixes' keys, built from the end
            key |= ts[-n] << (RADIX_BITS * (n - 1))
            keys[n] = key
        for n in range(min(self.max_n, len(ts)), self.min_n - 1, -1):
            start = self._latest(n, keys[n])
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
        return {"drafter": "ngram", "k": self.k, "max_n": self.max_n, "min_n": self.min_n,
                "verify_steps": self.verify_steps, "tokens": self.tokens, "drafted": self.drafted,
                "accepted": self.accepted,
                "tokens_per_step": self.tokens_per_step, "drafted_per_step": self.drafted_per_step}


def draft_stats(sequences: list[tuple[list[int], list[int]]], k: int = DEFAULT_K,
                max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> DraftStats:
    """The drafter over ``(prompt, greedy output)`` pairs, summed."""
    stats = DraftStats(k=k, max_n=max_n, min_n=min_n)
    for prompt, output in sequences:
        stats.add(prompt, output)
    return stats
