"""Bad model folders give a clear `ModelError` naming the problem (and where), never a traceback
from deep inside json, pydantic or safetensors.

Each case starts from a small valid Llama checkpoint written by the test (the positive control
loads it) and breaks exactly one thing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from anneal.engine.config import ModelError, config_from_hf
from anneal.engine.llm import Engine, EngineArgs

H, I, V, L, HEADS, KV_HEADS, D = 32, 48, 97, 2, 4, 2, 8

CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H,
    intermediate_size=I, num_hidden_layers=L, num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS, head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="float32",
    bos_token_id=1, eos_token_id=2,
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": 1 + r(H), "lm_head.weight": r(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": 1 + r(H),
            p + "post_attention_layernorm.weight": 1 + r(H),
            p + "self_attn.q_proj.weight": r(HEADS * D, H),
            p + "self_attn.k_proj.weight": r(KV_HEADS * D, H),
            p + "self_attn.v_proj.weight": r(KV_HEADS * D, H),
            p + "self_attn.o_proj.weight": r(H, HEADS * D),
            p + "mlp.gate_proj.weight": r(I, H),
            p + "mlp.up_proj.weight": r(I, H),
            p + "mlp.down_proj.weight": r(H, I),
        })
    return t


def write_checkpoint(folder: Path, *, config: dict | None = None, weights: dict | None = None,
                     sharded: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    w = weights if weights is not None else tensors(random.randrange(1 << 30))
    if not sharded:
        save_file(w, str(folder / "model.safetensors"))
        return folder
    names = sorted(w)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: w[k] for k in keys}, str(folder / fname))
        weight_map.update({k: fname for k in keys})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return folder


def load(folder: Path | str, **kw) -> Engine:
    return Engine(EngineArgs(model=str(folder), device="cpu", num_kv_blocks=32, block_size=8,
                             max_model_len=64, **kw))


def expect_error(folder: Path | str, *fragments: str, **kw) -> str:
    with pytest.raises(ModelError) as ei:
        load(folder, **kw)
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_the_valid_checkpoint_loads_and_generates(tmp_path, sharded):
    eng = load(write_checkpoint(tmp_path / "ok", sharded=sharded))
    assert eng.num_layers == L and eng.config.vocab_size == V
    out = eng.generate([[5, 9, 33]], None)[0]
    assert len(out) >= 1 and all(0 <= t < V for t in out)


def test_missing_folder(tmp_path):
    expect_error(tmp_path / "nope", "does not exist", "nope")


def test_missing_config_json(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    (folder / "config.json").unlink()
    expect_error(folder, "no config.json")


def test_invalid_json(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    expect_error(folder, "not valid JSON", "config.json")


def test_config_json_that_is_not_an_object(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    (folder / "config.json").write_text(json.dumps([CONFIG]))
    expect_error(folder, "config.json", "object")


def test_unsupported_architecture(tmp_path):
    folder = write_checkpoint(tmp_path / "m", config={**CONFIG, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"})
    msg = expect_error(folder, "unsupported architecture", "GPT2LMHeadModel")
    assert "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg, "should list what is supported"


def test_quantized_checkpoint(tmp_path):
    cfg = {**CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4}}
    expect_error(write_checkpoint(tmp_path / "m", config=cfg), "quantized")


def test_missing_config_key(tmp_path):
    cfg = {k: v for k, v in CONFIG.items() if k != "intermediate_size"}
    expect_error(write_checkpoint(tmp_path / "m", config=cfg), "intermediate_size")


def test_inconsistent_heads(tmp_path):
    cfg = {**CONFIG, "num_key_value_heads": 3}
    expect_error(write_checkpoint(tmp_path / "m", config=cfg), "num_key_value_heads=3")


@pytest.mark.parametrize("key,value", [
    ("hidden_size", -32), ("num_attention_heads", 0), ("hidden_size", "32"),
    ("intermediate_size", 0), ("vocab_size", None), ("num_hidden_layers", "two"),
])
def test_invalid_config_value(tmp_path, key, value):
    cfg = {**CONFIG, key: value}
    if key == "num_attention_heads":
        cfg.pop("head_dim")  # head_dim is derived from the heads
    expect_error(write_checkpoint(tmp_path / "m", config=cfg), key)


def test_unsupported_config_dtype(tmp_path):
    cfg = {**CONFIG, "torch_dtype": "float64"}
    expect_error(write_checkpoint(tmp_path / "m", config=cfg), "unsupported dtype", "float64")


def test_unsupported_rope_scaling(tmp_path):
    cfg = {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    expect_error(write_checkpoint(tmp_path / "m", config=cfg), "yarn")


def test_missing_safetensors(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    expect_error(folder, "no model.safetensors")


def test_corrupt_safetensors_file(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])  # a truncated download
    expect_error(folder, "model.safetensors")


def test_shard_listed_in_the_index_is_missing(tmp_path):
    folder = write_checkpoint(tmp_path / "m", sharded=True)
    (folder / "model-00002-of-00002.safetensors").unlink()
    expect_error(folder, "model-00002-of-00002.safetensors", "missing")


def test_index_that_is_not_json(tmp_path):
    folder = write_checkpoint(tmp_path / "m", sharded=True)
    (folder / "model.safetensors.index.json").write_text("{not json")
    expect_error(folder, "model.safetensors.index.json")


def test_index_lists_a_tensor_no_shard_has(tmp_path):
    folder = write_checkpoint(tmp_path / "m", sharded=True)
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_error(folder, "model.layers.0.mlp.extra.weight", "missing")


def test_missing_tensor(tmp_path):
    w = tensors(1)
    del w["model.layers.1.mlp.down_proj.weight"]
    expect_error(write_checkpoint(tmp_path / "m", weights=w), "model.layers.1.mlp.down_proj.weight")


def test_untied_model_without_lm_head(tmp_path):
    w = tensors(2)
    del w["lm_head.weight"]
    expect_error(write_checkpoint(tmp_path / "m", weights=w), "lm_head.weight")


def test_tensor_with_the_wrong_shape(tmp_path):
    w = tensors(3)
    w["model.layers.0.self_attn.k_proj.weight"] = torch.randn(HEADS * D, H)  # MHA shape, config says GQA
    msg = expect_error(write_checkpoint(tmp_path / "m", weights=w),
                       "model.layers.0.self_attn.k_proj.weight", "shape")
    assert str((HEADS * D, H)) in msg and str((KV_HEADS * D, H)) in msg


def test_unsupported_tensor_dtype(tmp_path):
    w = tensors(4)
    w["model.layers.1.self_attn.o_proj.weight"] = torch.randint(-100, 100, (H, HEADS * D), dtype=torch.int8)
    expect_error(write_checkpoint(tmp_path / "m", weights=w),
                 "model.layers.1.self_attn.o_proj.weight", "int8")


def test_layers_larger_than_the_model(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    expect_error(folder, "--layers 3", f"{L} layers", layers=3)
    assert load(folder, layers=1).num_layers == 1  # a fast tier within range is fine


def test_layers_larger_than_a_random_preset():
    expect_error("random:tiny", "--layers 99", layers=99)


def test_unknown_random_preset():
    msg = expect_error("random:gpt-5", "unknown random preset", "gpt-5")
    assert "tiny" in msg, "should list the known presets"


def test_config_errors_are_value_errors(tmp_path):
    """ModelError subclasses ValueError, so callers that catch bad input catch it too."""
    with pytest.raises(ValueError):
        config_from_hf(tmp_path / "nope")


def test_folding_is_refused_with_the_numbers_when_the_device_has_no_room():
    """folded_norm's second copy of qkv/gate_up (9 GB on the 8B) must leave the engine's activation
    headroom; if it cannot, the plan is refused before anything is allocated, saying why."""
    from anneal.engine.weights import FOLD_HEADROOM, FoldError, fold_shortfall

    gib = 2**30
    assert fold_shortfall(9 * gib, 9 * gib + FOLD_HEADROOM) is None
    msg = fold_shortfall(9 * gib, 10 * gib)
    assert msg is not None and "needs 9.0 GiB" in msg and "10.0 GiB are free" in msg
    assert issubclass(FoldError, ValueError)  # the admin API answers 400, previous plan still serving


def test_room_for_weight_copies_counts_no_block_cached_in_a_graph_pool():
    """Free blocks cached in a CUDA-graph private pool only serve captures into that pool: a
    snapshot (``torch.cuda.memory_snapshot()``'s fields) with 10 GiB of them and 1 GiB free in the
    default pool has 1 GiB to lend a weight copy, and none of another device's."""
    from anneal.engine.weights import cached_free

    gib = 2**30
    segments = [
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 3 * gib, "active_size": 2 * gib},
        {"device": 0, "segment_pool_id": (1, 0), "total_size": 10 * gib, "active_size": 0},  # a graph pool
        {"device": 0, "segment_pool_id": [0, 0], "total_size": gib // 2, "active_size": gib // 2},
        {"device": 1, "segment_pool_id": (0, 0), "total_size": 4 * gib, "active_size": 0},
    ]
    assert cached_free(segments, 0) == (gib, 10 * gib)
    assert cached_free(segments, 1) == (4 * gib, 0)
    assert cached_free([], 0) == (0, 0)
