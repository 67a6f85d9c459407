"""A Hugging Face model folder's configuration, read in one place.

config.json gives the text model (inside a multimodal wrapper's text_config), its architecture,
its shape (``model_shape``: what the planner, the ledger and the engine size memory from), its
per-layer attention types and window, and the rest of what the model is built from
(``model_config_from_hf``: RoPE, norms, soft-caps, experts, refusing what is not implemented by
name) and its quantization; generation_config.json gives the stop ids and sampling defaults.

Torch-free, so ``kvledger plan`` reads a checkpoint exactly as the loader does without importing
torch. Every reader raises ConfigError with the field and the file or model it concerns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.errors import ConfigError, UnsupportedArchitectureError

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
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Pooling checkpoints of these families: transformers' ``*ForSequenceClassification`` (the
# decoder plus a ``score`` head) and the bare decoder (``LlamaModel``, ``Qwen3Model``: common for
# embedders, saved without the ``model.`` prefix). They are the same network with another head.
HEADS = {"ForCausalLM": "lm", "ForSequenceClassification": "classify", "Model": "none"}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Model dtypes kvledger runs, and the other spellings configs and users give them.
DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

SUPPORTED_QUANTIZATION = ("fp8", "gptq", "awq", "compressed-tensors")


# ------------------------------------------------------------------------------------- files
def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a model folder (config.json, generation_config.json)."""
    if not path.is_file():
        raise ConfigError(f"missing {path.name} in model folder {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: malformed config, expected a JSON object")
    return data


# ---------------------------------------------------------------------------- the config dict
def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Gemma 3, Llava...) keep the language model in text_config."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        return {**cfg, **cfg["text_config"]}
    return cfg


def architecture(cfg: dict[str, Any]) -> str | None:
    """The config's first "architectures" entry, else the one its model_type implies; a
    supported family's classification or headless class reads as its ``*ForCausalLM`` (the
    network is the same; ``model_head`` tells the head)."""
    archs = cfg.get("architectures") or []
    if archs:
        return _split_head(str(archs[0]))[0]
    model_type = cfg.get("model_type")
    return MODEL_TYPES.get(model_type, model_type) if model_type else None


def _split_head(arch: str) -> tuple[str, str]:
    """("QwenXForCausalLM", head) for a supported family's class with any of ``HEADS``."""
    for suffix, head in HEADS.items():
        base = arch.removesuffix(suffix)
        if base != arch and f"{base}ForCausalLM" in SUPPORTED_ARCHITECTURES:
            return f"{base}ForCausalLM", head
    return arch, "lm"


def model_head(cfg: dict[str, Any]) -> str:
    """What sits on the decoder: "lm" (an LM head), "classify" (a ``score`` head of
    ``num_labels`` rows, transformers' ``*ForSequenceClassification``) or "none"."""
    archs = cfg.get("architectures") or []
    return _split_head(str(archs[0]))[1] if archs else "lm"


SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")


def seq_cls_method(cfg: dict[str, Any]) -> str | None:
    """How a head is built from LM-head rows (vLLM's ``classifier_from_token`` with ``method``;
    ``is_original_qwen3_reranker`` means from_2_way_softmax); None without such tokens."""
    tokens = cfg.get("classifier_from_token")
    if not tokens:
        return None
    method = "from_2_way_softmax" if cfg.get("is_original_qwen3_reranker") else cfg.get("method")
    if method not in SEQ_CLS_METHODS:
        raise ConfigError(f"classifier_from_token needs method one of {', '.join(SEQ_CLS_METHODS)}; got {method!r}")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ConfigError(f"from_2_way_softmax needs two classifier_from_token entries (no, yes); got {tokens}")
    return method


def num_labels(cfg: dict[str, Any]) -> int:
    """A classifier's label count as transformers reads it: ``id2label``'s size, else
    ``num_labels``, else its default of 2; a head from LM-head tokens has one per token (one
    for from_2_way_softmax)."""
    method = seq_cls_method(cfg)
    if method is not None:
        return 1 if method == "from_2_way_softmax" else len(cfg["classifier_from_token"])
    if isinstance(cfg.get("id2label"), dict) and cfg["id2label"]:
        return len(cfg["id2label"])
    return int(cfg.get("num_labels") or 2)


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


