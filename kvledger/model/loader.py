"""Hugging Face model folder → ready-to-run model: config.json, safetensors weights, tokenizer.

Local folders only (never a hub). The model is built on the meta device, then each parameter
is either the memory-mapped safetensors tensor itself (CPU, same dtype) or one copy of it
(fused q/k/v and gate/up, dtype conversion, CUDA), so startup costs little more than mapping
the file. Weight files must not be rewritten in place while a model is loaded from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvledger.errors import ConfigError, UnsupportedArchitectureError
from kvledger.ledger.accounting import ModelSpec, architecture, text_config
from kvledger.model.checkpoint import CheckpointReader, quantization_method
from kvledger.model.layers import can_pack_linear
from kvledger.model.llama import LlamaForCausalLM, ModelConfig

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
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: dict[str, Any]
    dtype: torch.dtype
    eos_token_ids: list[int]
    max_model_len: int
    path: Path

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"missing {path.name} in model folder {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any]) -> torch.dtype:
    """'auto' means the checkpoint's own dtype (config torch_dtype/dtype), float32 when unstated."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _rope_params(
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
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = _rope_params(cfg, full, 1_000_000.0)
        local_theta, local_scaling = _rope_params({}, local, 10_000.0)
        return theta, scaling, local_theta, local_scaling
    # Older configs: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq.
    theta, scaling = _rope_params(cfg, cfg.get("rope_scaling") or {}, 1_000_000.0)
    return theta, scaling, float(cfg.get("rope_local_base_freq") or 10_000.0), None


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Validate an HF config dict for the architectures we implement and normalise it. The
    shape (layers, heads, layer types, window) is read by ModelSpec.from_hf_config, the same
    reading the ledger and the planner use."""
    cfg = text_config(cfg)
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
    spec = ModelSpec.from_hf_config(cfg, name=arch)
    try:
        local_theta = local_scaling = None
        if arch == "Gemma3ForCausalLM":
            theta, scaling, local_theta, local_scaling = _gemma3_rope(cfg)
        else:
            theta, scaling = _rope_params(cfg)
        partial = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                        or cfg.get("partial_rotary_factor") or 1.0)
        rotary_dim = int(spec.head_dim * partial) if partial != 1.0 else None
        # Qwen2 always has q/k/v biases; these families never read the config's attention_bias.
        attention_bias = bool(cfg.get("attention_bias") or False) and arch not in (
            "Qwen2ForCausalLM", "Phi3ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"
        )
        moe = arch in _MOE
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if moe else 0
        moe_layers = None
        if arch == "Qwen3MoeForCausalLM":
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(spec.num_layers))
        if moe and (num_experts <= 0 or not cfg.get("num_experts_per_tok")):
            raise ConfigError(f"{arch} config lacks num_local_experts/num_experts or num_experts_per_tok")
        if arch == "Qwen3MoeForCausalLM" and not cfg.get("moe_intermediate_size"):
            raise ConfigError("Qwen3MoeForCausalLM config lacks 'moe_intermediate_size'")
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
            rotary_dim=rotary_dim,
            hidden_act=act,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            embed_scale=spec.hidden_size**0.5 if gemma else None,
            attn_scale=float(query_scalar) ** -0.5 if gemma and query_scalar else None,
            attn_softcap=(cfg.get("attn_logit_softcapping") or None) if arch == "Gemma2ForCausalLM" else None,
            final_softcap=(cfg.get("final_logit_softcapping") or None) if gemma else None,
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]) if cfg.get("moe_intermediate_size") else None,
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob")),
            moe_layers=moe_layers,
        )
    except KeyError as e:
        raise ConfigError(f"config.json for {arch} lacks {e.args[0]!r}") from e


def eos_token_ids(path: Path, hf_config: dict[str, Any]) -> list[int]:
    """Stop ids from generation_config.json first (it may list several), then config.json."""
    ids: list[int] = []
    gen_path = path / "generation_config.json"
    sources = [_read_json(gen_path)] if gen_path.is_file() else []
    for src in [*sources, hf_config]:
        eos = src.get("eos_token_id")
        for i in [eos] if isinstance(eos, int) else eos or []:
            if i not in ids:
                ids.append(int(i))
    return ids


def _sources(model: LlamaForCausalLM) -> dict[str, list[tuple[str, int, int]]]:
    """Our parameter name → (HF tensor name, first row, rows) of each piece that fills it.

    Keys and names below are relative to a layer ("model.layers.{i}.")."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    fused: dict[str, list[tuple[str, int, int]]] = {}
    if cfg.architecture != "Phi3ForCausalLM":  # Phi-3 checkpoints store both fused already
        for leaf in ("weight", "bias"):
            fused[f"self_attn.qkv_proj.{leaf}"] = [
                (f"self_attn.q_proj.{leaf}", 0, q_size),
                (f"self_attn.k_proj.{leaf}", q_size, kv_size),
                (f"self_attn.v_proj.{leaf}", q_size + kv_size, kv_size),
            ]
            fused[f"mlp.gate_up_proj.{leaf}"] = [
                (f"mlp.gate_proj.{leaf}", 0, inter),
                (f"mlp.up_proj.{leaf}", inter, inter),
            ]
    if cfg.num_experts:
        # Mixtral: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down); router "gate".
        mixtral = cfg.architecture == "MixtralForCausalLM"
        base = "block_sparse_moe" if mixtral else "mlp"
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        m, h = cfg.moe_intermediate_size or inter, cfg.hidden_size
        fused["mlp.w_gate_up"] = [
            piece
            for e in range(cfg.num_experts)
            for piece in (
                (f"{base}.experts.{e}.{gate}.weight", 2 * m * e, m),
                (f"{base}.experts.{e}.{up}.weight", 2 * m * e + m, m),
            )
        ]
        fused["mlp.w_down"] = [
            (f"{base}.experts.{e}.{down}.weight", h * e, h) for e in range(cfg.num_experts)
        ]
        fused["mlp.gate.weight"] = [(f"{base}.gate.weight", 0, cfg.num_experts)]
    out: dict[str, list[tuple[str, int, int]]] = {}
    for name, param in model.named_parameters():
        prefix, sep, tail = name.partition(".layers.")
        layer_idx, _, rel = tail.partition(".")
        if sep and rel in fused:
            base_name = f"{prefix}.layers.{layer_idx}."
            out[name] = [(base_name + hf, row, n) for hf, row, n in fused[rel]]
        else:
            out[name] = [(name, 0, param.shape[0])]
    return out


