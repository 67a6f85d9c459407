"""The planning half of the ledger: bytes per token, capacity, fragmentation and sharing.

Pure Python (no torch), so `kvledger plan` answers instantly and the engine, the server and
the simulator can all size the pool from the same arithmetic.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import asdict, dataclass, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from kvledger.errors import ConfigError
from kvledger.ledger.kv_cache_groups import kv_cache_layout

GiB = 1024**3
GB = 1000**3

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}

# KV storage formats: bytes per element of K/V data. fp8 is e4m3; fp8_int8 is K fp8, V int8.
KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "fp8_int8": 1}
QUANTIZED_KV_DTYPES = frozenset({"fp8", "int8", "fp8_int8"})
KV_SCALE_BYTES = 2  # one float16 scale per token per KV head, for K and for V
_MODEL_TO_KV = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


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
        """Read a Hugging Face config.json dict; missing KV heads mean MHA, missing head_dim
        means hidden_size // num_attention_heads, as in transformers."""
        cfg = text_config(cfg)
        layers = _positive_int(cfg, "num_hidden_layers", name)
        heads = _positive_int(cfg, "num_attention_heads", name)
        hidden = _positive_int(cfg, "hidden_size", name)
        vocab = _positive_int(cfg, "vocab_size", name)
        kv_heads = (
            heads
            if cfg.get("num_key_value_heads") is None
            else _positive_int(cfg, "num_key_value_heads", name)
        )
        if cfg.get("head_dim") is None:
            if hidden % heads:
                raise ConfigError(
                    f"{name}: hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads}; set head_dim"
                )
            head_dim = hidden // heads
        else:
            head_dim = _positive_int(cfg, "head_dim", name)
        if heads % kv_heads:
            raise ConfigError(
                f"{name}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        raw_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"  # HF's default
        dtype = _DTYPE_ALIASES.get(str(raw_dtype), str(raw_dtype))
        if dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"{name}: unsupported torch_dtype {raw_dtype!r} "
                f"(expected one of {', '.join(DTYPE_BYTES)})"
            )
        max_pos = (
            None
            if cfg.get("max_position_embeddings") is None
            else _positive_int(cfg, "max_position_embeddings", name)
        )
        inter = (
            None
            if cfg.get("intermediate_size") is None
            else _positive_int(cfg, "intermediate_size", name)
        )
        arch = architecture(cfg) or "LlamaForCausalLM"
        types = layer_types(cfg, arch, layers)
        window = None
        if types is not None:
            window = _positive_int(cfg, "sliding_window", name)
        spec = cls(
            name=name,
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            vocab_size=vocab,
            dtype=dtype,
            max_position_embeddings=max_pos,
            intermediate_size=inter,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            architecture=arch,
            layer_types=types,
            sliding_window=window,
        )
        return replace(spec, num_params=estimate_num_params(spec))


FULL, SLIDING = "full_attention", "sliding_attention"

# config.json "model_type" -> architecture, for configs saved without "architectures".
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Gemma 3, Llava...) keep the language model in text_config."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        return {**cfg, **cfg["text_config"]}
    return cfg


def architecture(cfg: dict[str, Any]) -> str | None:
    """The config's first "architectures" entry, else the one its model_type implies."""
    archs = cfg.get("architectures") or []
    if archs:
        return str(archs[0])
    model_type = cfg.get("model_type")
    return MODEL_TYPES.get(model_type, model_type) if model_type else None


def layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[str, ...] | None:
    """Which layers attend through a sliding window, as transformers decides it; None when no
    layer does (so "no window" has one spelling)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        types = tuple(str(t) for t in types)
        if len(types) != num_layers:
            raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ConfigError(f"unsupported layer type(s) {', '.join(unknown)}; supported: {FULL}, {SLIDING}")
    elif not window:
        return None
    elif arch.startswith("Gemma2"):
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    elif arch.startswith("Gemma3"):
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    elif arch.startswith(("Qwen2", "Qwen3")):
        if not cfg.get("use_sliding_window"):
            return None
        first = int(cfg.get("max_window_layers") or 0)
        types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    else:  # Mistral, Mixtral, Phi-3: every layer, whenever a window is set
        types = (SLIDING,) * num_layers
    if SLIDING not in types or not window:
        return None
    return types


def _positive_int(cfg: dict[str, Any], key: str, name: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{name}: config field {key!r} is missing")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: config field {key!r} must be a positive integer, got {value!r}")
    return value


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
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_path}: malformed JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{config_path}: malformed config, expected a JSON object")
    model_dir = config_path.parent
    spec = ModelSpec.from_hf_config(cfg, name=model_dir.resolve().name or str(config_path))
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        spec = replace(spec, weight_bytes=sum(safetensors_weight_bytes(s) for s in shards))
    return spec


@dataclass(frozen=True)
class KVBytes:
    """KV-cache bytes for one token on one rank, split into K/V data and quantisation scales."""

    kv_dtype: str
    data_bytes: int
    scale_bytes: int

    @property
    def total(self) -> int:
        return self.data_bytes + self.scale_bytes


def resolve_kv_dtype(spec: ModelSpec, kv_dtype: str) -> str:
    if kv_dtype == "auto":
        return _MODEL_TO_KV[spec.dtype]
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(
            f"unknown kv dtype {kv_dtype!r} (expected auto, {', '.join(KV_DTYPE_BYTES)})"
        )
    return kv_dtype


def kv_heads_per_rank(spec: ModelSpec, tp: int = 1) -> int:
    """KV heads are split across TP ranks, and replicated once tp exceeds them."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    if spec.num_attention_heads % tp:
        raise ConfigError(
            f"tp={tp} does not divide {spec.name}'s {spec.num_attention_heads} attention heads"
        )
    return math.ceil(spec.num_kv_heads / tp)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "auto", tp: int = 1) -> KVBytes:
    """2 (K and V) x layers x KV heads per rank x head_dim x element bytes, plus for quantised
    formats a float16 scale per token per KV head for K and for V."""
    name = resolve_kv_dtype(spec, kv_dtype)
    heads = kv_heads_per_rank(spec, tp)
    data = 2 * spec.num_layers * heads * spec.head_dim * KV_DTYPE_BYTES[name]
    scales = 2 * spec.num_layers * heads * KV_SCALE_BYTES if name in QUANTIZED_KV_DTYPES else 0
    return KVBytes(name, data, scales)


def window_blocks(context_len: int, window: int, block_size: int) -> int:
    """Blocks a sliding-window layer holds for a context_len-token request when blocks wholly
    outside the window are released (the rule of KVCacheManager): at the step that computes
    the last token, from the first block its query sees to the block being written."""
    total = math.ceil(context_len / block_size)
    first = max(0, context_len - 1 - window + 1) // block_size
    return total - first


@dataclass(frozen=True)
class RequestKV:
    """KV bytes one request of ``context_len`` tokens holds, per layer type, in whole blocks.

    Full-attention layers grow with the context; sliding-window layers stop at their window
    when blocks outside it are freed (``with_window_freeing``), else grow like full ones.
    ``pool_bytes`` is what kvledger's pool holds: its KV cache groups
    (kvledger.ledger.kv_cache_groups) of ``group_size`` layers each, a padded last group included.
    """

    context_len: int
    block_size: int
    full_layers: int
    sliding_layers: int
    window: int | None
    layer_bytes_per_token: int  # one layer's K + V (+ scales) per token
    window_freeing: bool  # whether kvledger's own block manager frees them for this model
    group_size: int = 0  # layers per pool block (0: every layer, one group)
    full_groups: int = 1
    sliding_groups: int = 0

    @property
    def full_blocks(self) -> int:
        return math.ceil(self.context_len / self.block_size)

    @property
    def sliding_blocks(self) -> int:
        if self.window is None:
            return self.full_blocks
        return window_blocks(self.context_len, self.window, self.block_size)

    @property
    def bytes_without_window_freeing(self) -> int:
        layers = self.full_layers + self.sliding_layers
        return self.full_blocks * self.block_size * layers * self.layer_bytes_per_token

    @property
    def bytes_with_window_freeing(self) -> int:
        per_block = self.block_size * self.layer_bytes_per_token
        return (self.full_blocks * self.full_layers + self.sliding_blocks * self.sliding_layers) * per_block

    @property
    def pool_blocks(self) -> int:
        """Pool blocks the request holds over its groups (each block: group_size layers)."""
        if not self.window_freeing:
            return self.full_blocks
        return self.full_blocks * self.full_groups + self.sliding_blocks * self.sliding_groups

    @property
    def pool_block_bytes(self) -> int:
        layers = self.group_size or self.full_layers + self.sliding_layers
        return self.block_size * layers * self.layer_bytes_per_token

    @property
    def bytes(self) -> int:
        """What kvledger's pool holds for this request."""
        return self.pool_blocks * self.pool_block_bytes

    @property
    def asymptotic_bytes_per_token(self) -> int:
        """Per-token cost of a very long request: full layers only, windows are a constant."""
        return self.full_layers * self.layer_bytes_per_token

    @property
    def bytes_per_token_at_context(self) -> float:
        """bytes_with_window_freeing / context_len: a function of the context length."""
        return self.bytes_with_window_freeing / self.context_len