def dtype_name(name: str) -> str | None:
    """The canonical name of a model dtype spelling ("bf16", "torch.bfloat16", "half"...), or
    None where kvledger does not run it."""
    name = str(name).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    return name if name in DTYPES else None


def config_dtype(cfg: dict[str, Any]) -> str:
    """The checkpoint's dtype as config.json spells it (torch_dtype, or transformers 5's dtype);
    float32, transformers' default, when it says nothing."""
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")


def _positive_int(cfg: dict[str, Any], key: str, name: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{name}: config field {key!r} is missing")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: config field {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_positive_int(cfg: dict[str, Any], key: str, name: str) -> int | None:
    return None if cfg.get(key) is None else _positive_int(cfg, key, name)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape as config.json states it: what memory accounting
    needs (ledger.spec.ModelSpec adds parameter and weight counts to it)."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_position_embeddings: int | None
    intermediate_size: int | None
    tie_word_embeddings: bool
    architecture: str
    # Per layer: FULL or SLIDING (None: every layer full); a sliding layer attends to its last
    # sliding_window tokens only.
    layer_types: tuple[str, ...] | None
    sliding_window: int | None


def model_shape(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """Read a config.json dict's shape, for any architecture; missing KV heads mean MHA, a
    missing head_dim means hidden_size // num_attention_heads, as in transformers."""
    cfg = text_config(cfg)
    layers = _positive_int(cfg, "num_hidden_layers", name)
    heads = _positive_int(cfg, "num_attention_heads", name)
    hidden = _positive_int(cfg, "hidden_size", name)
    vocab = _positive_int(cfg, "vocab_size", name)
    kv_heads = _optional_positive_int(cfg, "num_key_value_heads", name) or heads
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
    raw_dtype = config_dtype(cfg)
    dtype = _DTYPE_ALIASES.get(raw_dtype, raw_dtype)
    if dtype not in DTYPES:
        raise ConfigError(
            f"{name}: unsupported torch_dtype {raw_dtype!r} (expected one of {', '.join(DTYPES)})"
        )
    arch = architecture(cfg) or "LlamaForCausalLM"
    types = layer_types(cfg, arch, layers)
    return ModelShape(
        name=name,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        vocab_size=vocab,
        dtype=dtype,
        max_position_embeddings=_optional_positive_int(cfg, "max_position_embeddings", name),
        intermediate_size=_optional_positive_int(cfg, "intermediate_size", name),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=arch,
        layer_types=types,
        sliding_window=None if types is None else _positive_int(cfg, "sliding_window", name),
    )


# ------------------------------------------------------------------------- the model's facts
@dataclass
class ModelConfig:
    """The architecture facts the model is built from, normalised from config.json by
    model_config_from_hf (the shape fields are model_shape's, the same reading the ledger uses)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": ..., parameters}; None for default RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm on q and k before RoPE
    layer_types: tuple[str, ...] | None = None  # None: every layer full attention
    sliding_window: int | None = None
    # Sliding layers' own RoPE (Gemma 3's local base); None: the same RoPE as full layers.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini); None: head_dim
    hidden_act: str = "silu"
    norm_unit_offset: bool = False  # Gemma: RMSNorm scale is (1 + w)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of attention scores
    final_softcap: float | None = None  # Gemma 2/3: tanh soft-capping of the logits
    num_experts: int = 0  # > 0: sparse MoE MLP (Mixtral, Qwen3-MoE)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] | None = None  # which layers are sparse (None: all, with experts)
    head: str = "lm"  # hf.config.HEADS: "lm", "classify" (``score``, num_labels rows) or "none"
    num_labels: int = 0

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types and self.sliding_window and self.layer_types[layer] == SLIDING)

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])


def rope_params(
    cfg: dict[str, Any], params: dict[str, Any] | None = None, default_theta: float = 10000.0
) -> tuple[float, dict | None]:
    """(theta, scaling or None) from either transformers 5's rope_parameters or the older
    rope_theta + rope_scaling pair; scaling keeps its rope_type and the keys that type needs."""
    if params is None:
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta") or cfg.get("rope_theta") or default_theta
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    scaling = {**params, "rope_type": rope_type}
    if "original_max_position_embeddings" not in scaling and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    missing = [k for k in _ROPE_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"{rope_type} rope scaling is missing {', '.join(missing)}")
    return float(theta), scaling


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict | None, float, dict | None]:
    """Gemma 3: full layers' (theta, scaling), then sliding layers' own (theta, scaling)."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        theta, scaling = rope_params(cfg, params.get(FULL) or {}, 1_000_000.0)
        local_theta, local_scaling = rope_params({}, params.get(SLIDING) or {}, 10_000.0)
        return theta, scaling, local_theta, local_scaling
    # Older configs: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq.
    theta, scaling = rope_params(cfg, cfg.get("rope_scaling") or {}, 1_000_000.0)
    return theta, scaling, float(cfg.get("rope_local_base_freq") or 10_000.0), None


def _check_supported(cfg: dict[str, Any]) -> tuple[str, str]:
    """(architecture, hidden activation), refusing what kvledger does not implement by name."""
    arch = architecture(cfg) or "<none>"
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = ""
        if arch.endswith("ForConditionalGeneration"):
            hint = " (multimodal checkpoints are not loaded; use the text-only model)"
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch}{hint}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gemma = arch in _GEMMA
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    allowed = ("gelu_pytorch_tanh", "gelu_tanh", "gelu") if gemma else ("silu",)
    if act not in allowed:
        raise ConfigError(f"unsupported hidden_act {act!r} for {arch}; implemented: {', '.join(allowed)}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{arch}: use_bidirectional_attention is not supported (decoder only)")
    return arch, act


def _moe_facts(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """The sparse-MLP fields of ModelConfig (all zero/None for a dense model)."""
    if arch not in _MOE:
        return {}
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if num_experts <= 0 or not cfg.get("num_experts_per_tok"):
        raise ConfigError(f"{arch} config lacks num_local_experts/num_experts or num_experts_per_tok")
    moe_layers = None
    if arch == "Qwen3MoeForCausalLM":
        if not cfg.get("moe_intermediate_size"):
            raise ConfigError("Qwen3MoeForCausalLM config lacks 'moe_intermediate_size'")
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_layers": moe_layers,
    }


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Validate a config.json dict for the architectures kvledger implements and normalise it;
    the shape is model_shape's, so the model is built on the planner's own reading."""
    cfg = text_config(cfg)
    arch, act = _check_supported(cfg)
    spec = model_shape(cfg, name=arch)
    gemma = arch in _GEMMA
    try:
        local_theta = local_scaling = None
        if arch == "Gemma3ForCausalLM":
            theta, scaling, local_theta, local_scaling = _gemma3_rope(cfg)
        else:
            theta, scaling = rope_params(cfg)
        partial = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                        or cfg.get("partial_rotary_factor") or 1.0)
        # Qwen2 always has q/k/v biases; these families never read the config's attention_bias.
        attention_bias = bool(cfg.get("attention_bias") or False) and arch not in (
            "Qwen2ForCausalLM", "Phi3ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"
        )
        moe = _moe_facts(cfg, arch, spec.num_layers)
        query_scalar = cfg.get("query_pre_attn_scalar")
        return ModelConfig(
            architecture=arch,
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=spec.num_layers,
            num_heads=spec.num_attention_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=spec.tie_word_embeddings,
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias") or False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            layer_types=spec.layer_types,
            sliding_window=spec.sliding_window,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            rotary_dim=int(spec.head_dim * partial) if partial != 1.0 else None,
            hidden_act=act,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            embed_scale=spec.hidden_size**0.5 if gemma else None,
            attn_scale=float(query_scalar) ** -0.5 if gemma and query_scalar else None,
            attn_softcap=(cfg.get("attn_logit_softcapping") or None) if arch == "Gemma2ForCausalLM" else None,
            final_softcap=(cfg.get("final_logit_softcapping") or None) if gemma else None,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]) if cfg.get("moe_intermediate_size") else None,
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob")),
            head=model_head(cfg),
            num_labels=num_labels(cfg) if model_head(cfg) == "classify" else 0,
            **moe,
        )
    except KeyError as e:
        raise ConfigError(f"config.json for {arch} lacks {e.args[0]!r}") from e


def quantization_method(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's quantization method if it has one we can load; ConfigError otherwise."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ConfigError("config.json's quantization_config is not an object")
    method = str(q.get("quant_method") or q.get("quantization_method") or "unknown").lower()
    if method not in SUPPORTED_QUANTIZATION:
        raise ConfigError(
            f"quantization_config method {method!r} is not supported: kvledger loads unquantised "
            "checkpoints, FP8 ones (quant_method 'fp8', dequantised on load) and 4-bit GPTQ / AWQ "
            "ones; use one of those for this model"
        )
    if method in ("gptq", "awq"):
        _check_packed_int4({**q, "quant_method": method})
        return method
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(q)
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise ConfigError(f"fp8 quantization_config fmt {fmt!r} is not supported (e4m3, e5m2)")
    return method


def _compressed_tensors_scheme(q: dict[str, Any]) -> str:
    """llm-compressor's compressed-tensors checkpoints kvledger runs: INT8 W8A8 (int8 weights with
    a scale per output channel, int8 activations quantised per token at run time, symmetric) ->
    "w8a8-int8", run as they are (model/quant_int8.py); FP8 weights (a scale per tensor or per
    channel) -> "fp8", dequantised on load as FP8 checkpoints are. Anything else is named."""
    fmt = str(q.get("format", ""))
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    kinds = set()
    for name, g in groups.items():
        w, a = (g or {}).get("weights") or {}, (g or {}).get("input_activations")
        wtype, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if wtype == "int" and bits == 8 and strategy == "channel" and w.get("symmetric", True):
            if not (a and a.get("type") == "int" and a.get("num_bits") == 8 and a.get("dynamic")
                    and a.get("strategy") == "token" and a.get("symmetric", True)):
                raise ConfigError(
                    f"compressed-tensors group {name}: int8 weights need dynamic per-token symmetric int8 "
                    f"activations (W8A8), got {a!r}"
                )
            kinds.add("w8a8-int8")
        elif wtype == "float" and bits == 8 and strategy in ("tensor", "channel"):
            kinds.add("fp8")
        else:
            raise ConfigError(
                f"compressed-tensors group {name} ({fmt or 'no format'}): weights {w!r} are not supported "
                "(supported: int8 per channel with dynamic per-token int8 activations; fp8 per tensor or channel)"
            )
    if len(kinds) > 1:
        raise ConfigError("compressed-tensors checkpoints mixing int8 and fp8 groups are not supported")
    return kinds.pop()


def _check_packed_int4(q: dict[str, Any]) -> None:
    """Refuse what the kernels cannot run, naming it."""
    method = q.get("quant_method")
    if q.get("bits", 4) != 4:
        raise ConfigError(f"{method} checkpoints of {q.get('bits')} bits are not supported (4 bits are)")
    g = q.get("group_size", 128)
    if g != -1 and (not isinstance(g, int) or g <= 0 or g % 32):
        raise ConfigError(f"{method} group_size {g!r} is not supported: a multiple of 32, or -1")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ConfigError(f"awq version {q.get('version')!r} is not supported (gemm is)")
    if method == "gptq" and q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ConfigError(f"gptq checkpoint_format {q.get('checkpoint_format')!r} is not supported (gptq, gptq_v2)")


def quantization_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's quantization_config (empty where there is none)."""
    return cfg.get("quantization_config") or {}


def quantization_block_size(cfg: dict[str, Any]) -> list[int] | None:
    """Block-wise FP8 checkpoints: the [rows, columns] block each weight scale covers."""
    return (cfg.get("quantization_config") or {}).get("weight_block_size")


# ------------------------------------------------------------------- generation_config.json
# generation_config.json key -> SamplingParams field (vLLM's set).
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def eos_token_ids(path: Path, cfg: dict[str, Any]) -> list[int]:
    """Stop ids from generation_config.json first (it may list several), then config.json."""
    ids: list[int] = []
    gen_path = path / "generation_config.json"
    sources = [read_json(gen_path)] if gen_path.is_file() else []
    for src in [*sources, cfg]:
        eos = src.get("eos_token_id")
        for i in [eos] if isinstance(eos, int) else eos or []:
            if i not in ids:
                ids.append(int(i))
    return ids


def generation_defaults(model: str | Path, mode: str) -> dict[str, Any]:
    """The sampling defaults a model folder's generation_config.json sets ("auto"), as vLLM
    reads them; nothing for "vllm" or without the file."""
    path = Path(model) / "generation_config.json"
    if mode != "auto" or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return {field: cfg[key] for key, field in _GENERATION_KEYS.items() if cfg.get(key) is not None}
