"""Weights: read a Hugging Face safetensors folder straight to the device, or make random ones.

The engine keeps projections fused (q|k|v and gate|up concatenated along the output dim) so a
decode step launches one GEMV per fused projection. ``layers=k`` keeps only the first k decoder
layers (the fast tier); embedding, final norm and lm_head are always kept.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from anneal.engine.config import ModelConfig, ModelError, config_from_hf
from anneal.engine.presets import is_random, preset_config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2*kv_size, hidden]
    o: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2*intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass
class FoldedLayer:
    """A layer's qkv and gate_up weights with the RMSNorm before each folded in (``W * norm_w``,
    per input column): the ``folded_norm`` fusion projects the un-normalised residual stream."""

    qkv: torch.Tensor
    gate_up: torch.Tensor


FOLDED_FIELDS = ("qkv", "gate_up")  # the layer weights folded_norm keeps folded (FoldedLayer's fields)


@dataclass
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    folded: list[FoldedLayer] | None = None  # made by fold_norms while a plan fuses folded_norm

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def copy_targets(self, field: str) -> list[torch.Tensor]:
        """The tensors a second copy of ``field`` (``plan.WEIGHT_FIELDS``' values) hangs on: lm_head
        itself, or that attribute of every layer; for qkv and gate_up that of every folded layer
        while there are folded weights (``folded_norm`` projects through those)."""
        if field == "lm_head":
            return [self.lm_head]
        if self.folded is not None and field in FOLDED_FIELDS:
            return [getattr(F, field) for F in self.folded]
        return [getattr(L, field) for L in self.layers]

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.final_norm, self.lm_head]
        for L in self.layers:
            out += [L.input_norm, L.qkv, L.o, L.post_norm, L.gate_up, L.down]
            out += [t for t in (L.q_norm, L.k_norm) if t is not None]
        return out


_FOLD_LOCK = threading.Lock()  # the engine thread and compile-ahead passes may ask at once


def fold_norms(w: Weights) -> list[FoldedLayer]:
    """``w``'s folded qkv and gate_up weights, made on first use and kept on ``w`` (another ~50% of
    a Llama layer's bytes: the engine makes them before sizing the KV cache when it starts on such a
    plan, and drops them when it applies a plan without the fusion). Each product is rounded once to
    the weights' dtype. Never inside a CUDA-graph capture: the graph would replay the folding."""
    with _FOLD_LOCK:
        if w.folded is None:
            _check_room(w.embed.device, folded_bytes(w), "folded_norm: the folded weights")
            w.folded = [FoldedLayer(qkv=L.qkv * L.input_norm, gate_up=L.gate_up * L.post_norm) for L in w.layers]
        return w.folded


class FoldError(ValueError):
    """The device has no room for a plan's second copy of weights (folded, fp8 or bf12): the plan is
    refused, nothing changes."""


def set_weight_copies(w: Weights, wanted: dict[str, str], make: bool = True) -> int:
    """Drop every second copy of the layers' projections other than those ``wanted`` (``LayerWeights``
    attribute name -> format, engine/weight_copies.py) and, with ``make``, make the wanted ones that
    do not exist yet, after checking the device has room beside the KV cache. Returns the bytes
    dropped."""
    from anneal.engine import weight_copies
    from anneal.engine.plan import WEIGHT_COPY_IMPLS, WEIGHT_FIELDS

    every, formats = tuple(WEIGHT_FIELDS.values()), sorted(set(WEIGHT_COPY_IMPLS.values()))
    unknown, bad = set(wanted) - set(every), set(wanted.values()) - set(formats)
    if unknown or bad:
        raise ValueError(f"weight copies: unknown projections {sorted(unknown)} / formats {sorted(bad)} "
                         f"(projections: {list(every)}; formats: {formats})")
    freed = sum(weight_copies.drop((t for f in every if wanted.get(f) != fmt for t in w.copy_targets(f)), fmt)
                for fmt in formats)
    if not make:
        return freed
    missing = [(t, fmt) for f, fmt in wanted.items() for t in w.copy_targets(f)
               if not weight_copies.has_copy(t, fmt)]
    if missing:
        _check_room(w.embed.device, sum(weight_copies.copy_bytes(t, fmt) for t, fmt in missing),
                    "weight copies: the copies", what="the weight copies need",
                    copies=f"their {'/'.join(sorted({fmt for _, fmt in missing}))} copies", plan="those projections")
    for t, fmt in missing:
        weight_copies.copy_of(t, fmt)
    return freed