def request_kv(
    spec: ModelSpec, context_len: int, block_size: int = 16, kv_dtype: str = "auto", tp: int = 1
) -> RequestKV:
    """The per-layer-type KV of one context_len request (see RequestKV)."""
    per_layer = kv_bytes_per_token(spec, kv_dtype, tp).total // spec.num_layers
    layout = kv_cache_layout(spec.layer_windows)
    full_groups = sum(g.sliding_window is None for g in layout.groups)
    return RequestKV(
        context_len=context_len,
        block_size=block_size,
        full_layers=spec.num_full_layers,
        sliding_layers=spec.num_sliding_layers,
        window=spec.sliding_window if spec.num_sliding_layers else None,
        layer_bytes_per_token=per_layer,
        window_freeing=spec.num_sliding_layers > 0,
        group_size=layout.group_size,
        full_groups=full_groups,
        sliding_groups=len(layout.groups) - full_groups,
    )


def per_request_overhead_bytes(
    spec: ModelSpec, kv_dtype: str, kv_sink_tokens: int, kv_recent_tokens: int, tp: int = 1
) -> int:
    """Quantised caches also keep each request's sink and recent-window tokens in the model
    dtype, outside the blocks; unquantised caches need no such copy."""
    if kv_sink_tokens < 0 or kv_recent_tokens < 0:
        raise ConfigError("kv_sink_tokens and kv_recent_tokens must be >= 0")
    if resolve_kv_dtype(spec, kv_dtype) not in QUANTIZED_KV_DTYPES:
        return 0
    return (kv_sink_tokens + kv_recent_tokens) * kv_bytes_per_token(spec, "auto", tp).total


class DoesNotFitError(ConfigError):
    """Weights plus one context-length request exceed the memory given; more TP may help."""


