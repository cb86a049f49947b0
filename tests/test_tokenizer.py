"""Tokenizers of the server: the byte-level fallback, a Hugging Face folder, incremental decoding."""

from __future__ import annotations

import pytest

from anneal.engine.tokenizer import (
    BOS_ID,
    EOS_ID,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    TokenizerError,
    load_tokenizer,
    render_fallback_chat,
)

TEXT = "héllo wörld 你好 🙂 end"


def stream_decode(tok, ids, prompt=()):
    """Feed ids one by one; return the deltas and the text after flushing."""
    det = IncrementalDetokenizer(tok, prompt)
    deltas = [det.add([i]) for i in ids]
    deltas.append(det.flush())
    return deltas, det.text


# ---- byte-level fallback ----------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8_and_skips_specials():
    tok = ByteTokenizer(512)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode([BOS_ID, *ids, EOS_ID]) == TEXT
    assert tok.eos_token_ids == [EOS_ID]


def test_byte_tokenizer_ids_above_the_specials_decode_as_bytes_mod_256():
    tok = ByteTokenizer(512)
    assert tok.decode([ord("A") + 256]) == "A"
    assert tok.token_text(ord("A") + 256) == "A"
    assert tok.token_text(0xE4) == "<0xE4>"
    assert tok.token_text(BOS_ID) == "<|bos|>"


def test_byte_tokenizer_model_eos_ids_also_stop_and_decode_to_nothing():
    tok = ByteTokenizer(128256, eos_token_ids=[128001])
    assert tok.eos_token_ids == [EOS_ID, 128001]
    assert tok.decode([ord("a"), 128001, ord("b")]) == "ab"


def test_byte_tokenizer_needs_room_for_the_specials():
    with pytest.raises(TokenizerError, match="at least 258"):
        ByteTokenizer(256)


def test_byte_chat_template_is_the_documented_one():
    tok = ByteTokenizer(512)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages)
    assert ids[0] == BOS_ID
    assert bytes(ids[1:]).decode() == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert render_fallback_chat(messages) == bytes(ids[1:]).decode()


def test_load_tokenizer_picks_the_fallback_and_rejects_unknown_models(tmp_path):
    assert isinstance(load_tokenizer("random:tiny", 512, [EOS_ID]), ByteTokenizer)
    with pytest.raises(TokenizerError, match="vocab_size"):
        load_tokenizer("random:tiny")
    with pytest.raises(TokenizerError, match="neither"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))  # a folder without tokenizer files, no vocab to fall back on
    # A weights-only folder (as the benchmarks write) falls back to bytes when the vocab is known.
    assert isinstance(load_tokenizer(str(tmp_path), 512, [EOS_ID]), ByteTokenizer)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(str(tmp_path), 512, [EOS_ID])  # tokenizer files present but broken


# ---- incremental detokenization ---------------------------------------------------------------


def test_streaming_bytes_never_splits_a_character():
    tok = ByteTokenizer(512)
    ids = tok.encode(TEXT)
    deltas, text = stream_decode(tok, ids)
    assert text == TEXT
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte emoji arrives as one delta, after its last byte.
    emoji_end = len(TEXT.encode()[: TEXT.encode().index("🙂".encode()) + 4])
    assert deltas[emoji_end - 1].startswith("🙂")
    assert deltas[emoji_end - 2] == deltas[emoji_end - 3] == ""


def test_streaming_invalid_bytes_become_replacement_characters():
    tok = ByteTokenizer(512)
    ids = [ord("a"), 0xFF, ord("b"), 0xE4, 0xBD]  # a lone 0xFF; a truncated 3-byte character
    deltas, text = stream_decode(tok, ids)
    assert text == b"a\xffb\xe4\xbd".decode("utf-8", errors="replace")
    assert "".join(deltas) == text
    assert deltas[-1] == "\ufffd"  # the truncated tail only comes out at the end


def test_random_ids_stream_to_the_same_text_as_a_full_decode():
    import random

    tok = ByteTokenizer(512)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 40))]
        deltas, text = stream_decode(tok, ids)
        assert text == "".join(deltas) == tok.decode(ids)


# ---- a real Hugging Face tokenizer folder (trained here, no download) -------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT, "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    path = tmp_path_factory.mktemp("hf-tokenizer")
    fast.save_pretrained(path)
    return path


def test_hf_tokenizer_uses_the_folders_chat_template(hf_folder):
    tok = load_tokenizer(str(hf_folder))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == [tok._tok.convert_tokens_to_ids("</s>")]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "[user] hi\n[assistant] "


def test_hf_tokenizer_without_template_falls_back(hf_folder, tmp_path):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(hf_folder)
    plain.chat_template = None
    plain.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = HFTokenizer(tmp_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_hf_streaming_matches_a_full_decode(hf_folder):
    tok = HFTokenizer(hf_folder)
    prompt = tok.encode("the quick")
    ids = tok.encode(TEXT)[len(tok.encode("")) :]
    deltas, text = stream_decode(tok, ids, prompt)
    assert text == "".join(deltas) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)