FOLD_HEADROOM = 2 * 2**30  # what the engine keeps for activations and graphs beside its KV cache


def _check_room(dev: torch.device, need: int, name: str, **say: str) -> None:
    """Before a plan's second copy of weights (``need`` bytes) is made on a GPU: never inside a
    CUDA-graph capture (the graph would replay making it), and only with room beside the KV cache
    (FoldError, with ``fold_shortfall``'s reason; ``say``: its wording)."""
    if dev.type != "cuda":
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{name} must be made before a CUDA-graph capture")
    short = fold_shortfall(need, free_memory(dev)[0], **say)
    if short:
        raise FoldError(short)


def free_memory(dev: torch.device) -> tuple[int, int]:
    """Bytes an ordinary allocation on ``dev`` can still get (the driver's free memory and the free
    blocks PyTorch's allocator caches in its default pool, which it hands back to the driver when an
    allocation needs them), and the free bytes cached in CUDA-graph private pools, which only a
    capture into that pool reuses. Counting the latter as room (reserved less allocated) let bf12
    copies start packing with ~10 GiB of graph-pool blocks taken for room, and an H100 ran out of
    memory half-way at ``--gpu-memory-utilization 0.75`` (sessions 49-50; torch's message calls those
    blocks "allocated in private pools")."""
    free, _ = torch.cuda.mem_get_info(dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    default, graphs = cached_free(torch.cuda.memory_snapshot(), index)
    return free + default, graphs


def cached_free(segments: list[dict], device: int) -> tuple[int, int]:
    """Free bytes in ``segments`` (``torch.cuda.memory_snapshot()``) of ``device``: those of the
    allocator's default pool (id ``(0, 0)``), and those of private pools (a graph's has its own id)."""
    default = graphs = 0
    for s in segments:
        if s.get("device", device) != device:
            continue
        free = s["total_size"] - s["active_size"]
        if tuple(s["segment_pool_id"]) == (0, 0):
            default += free
        else:
            graphs += free
    return default, graphs


def fold_shortfall(need: int, free: int, what: str = "folded_norm needs", copies: str = "its folded weights",
                   plan: str = "folded_norm") -> str | None:
    """Why ``need`` bytes of a plan's second copy of weights do not fit in ``free`` (the engine's
    activation headroom kept), or None when they do."""
    if free - need >= FOLD_HEADROOM:
        return None
    gib = 2**30
    return (f"{what} {need / gib:.1f} GiB for {copies} and {FOLD_HEADROOM / gib:.0f} GiB "
            f"beside them; {free / gib:.1f} GiB are free (the KV cache holds the rest): start the engine on a "
            f"plan with {plan} (its KV cache is then sized after them) or give it fewer KV blocks")


def folded_bytes(w: Weights) -> int:
    """Bytes ``fold_norms`` holds (or would hold) for ``w``."""
    return sum((L.qkv.numel() + L.gate_up.numel()) * L.qkv.element_size() for L in w.layers)


def resolve_config(model: str) -> ModelConfig:
    if is_random(model):
        return preset_config(model.split(":", 1)[1])
    return config_from_hf(model)


def _expected_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    p = f"model.layers.{i}."
    shapes = {
        p + "input_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (cfg.q_size, H),
        p + "self_attn.k_proj.weight": (cfg.kv_size, H),
        p + "self_attn.v_proj.weight": (cfg.kv_size, H),
        p + "self_attn.o_proj.weight": (H, cfg.q_size),
        p + "post_attention_layernorm.weight": (H,),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
    }
    if cfg.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (D,)
        shapes[p + "self_attn.k_norm.weight"] = (D,)
    return shapes


class _SafetensorsFolder:
    """Name -> file for a sharded (index.json) or single-file safetensors checkpoint."""

    def __init__(self, folder: Path, device: torch.device):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ModelError(f"{index}: not a valid index file ({e})") from None
            if not isinstance(weight_map, dict):
                raise ModelError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
            weight_map = None
        else:
            found = sorted(p.name for p in folder.glob("*.safetensors"))
            if not found:
                raise ModelError(f"{folder} has no model.safetensors or model.safetensors.index.json")
            files, weight_map = found, None
        self.handles = {}
        for f in files:
            path = folder / f
            if not path.is_file():
                raise ModelError(f"{folder}: shard {f} listed in the index is missing")
            try:
                self.handles[f] = safe_open(str(path), framework="pt", device=str(device))
            except Exception as e:  # safetensors raises its own error type for a bad header
                raise ModelError(f"{path}: not a readable safetensors file ({e})") from None
        self.where: dict[str, str] = {}
        for f, h in self.handles.items():
            for k in h.keys():
                self.where[k] = f
        if weight_map:
            missing = [k for k, f in weight_map.items() if k not in self.where]
            if missing:
                raise ModelError(f"{folder}: tensors listed in the index are missing: {missing[:3]}")
        self.folder = folder

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.where:
            raise ModelError(f"{self.folder}: checkpoint has no tensor {name!r}")
        t = self.handles[self.where[name]].get_tensor(name)
        if tuple(t.shape) != shape:
            raise ModelError(
                f"{self.folder}: tensor {name} has shape {tuple(t.shape)}, config expects {shape}"
            )
        if t.dtype not in DTYPES.values():
            raise ModelError(f"{self.folder}: tensor {name} has unsupported dtype {t.dtype}")
        return t.to(dtype)

    def has(self, name: str) -> bool:
        return name in self.where


def load_hf_weights(
    cfg: ModelConfig, folder: Path, device: torch.device, dtype: torch.dtype, layers: int
) -> Weights:
    st = _SafetensorsFolder(Path(folder), device)
    H, V = cfg.hidden_size, cfg.vocab_size
    embed = st.get("model.embed_tokens.weight", (V, H), dtype)
    out_layers = []
    for i in range(layers):
        shapes = _expected_shapes(cfg, i)
        t = {k.split(f"model.layers.{i}.", 1)[1]: st.get(k, s, dtype) for k, s in shapes.items()}
        out_layers.append(
            LayerWeights(
                input_norm=t["input_layernorm.weight"],
                qkv=torch.cat([t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"],
                               t["self_attn.v_proj.weight"]]),
                o=t["self_attn.o_proj.weight"],
                post_norm=t["post_attention_layernorm.weight"],
                gate_up=torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]),
                down=t["mlp.down_proj.weight"],
                q_norm=t.get("self_attn.q_norm.weight"),
                k_norm=t.get("self_attn.k_norm.weight"),
            )
        )
    final_norm = st.get("model.norm.weight", (H,), dtype)
    if cfg.tie_word_embeddings or not st.has("lm_head.weight"):
        if not cfg.tie_word_embeddings:
            raise ModelError(f"{folder}: untied model has no lm_head.weight")
        lm_head = embed
    else:
        lm_head = st.get("lm_head.weight", (V, H), dtype)
    return Weights(embed=embed, layers=out_layers, final_norm=final_norm, lm_head=lm_head)