@dataclass(frozen=True)
class CapacityPlan:
    """How one rank's memory divides into weights and KV blocks, and what that buys."""

    model: str
    kv_dtype: str
    tp: int
    block_size: int
    context_len: int
    device_memory_bytes: int
    memory_fraction: float
    kv_heads_per_rank: int
    data_bytes_per_token: int
    scale_bytes_per_token: int
    bytes_per_token: int  # per rank
    model_bytes_per_token: int  # the whole model (all KV heads once), what tp=1 would hold
    bytes_per_block: int
    weight_bytes: int  # per rank
    weight_source: str  # "override", "checkpoint" or "num_params"
    activation_reserve_bytes: int
    kv_budget_bytes: int
    num_blocks: int  # the pool if the whole budget goes to blocks
    max_tokens: int
    blocks_per_request: int  # for one context_len request
    per_request_overhead_bytes: int  # sink/recent copies for quantised KV, from the same budget
    max_concurrency: int  # context_len requests that fit at once (in kvledger's pool)
    # Per layer type (issue 20): full layers charge every token, sliding layers their window.
    num_full_layers: int = 0
    num_sliding_layers: int = 0
    sliding_window: int | None = None
    window_freeing: bool = False  # kvledger's block manager frees blocks outside the window
    asymptotic_bytes_per_token: int = 0  # per token of a very long request (full layers only)
    bytes_per_token_at_context: float = 0.0  # KV of one context_len request / context_len
    request_bytes_with_window_freeing: int = 0
    request_bytes_without_window_freeing: int = 0
    max_concurrency_with_window_freeing: int = 0
    max_concurrency_without_window_freeing: int = 0
    # kvledger's pool (kvledger.ledger.kv_cache_groups): a block holds group_size layers; a
    # request has a block table in each of the full and sliding groups.
    group_size: int = 0
    num_full_groups: int = 1
    num_sliding_groups: int = 0

    def request_cost_bytes(self, num_tokens: int) -> int:
        """Paged cost of a num_tokens request in the pool: whole blocks, the last one possibly
        partial, in every KV cache group; a sliding group holds only its window's blocks."""
        full = math.ceil(num_tokens / self.block_size)
        sliding = full
        if self.window_freeing and self.sliding_window:
            sliding = window_blocks(num_tokens, self.sliding_window, self.block_size)
        return (full * self.num_full_groups + sliding * self.num_sliding_groups) * self.bytes_per_block

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_capacity(
    spec: ModelSpec,
    device_memory_bytes: int,
    memory_fraction: float = 0.9,
    weight_bytes: int | None = None,
    tp: int = 1,
    block_size: int = 16,
    context_len: int | None = None,
    kv_dtype: str = "auto",
    activation_reserve_bytes: int = 0,
    kv_sink_tokens: int = 4,
    kv_recent_tokens: int = 0,
) -> CapacityPlan:
    """Per-rank budget = device x fraction - weights/tp - reserve, carved into blocks; raises
    ConfigError (with the shortfall in GiB) when not even one context_len request fits."""
    if device_memory_bytes <= 0:
        raise ConfigError(f"device memory must be positive, got {device_memory_bytes}")
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    if block_size <= 0:
        raise ConfigError(f"block size must be positive, got {block_size}")
    if activation_reserve_bytes < 0:
        raise ConfigError(f"activation reserve must be >= 0, got {activation_reserve_bytes}")
    context_len = context_len if context_len is not None else spec.max_position_embeddings or 4096
    if context_len <= 0:
        raise ConfigError(f"context length must be positive, got {context_len}")
    if spec.max_position_embeddings and context_len > spec.max_position_embeddings:
        raise ConfigError(
            f"context length {context_len} exceeds {spec.name}'s "
            f"max_position_embeddings {spec.max_position_embeddings}"
        )
    kv = kv_bytes_per_token(spec, kv_dtype, tp)
    if weight_bytes is not None:
        if weight_bytes <= 0:
            raise ConfigError(f"weight bytes must be positive, got {weight_bytes}")
        total_weights, source = weight_bytes, "override"
    elif spec.weight_bytes is not None:
        total_weights, source = spec.weight_bytes, "checkpoint"
    elif spec.num_params is not None:
        total_weights, source = spec.num_params * spec.dtype_bytes, "num_params"
    else:
        raise ConfigError(
            f"{spec.name}: parameter count unknown (no intermediate_size or "
            "checkpoint); pass the weight size explicitly (--weight-bytes)"
        )
    weights = math.ceil(total_weights / tp)
    overhead = per_request_overhead_bytes(spec, kv_dtype, kv_sink_tokens, kv_recent_tokens, tp)
    req_kv = request_kv(spec, context_len, block_size, kv_dtype, tp)
    # The pool's block: every layer, or a KV cache group's layers for a hybrid model.
    bytes_per_block = req_kv.pool_block_bytes
    blocks_per_request = req_kv.pool_blocks
    request_bytes = req_kv.bytes + overhead
    budget = int(device_memory_bytes * memory_fraction) - weights - activation_reserve_bytes
    if budget < request_bytes:
        raise DoesNotFitError(
            f"{spec.name} does not fit: {weights / GiB:.2f} GiB of weights per rank leave "
            f"{budget / GiB:.2f} GiB for KV cache, short by {(request_bytes - budget) / GiB:.2f} "
            f"GiB for one {context_len}-token request (try more tp, a shorter context or a "
            "quantised kv dtype)"
        )
    num_blocks = budget // bytes_per_block
    return CapacityPlan(
        model=spec.name,
        kv_dtype=kv.kv_dtype,
        tp=tp,
        block_size=block_size,
        context_len=context_len,
        device_memory_bytes=device_memory_bytes,
        memory_fraction=memory_fraction,
        kv_heads_per_rank=kv_heads_per_rank(spec, tp),
        data_bytes_per_token=kv.data_bytes,
        scale_bytes_per_token=kv.scale_bytes,
        bytes_per_token=kv.total,
        model_bytes_per_token=kv_bytes_per_token(spec, kv_dtype, 1).total,
        bytes_per_block=bytes_per_block,
        weight_bytes=weights,
        weight_source=source,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_budget_bytes=budget,
        num_blocks=num_blocks,
        max_tokens=num_blocks * block_size,
        blocks_per_request=blocks_per_request,
        per_request_overhead_bytes=overhead,
        max_concurrency=budget // request_bytes,
        num_full_layers=req_kv.full_layers,
        num_sliding_layers=req_kv.sliding_layers,
        sliding_window=req_kv.window,
        window_freeing=req_kv.window_freeing,
        asymptotic_bytes_per_token=req_kv.asymptotic_bytes_per_token,
        bytes_per_token_at_context=req_kv.bytes_per_token_at_context,
        request_bytes_with_window_freeing=req_kv.bytes_with_window_freeing,
        request_bytes_without_window_freeing=req_kv.bytes_without_window_freeing,
        max_concurrency_with_window_freeing=budget // (req_kv.bytes_with_window_freeing + overhead),
        max_concurrency_without_window_freeing=budget // (req_kv.bytes_without_window_freeing + overhead),
        group_size=req_kv.group_size,
        num_full_groups=req_kv.full_groups,
        num_sliding_groups=req_kv.sliding_groups,
    )


