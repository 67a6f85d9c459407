"""What the ledger knows of a model: its shape (ModelSpec), the presets ``kvledger plan`` offers,
and a model folder's spec with its checkpoint's weight bytes.

Pure Python (no torch); config.json is read by kvledger.hf.config, the loader's own reading.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvledger.errors import ConfigError
from kvledger.hf.config import FULL, SLIDING, model_shape, read_json

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # each of kvledger.hf.config.DTYPES


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as memory accounting needs it."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_params: int | None = None
    dtype: str = "bfloat16"
    max_position_embeddings: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    weight_bytes: int | None = None  # measured from a safetensors checkpoint, when there is one
    # Per layer: "full_attention" or "sliding_attention" (None: every layer full). A sliding
    # layer attends to its last `sliding_window` tokens only, so it never needs more KV.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    @property
    def num_sliding_layers(self) -> int:
        if not self.layer_types or not self.sliding_window:
            return 0
        return sum(t == SLIDING for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's window (None: full attention)."""
        if not self.num_sliding_layers:
            return [None] * self.num_layers
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has one: then the block manager itself can release
        blocks outside it (one block holds every layer's K/V, see KVCacheManager)."""
        return self.sliding_window if self.num_sliding_layers == self.num_layers else None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelSpec:
        """A config.json dict's spec (kvledger.hf.config.model_shape reads it), with the
        parameter count its shape implies."""
        shape = model_shape(cfg, name)
        spec = cls(**{f.name: getattr(shape, f.name) for f in fields(shape)})
        return replace(spec, num_params=estimate_num_params(spec))


def estimate_num_params(spec: ModelSpec) -> int | None:
    """Llama-family parameter count (embeddings, attention, SwiGLU MLP, RMSNorms); exact for
    Llama/Mistral, within 0.01% for Qwen2 (no qkv biases). None without intermediate_size."""
    if spec.intermediate_size is None:
        return None
    h, q, kv = (
        spec.hidden_size,
        spec.num_attention_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
    )
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * spec.intermediate_size + 2 * h
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return embeddings + spec.num_layers * per_layer + h


def _preset(
    name: str,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    vocab: int,
    inter: int,
    params: int | None,
    dtype: str,
    max_pos: int,
) -> ModelSpec:
    spec = ModelSpec(
        name, layers, heads, kv_heads, head_dim, hidden, vocab, params, dtype, max_pos, inter
    )
    return spec if params is not None else replace(spec, num_params=estimate_num_params(spec))


def _with_windows(spec: ModelSpec, window: int, pattern: int, **kw: Any) -> ModelSpec:
    types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(spec.num_layers))
    spec = replace(spec, layer_types=types, sliding_window=window, **kw)
    return replace(spec, num_params=estimate_num_params(spec))


_GEMMA3_27B = _with_windows(
    _preset("gemma-3-27b", 62, 32, 16, 128, 5376, 262208, 21504, None, "bfloat16", 131072),
    1024,
    6,
    architecture="Gemma3ForCausalLM",
    tie_word_embeddings=True,
)

_SEED_70B = _preset("seed-70b", 80, 64, 8, 128, 8192, 32000, 28672, 70_000_000_000, "float16", 4096)

PRESETS: dict[str, ModelSpec] = {
    # The seed article's example: 70B, 80 layers, GQA-8, fp16, 140 GB of weights.
    "seed-70b": _SEED_70B,
    "seed-70b-mha": replace(_SEED_70B, name="seed-70b-mha", num_kv_heads=64),
    "seed-70b-mqa": replace(_SEED_70B, name="seed-70b-mqa", num_kv_heads=1),
    # Published Hugging Face configs and parameter counts.
    "llama-3-8b": _preset(
        "llama-3-8b", 32, 32, 8, 128, 4096, 128256, 14336, 8_030_261_248, "bfloat16", 8192
    ),
    "llama-3-70b": _preset(
        "llama-3-70b", 80, 64, 8, 128, 8192, 128256, 28672, 70_553_706_496, "bfloat16", 8192
    ),
    "qwen2.5-7b": replace(
        _preset(
            "qwen2.5-7b", 28, 28, 4, 128, 3584, 152064, 18944, 7_615_616_512, "bfloat16", 32768
        ),
        architecture="Qwen2ForCausalLM",
    ),
    "mistral-7b": replace(
        _preset("mistral-7b", 32, 32, 8, 128, 4096, 32000, 14336, 7_241_732_096, "bfloat16", 32768),
        architecture="MistralForCausalLM",
    ),
    # Gemma 3 27B's language model: 62 layers, five 1024-token sliding-window layers per global
    # one (layer_types as transformers derives them from sliding_window_pattern 6).
    "gemma-3-27b": _GEMMA3_27B,
    # The engine's embedded default model (random weights); the engine builds exactly this.
    "kvledger-tiny": _preset("kvledger-tiny", 4, 8, 2, 32, 256, 512, 688, None, "float32", 2048),
}


def safetensors_weight_bytes(path: str | Path) -> int:
    """Bytes of all tensors in one .safetensors file, from its header only (no tensor is loaded):
    8-byte little-endian header length, then JSON whose data_offsets give each tensor's bytes."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > path.stat().st_size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size")
            header = json.loads(f.read(header_len))
        return sum(
            end - start
            for key, meta in header.items()
            if key != "__metadata__"
            for start, end in [meta["data_offsets"]]
        )
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, a model folder with config.json, or a config.json path. Weights found as
    *.safetensors next to the config set weight_bytes from the checkpoint itself."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{path}: folder has no config.json")
    elif path.is_file():
        config_path = path
    else:
        raise ConfigError(
            f"unknown model {name_or_path!r}: not a folder or config.json, and not a "
            f"preset (presets: {', '.join(PRESETS)})"
        )
    cfg = read_json(config_path)
    model_dir = config_path.parent
    spec = ModelSpec.from_hf_config(cfg, name=model_dir.resolve().name or str(config_path))
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        spec = replace(spec, weight_bytes=sum(safetensors_weight_bytes(s) for s in shards))
    return spec
