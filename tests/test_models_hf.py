"""Each model family equals Hugging Face `transformers` on tiny random checkpoints the test saves.

Prefill logits at every position, then many greedy decode steps through the paged cache, compared
with HF's full forward over the same tokens, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from anneal.engine.llm import Engine, EngineArgs  # noqa: E402
from anneal.engine.sampling_params import SamplingParams  # noqa: E402
from anneal.engine.sequence import Sequence  # noqa: E402

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)


def _llama(tied: bool, scaled: bool):
    rope = (
        dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
             high_freq_factor=4.0, original_max_position_embeddings=64)
        if scaled else None
    )
    cfg = transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=tied, rms_norm_eps=1e-5, head_dim=16,
        rope_theta=500000.0 if scaled else 10000.0,
    )
    if rope:
        # transformers 5 reads `rope_parameters`; older releases read `rope_scaling`.
        if hasattr(cfg, "rope_parameters"):
            cfg.rope_parameters = rope
        cfg.rope_scaling = rope
    return transformers.LlamaForCausalLM(cfg)


def _qwen3(tied: bool):
    cfg = transformers.Qwen3Config(**COMMON, tie_word_embeddings=tied, head_dim=32, rms_norm_eps=1e-6)
    return transformers.Qwen3ForCausalLM(cfg)


def _randomize_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))


def save_checkpoint(model, path, dtype, shard: bool):
    _randomize_norms(model)
    model = model.to(dtype)
    model.config.torch_dtype = dtype
    kw = {"max_shard_size": "100KB"} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return model


FAMILIES = {
    "llama-untied-llama3rope": lambda: _llama(tied=False, scaled=True),
    "llama-tied": lambda: _llama(tied=True, scaled=False),
    "qwen3": lambda: _qwen3(tied=False),
    "qwen3-tied": lambda: _qwen3(tied=True),
}
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family, dtype):
    torch.manual_seed(0)
    hf = save_checkpoint(FAMILIES[family](), tmp_path, dtype, shard=(family == "qwen3"))
    hf.config._attn_implementation = "eager"
    hf.eval()
    if family == "qwen3":
        assert (tmp_path / "model.safetensors.index.json").exists(), "sharded checkpoint expected"
    if family == "llama-untied-llama3rope":
        from anneal.engine.config import config_from_hf

        assert config_from_hf(tmp_path).rope_scaling is not None, "llama3 RoPE scaling not read"
    dname = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    eng = Engine(EngineArgs(model=str(tmp_path), device="cpu", dtype=dname, block_size=4,
                            num_kv_blocks=128, max_model_len=256))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (13, 5, 21)]
    seqs = [Sequence(f"r{i}", list(p), SamplingParams(temperature=0), seed=0) for i, p in enumerate(prompts)]
    for s in seqs:
        assert eng.blocks.allocate(s)

    # Prefill: all three prompts in one varlen pass, logits at every position.
    ours = eng.runner.prefill_all_logits([(s, len(s)) for s in seqs])
    offset = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf(torch.tensor([s.token_ids])).logits[0].float()
        got = ours[offset : offset + len(s)]
        offset += len(s)
        assert rel_err(got, ref) < TOL[dtype], f"prefill {family} {dtype}: {rel_err(got, ref)}"
        s.num_computed_tokens = len(s)
        s.token_ids.append(int(ref[-1].argmax()))

    # Decode: 24 greedy steps for the whole batch through the paged cache.
    for step in range(24):
        for s in seqs:
            assert eng.blocks.append_slots(s)
        logits, _, rows = eng.runner.extend([(s, 1) for s in seqs], decode_only=True)
        assert rows == [0, 1, 2]
        for i, s in enumerate(seqs):
            with torch.no_grad():
                ref = hf(torch.tensor([s.token_ids])).logits[0, -1].float()
            err = rel_err(logits[i], ref)
            assert err < TOL[dtype], f"decode step {step} {family} {dtype}: {err}"
            s.num_computed_tokens = len(s)
            s.token_ids.append(int(ref.argmax()))


def test_engine_greedy_matches_transformers_generate(tmp_path):
    torch.manual_seed(0)
    hf = save_checkpoint(FAMILIES["llama-untied-llama3rope"](), tmp_path, torch.float32, shard=False)
    hf.eval()
    eng = Engine(EngineArgs(model=str(tmp_path), device="cpu", block_size=8, num_kv_blocks=64,
                            max_model_len=256))
    prompt = list(range(10, 40))
    ours = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