def random_weights(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, layers: int, seed: int = 0
) -> Weights:
    """Random weights with the real shapes, made on the device (std 0.02 like HF init).

    Norm weights are drawn around 1 rather than set to 1, so tests exercise them.
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    def norm_w(n: int) -> torch.Tensor:
        return (1.0 + normal(n, std=0.1).float()).to(dtype)

    H, I = cfg.hidden_size, cfg.intermediate_size
    embed = normal(cfg.vocab_size, H)
    out_layers = [
        LayerWeights(
            input_norm=norm_w(H),
            qkv=normal(cfg.q_size + 2 * cfg.kv_size, H),
            o=normal(H, cfg.q_size),
            post_norm=norm_w(H),
            gate_up=normal(2 * I, H),
            down=normal(H, I),
            q_norm=norm_w(cfg.head_dim) if cfg.qk_norm else None,
            k_norm=norm_w(cfg.head_dim) if cfg.qk_norm else None,
        )
        for _ in range(layers)
    ]
    lm_head = embed if cfg.tie_word_embeddings else normal(cfg.vocab_size, H)
    return Weights(embed=embed, layers=out_layers, final_norm=norm_w(H), lm_head=lm_head)


def load_weights(
    model: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
    layers: int | None = None, seed: int = 0,
) -> Weights:
    n = cfg.num_hidden_layers if layers is None else layers
    if not 1 <= n <= cfg.num_hidden_layers:
        raise ModelError(f"--layers {layers}: the model has {cfg.num_hidden_layers} layers")
    with torch.no_grad():
        if is_random(model):
            return random_weights(cfg, device, dtype, n, seed)
        return load_hf_weights(cfg, Path(model), device, dtype, n)
