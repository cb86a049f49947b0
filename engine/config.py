"""Model configuration: the architecture facts the engine needs, from a HF config.json or a preset.

Torch-free, so the operator and the cost model can reason about shapes without loading a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Family = Literal["llama", "qwen3"]

# Hugging Face `architectures` entries we implement, and the family each maps to.
ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelError(ValueError):
    """A model that cannot be loaded: missing file, unsupported architecture, bad shapes or dtype."""


class RopeScaling(BaseModel):
    """Llama 3 frequency scaling (``rope_type: llama3``)."""

    model_config = ConfigDict(extra="ignore")
    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")  # a TP rank's shares


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="where the model came from: a folder or random:<preset>")
    family: Family
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    torch_dtype: Literal["float32", "float16", "bfloat16"] = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim={self.head_dim} must be even for RoPE")
        return self

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self, layers: int | None = None) -> int:
        """Parameter count (embeddings counted once when tied)."""
        L = self.num_hidden_layers if layers is None else layers
        H, I = self.hidden_size, self.intermediate_size
        per_layer = H * (self.q_size + 2 * self.kv_size) + self.q_size * H + 3 * H * I + 2 * H
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * H
        return L * per_layer + emb * (1 if self.tie_word_embeddings else 2) + H

    def kv_bytes_per_token(self, layers: int | None = None, dtype_bytes: int = 2) -> int:
        L = self.num_hidden_layers if layers is None else layers
        return 2 * L * self.kv_size * dtype_bytes

    def split_error(self, tp: int) -> str | None:
        """Why ``tp`` ranks cannot split this model (None when they can): each rank takes an equal
        share of the heads, the MLP's rows and the vocabulary. Torch-free, so the compile can refuse a
        degree before it starts an engine for it."""
        bad = [f"{name}={getattr(self, name)}" for name in SPLIT_FIELDS if getattr(self, name) % tp]
        return f"tensor_parallel={tp}: {', '.join(bad)} of {self.name} do not split {tp} ways" if bad else None


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise ModelError(f"{path}: config.json has no {key!r}")
    return cfg[key]


def config_from_hf(folder: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` and check we implement its architecture."""
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise ModelError(f"model folder {folder} does not exist")
    if not path.is_file():
        raise ModelError(f"{folder} has no config.json (is it a Hugging Face model folder?)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}: must be a JSON object, not a {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        raise ModelError(
            f"{path}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelError(f"{path}: attention/MLP biases are not supported")
    if cfg.get("quantization_config"):
        raise ModelError(f"{path}: quantized checkpoints are not supported")
    heads = _require(cfg, "num_attention_heads", path)
    hidden = _require(cfg, "hidden_size", path)
    for key, v in (("num_attention_heads", heads), ("hidden_size", hidden)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ModelError(f"{path}: {key} must be a positive integer, not {v!r}")
    scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
    rope_theta = cfg.get("rope_theta")
    if isinstance(scaling, dict):
        rope_theta = rope_theta or scaling.get("rope_theta")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind != "llama3":
            raise ModelError(f"{path}: rope scaling {kind!r} is not supported (only llama3)")
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelError(f"{path}: unsupported dtype {dtype!r} (float32, float16, bfloat16)")
    try:
        return ModelConfig(
            name=str(folder),
            family=family,
            vocab_size=_require(cfg, "vocab_size", path),
            hidden_size=hidden,
            intermediate_size=_require(cfg, "intermediate_size", path),
            num_hidden_layers=_require(cfg, "num_hidden_layers", path),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6 if family == "qwen3" else 1e-5),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=RopeScaling.model_validate(scaling) if scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            torch_dtype=dtype,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise ModelError(f"{path}: invalid config ({problems})") from None
