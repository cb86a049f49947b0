"""Stop strings: cut generated text before the first stop string, and never stream part of one.

The engine stops on token ids (EOS, ``stop_token_ids``); stop *strings* are found in the detokenized
text here. While streaming, the tail of the text that could still grow into a stop string is held
back, so a client never sees ``"</"`` of a ``"</answer>"`` that later matches. The stop string
itself is not part of the output (OpenAI semantics).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # all accepted text, cut at the stop string once one matched
        self._released = 0  # characters of ``text`` already handed out
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text that is now safe to emit (after a match: up to the stop)."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_tail())

    def finish(self) -> str:
        """The request ended: release whatever was held back."""
        return self._release(len(self.text))

    def _partial_tail(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)
        out = self.text[self._released : upto]
        self._released = upto
        return out
