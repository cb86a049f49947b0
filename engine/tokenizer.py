"""Text <-> token ids for the server: a Hugging Face tokenizer, or a byte-level fallback.

``load_tokenizer(model, vocab_size)`` returns a :class:`Tokenizer`:

- a Hugging Face model folder -> :class:`HFTokenizer` (``transformers.AutoTokenizer``), with the
  folder's chat template (or the fallback template below when the folder has none);
- ``random:<preset>`` -> :class:`ByteTokenizer`, the documented byte-level fallback:

  ======================  ==================================================================
  ids 0..255              the bytes 0x00..0xFF (UTF-8 text is encoded byte by byte)
  id 256  ``<|bos|>``     beginning of sequence (prepended by the chat template)
  id 257  ``<|eos|>``     end of sequence: generating it stops the request (so do the
                          model config's own EOS ids, which also decode to nothing)
  ids 258..vocab_size-1   random models sample the whole vocabulary; such an id decodes as
                          the byte ``id % 256`` so that their output is still text
  ======================  ==================================================================

  The fallback chat template (also used for HF folders without one) is, for each message,
  ``<|{role}|>\\n{content}<|end|>\\n``, then ``<|assistant|>\\n`` as the generation prompt; the
  byte tokenizer prepends ``<|bos|>`` (id 256). Role markers are plain text, not special ids.

Streaming output goes through :class:`IncrementalDetokenizer`, which never emits half a UTF-8
character: text that ends in an incomplete sequence is held back until the next token completes it
(or until the request ends, when whatever is left is flushed with U+FFFD replacement characters).
"""

from __future__ import annotations

import logging

from pathlib import Path
from typing import Any, Protocol, Sequence

BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257
SPECIAL_TOKENS = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>"}
# How many trailing prompt tokens give the detokenizer its context (word-boundary spacing).
_CONTEXT_TOKENS = 5


class TokenizerError(ValueError):
    """The model has no usable tokenizer, or a chat cannot be rendered."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_ids: list[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (special tokens such as BOS included)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped; incomplete UTF-8 becomes U+FFFD."""

    def token_text(self, token_id: int) -> str:
        """How one token is shown in logprobs."""

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat prompt, ending with the assistant's generation prompt."""


def render_fallback_chat(messages: list[dict[str, Any]]) -> str:
    """The fallback chat template (see the module docstring)."""
    parts = [f"<|{m['role']}|>\n{m.get('content') or ''}<|end|>\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


class ByteTokenizer:
    """The byte-level fallback for ``random:`` models (table in the module docstring)."""

    def __init__(self, vocab_size: int, name: str = "byte", eos_token_ids: Sequence[int] = ()):
        if vocab_size < EOS_ID + 1:
            raise TokenizerError(
                f"the byte-level tokenizer needs a vocabulary of at least {EOS_ID + 1} ids; "
                f"the model has {vocab_size}"
            )
        self.name = name
        self.vocab_size = vocab_size
        # The model's own EOS ids (a preset with a real vocabulary has its own) also stop and
        # decode to nothing.
        self.eos_token_ids = sorted({EOS_ID, *eos_token_ids})
        self._skip = set(SPECIAL_TOKENS) | set(self.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(i % BYTE_VOCAB for i in ids if i not in self._skip)

    def decode(self, ids: Sequence[int]) -> str:
        return self._bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        if token_id in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token_id]
        if token_id in self._skip:
            return "<|eos|>"
        b = token_id % BYTE_VOCAB
        return chr(b) if b < 0x80 else f"<0x{b:02X}>"

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return [BOS_ID] + self.encode(render_fallback_chat(messages))


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a model folder."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
        self.name = str(path)
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        piece = self._tok.convert_ids_to_tokens(token_id)
        return self._tok.convert_tokens_to_string([piece]) if piece else ""

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            try:
                text = self._tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except Exception as e:  # noqa: BLE001 - jinja errors (e.g. unsupported roles)
                raise TokenizerError(f"the model's chat template rejected the messages: {e}") from e
        else:
            text = render_fallback_chat(messages)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(
    model: str, vocab_size: int | None = None, eos_token_ids: Sequence[int] = ()
) -> Tokenizer:
    """The tokenizer for ``model``: byte-level for ``random:`` models, else from the folder."""
    if model.startswith("random:"):
        if vocab_size is None:
            raise TokenizerError("a random: model needs its vocab_size for the byte tokenizer")
        return ByteTokenizer(vocab_size, name=model, eos_token_ids=eos_token_ids)
    path = Path(model)
    if not path.is_dir():
        raise TokenizerError(f"{model!r} is neither random:<preset> nor a model folder")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        # A weights-only folder (benchmarks write these): serve token ids, bytes for text.
        if vocab_size is None:
            raise TokenizerError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        logging.getLogger("anneal.tokenizer").warning(
            "%s has no tokenizer files; using the byte-level fallback tokenizer", path)
        return ByteTokenizer(vocab_size, name=str(path), eos_token_ids=eos_token_ids)
    return HFTokenizer(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas that never split a UTF-8 character.

    Decodes a small window (the last emitted tokens plus the new ones) rather than the whole
    output, as vLLM does, so each step costs O(window) and tokenizers that drop leading spaces at
    a window start still get their context from the previous tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this were emitted
        self.output_ids: list[int] = []
        self.text = ""

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        self.output_ids.extend(new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing yet, or an incomplete character: wait for more ids
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (with U+FFFD if incomplete)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
