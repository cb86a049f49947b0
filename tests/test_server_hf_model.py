"""A live server on a Hugging Face model folder: its own tokenizer and chat template are used.

The folder is made here (a tiny random Llama saved by transformers and a BPE tokenizer trained on
a sentence), so nothing is downloaded.
"""

from __future__ import annotations

import openai
import pytest

from live_server import LiveServer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("hf-llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["<user>hello there</user><assistant>general kenobi"] * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    s = LiveServer("--served-model-name", "tiny-llama", "--num-kv-blocks", "64", model=str(folder))
    s.wait_ready()
    yield s
    assert s.stop() == 0


def test_chat_prompt_comes_from_the_folders_template(server, folder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, seed=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><user>hello there</user><assistant>"
    assert r.model_extra["prompt_token_ids"] == hf(text, add_special_tokens=False)["input_ids"]
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].message.content == hf.decode(ids, skip_special_tokens=True)
    server.assert_no_leaked_blocks()


def test_completion_prompt_is_encoded_by_the_folders_tokenizer(server, folder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.completions.create(model="tiny-llama", prompt="general kenobi", max_tokens=4,
                                  logprobs=1, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == hf("general kenobi")["input_ids"]
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=str(folder), prompt="x", max_tokens=1)
    server.assert_no_leaked_blocks()