def load_weights(
    model: LlamaForCausalLM,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    hf_config: dict[str, Any] | None = None,
) -> None:
    """Fill a meta-device model from the checkpoint (kvledger/model/checkpoint.py). A tensor
    that needs no change (CPU, same dtype, not fused) becomes its parameter as a view of the
    memory-mapped file; the rest are copied once, straight into their (possibly fused)
    parameter, converting dtype (and dequantising FP8) on the way."""
    reader = CheckpointReader(path, hf_config)
    sources = _sources(model)
    missing = [hf for pieces in sources.values() for hf, _, _ in pieces if hf not in reader]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"model folder {path} lacks {len(missing)} weight(s): {shown}")

    shapes = {name: param.shape for name, param in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for name, pieces in sources.items():
        for hf, row, n in pieces:
            t = reader.get(hf)  # a view of the memory-mapped file where possible
            shape = shapes[name]
            if t.shape != (n, *shape[1:]):
                raise ConfigError(
                    f"weight {hf} in {reader.file_of(hf).name} has shape {tuple(t.shape)}, "
                    f"config implies {(n, *shape[1:])}"
                )
            if len(pieces) == 1 and t.dtype == dtype and device.type == "cpu":
                state[name] = t  # zero-copy: pages come in from the page cache on first use
                continue
            if name not in state:
                state[name] = torch.empty(shape, dtype=dtype, device=device)
            state[name][row : row + n].copy_(t)
    reader.close()
    model.load_state_dict(state, strict=False, assign=True)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    pack_linear: bool = True,
    weights: bool = True,
) -> LoadedModel:
    """Load an HF Llama-family folder. max_model_len caps the context (and the RoPE table);
    by default it is the model's limit (max_position_embeddings, or a sliding window if smaller).
    pack_linear: on CPU in float32, pack matmul weights for oneDNN (Linear.pack).
    weights=False: the model stays on the meta device (a tensor-parallel driver needs only its
    shape; the ranks load their shards)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model folder {path} does not exist")
    hf_config = _read_json(path / "config.json")
    quantization_method(hf_config)  # refuse a method we cannot run before building anything
    cfg = model_config_from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config)
    device = torch.device(device)

    limit = cfg.max_position_embeddings
    if max_model_len is None:
        max_model_len = limit
    elif not 0 < max_model_len <= limit:
        raise ConfigError(
            f"max_model_len {max_model_len} is outside 1..{limit}, the limit of {path.name}"
        )

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=max_model_len, rope_device=device)
    if weights:
        load_weights(model, path, torch_dtype, device, hf_config)
    model.eval()
    if weights and pack_linear and can_pack_linear(torch_dtype, device):
        model.pack_linears()
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        dtype=torch_dtype,
        eos_token_ids=eos_token_ids(path, hf_config),
        max_model_len=max_model_len,
        path=path,
    )
