"""`random:<preset>` models: real architecture shapes with random weights (torch-free).

`tiny` is sized for the CPU (tests, the README's main job); the others carry the real shapes of
public checkpoints so benchmarks move the same bytes and FLOPs as the real models.
"""

from __future__ import annotations

from anneal.engine.config import ModelConfig, ModelError, RopeScaling

_LLAMA3_ROPE = {"rope_theta": 500000.0}

PRESETS: dict[str, dict] = {
    # CPU-fast; vocab holds the byte-level fallback tokenizer (256 bytes + specials).
    "tiny": dict(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=True, torch_dtype="float32", bos_token_id=256, eos_token_ids=[257],
    ),
    "tiny-qwen3": dict(
        family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
        tie_word_embeddings=True, torch_dtype="float32", bos_token_id=256, eos_token_ids=[257],
    ),
    "llama-3.2-1b": dict(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0), bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009], **_LLAMA3_ROPE,
    ),
    "llama-3.1-8b": dict(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=RopeScaling(factor=8.0), bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009], **_LLAMA3_ROPE,
    ),
    "qwen3-0.6b": dict(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=None, eos_token_ids=[151645, 151643],
    ),
    "qwen3-8b": dict(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, bos_token_id=None, eos_token_ids=[151645, 151643],
    ),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelError(f"unknown random preset {name!r}; known: {sorted(PRESETS)}")
    return ModelConfig(name=f"random:{name}", **PRESETS[name])


def is_random(model: str) -> bool:
    return model.startswith("random:")