def naive_vs_paged(
    lengths: list[int], max_seq_len: int, block_size: int, bytes_per_token: int
) -> dict[str, Any]:
    """Contiguous allocation reserves max_seq_len per request; paging reserves whole blocks, so
    it wastes less than one block per request (and no more than naive when max_seq_len is a
    multiple of block_size)."""
    if not lengths:
        raise ConfigError("no request lengths given")
    if max_seq_len <= 0 or block_size <= 0 or bytes_per_token <= 0:
        raise ConfigError("max_seq_len, block_size and bytes_per_token must be positive")
    for n in lengths:
        if not 0 < n <= max_seq_len:
            raise ConfigError(f"request length {n} is outside 1..max_seq_len ({max_seq_len})")
    used = sum(lengths)
    naive = len(lengths) * max_seq_len
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths)
    return {
        "num_requests": len(lengths),
        "total_tokens": used,
        "max_seq_len": max_seq_len,
        "block_size": block_size,
        "naive_reserved_tokens": naive,
        "paged_reserved_tokens": paged,
        "naive_reserved_bytes": naive * bytes_per_token,
        "paged_reserved_bytes": paged * bytes_per_token,
        "naive_waste_tokens": naive - used,
        "paged_waste_tokens": paged - used,
        "naive_waste_bytes": (naive - used) * bytes_per_token,
        "paged_waste_bytes": (paged - used) * bytes_per_token,
        "max_paged_waste_tokens_per_request": max(-n % block_size for n in lengths),
        "naive_utilization": used / naive,
        "paged_utilization": used / paged,
    }


def prefix_sharing_savings(
    spec: ModelSpec,
    prefix_len: int,
    num_requests: int,
    kv_dtype: str = "auto",
    block_size: int = 16,
) -> dict[str, Any]:
    """KV bytes of a prompt prefix held by num_requests requests, each with its own copy vs
    sharing its full blocks (a partial last block stays private, as in a hashed block pool)."""
    if prefix_len <= 0 or num_requests <= 0 or block_size <= 0:
        raise ConfigError("prefix_len, num_requests and block_size must be positive")
    bytes_per_block = kv_bytes_per_token(spec, kv_dtype).total * block_size
    full, partial = divmod(prefix_len, block_size)
    without = num_requests * math.ceil(prefix_len / block_size) * bytes_per_block
    with_sharing = (full + num_requests * (1 if partial else 0)) * bytes_per_block
    return {
        "prefix_len": prefix_len,
        "num_requests": num_requests,
        "block_size": block_size,
        "bytes_without_sharing": without,
        "bytes_with_sharing": with_sharing,
        "bytes_saved": without - with_sharing,
        "ratio": without / with_sharing,
        "gb_without_sharing": without / GB,
        "gb_with_sharing": with_sharing / GB,
        "gib_without_sharing": without / GiB,
        "gib_with_sharing": with_sharing / GiB,
    }


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """'80GiB' (binary), '80GB' (decimal), '123' (bytes). Bare 'G'/'M' are rejected: the
    7% difference between GiB and GB is exactly what a capacity plan must not blur."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"size must be >= 0, got {text}")
        return text
    if str(text).strip().startswith("-"):
        raise ConfigError(f"size must not be negative, got {text!r}")
    m = _SIZE_RE.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        hint = (
            " (ambiguous: write GiB for 2**30 or GB for 10**9)"
            if m and unit in {"k", "m", "g", "t"}
            else ""
        )
        raise ConfigError(f"invalid size {text!r}{hint}; use e.g. 80GiB, 80GB, 512MiB or bytes")
    try:
        value = Decimal(m.group(1)) * _SIZE_UNITS[unit]
    except InvalidOperation:
        raise ConfigError(f"invalid size {text!r}") from None
    if value != value.to_integral_value() and unit in {"", "b"}:
        raise ConfigError(f"invalid size {text!r}: a byte count must be a whole number")
    return int(value)


def format_bytes(n: float) -> str:
    """Both conventions side by side, e.g. '74.51 GiB (80.00 GB)': vendors quote GB, torch GiB."""
    k = 0
    while k < 4 and abs(n) >= 1024 ** (k + 1):
        k += 1
    if k == 0:
        return f"{int(n):,} B"
    binary, decimal = [("KiB", "KB"), ("MiB", "MB"), ("GiB", "GB"), ("TiB", "TB")][k - 1]
    return f"{n / 1024**k:.2f} {binary} ({n / 1000**k:.2f} {decimal})"
