"""Hugging Face model folder → ready-to-run model: config.json, safetensors weights, tokenizer.

Local folders only (never a hub). The model is built on the meta device, then each parameter
is either the memory-mapped safetensors tensor itself (CPU, same dtype) or one copy of it
(fused q/k/v and gate/up, dtype conversion, CUDA), so startup costs little more than mapping
the file. Weight files must not be rewritten in place while a model is loaded from them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvledger.errors import ConfigError, UnsupportedArchitectureError
from kvledger.model.layers import can_pack_linear
from kvledger.model.llama import LlamaForCausalLM, ModelConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Fallback when config.json lacks "architectures" (a bare config.save_pretrained()).
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, llama3 scaling or None) from either transformers 5's rope_parameters or the older
    rope_theta + rope_scaling pair."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        if missing:
            raise ConfigError(f"llama3 rope scaling is missing {', '.join(missing)}")
        return float(theta), {k: params[k] for k in keys}
    raise ConfigError(f"unsupported RoPE type {rope_type!r}; supported: default, llama3")


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The attention window if any layer uses one (we run full attention, so it caps the length)."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if arch == "MistralForCausalLM":
        return int(window)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if cfg.get("use_sliding_window") else None


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Validate an HF config dict for the architectures we implement and normalise it."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "<none>")
    arch = archs[0] if archs else _MODEL_TYPES.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} for {arch}; only silu is implemented")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope_params(cfg)
        attention_bias = bool(cfg.get("attention_bias") or False)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM"
            or (arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias),
            o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias") or False),
            qk_norm=arch == "Qwen3ForCausalLM",
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


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it (single file or sharded index)."""
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise ConfigError(
            f"missing model.safetensors (or model.safetensors.index.json) in model folder {path}"
        )
    weight_map = _read_json(index).get("weight_map") or {}
    files = {name: path / shard for name, shard in weight_map.items()}
    for shard in set(files.values()):
        if not shard.is_file():
            raise ConfigError(f"missing weight shard {shard.name} in model folder {path}")
    return files


def _sources(model: LlamaForCausalLM) -> dict[str, list[tuple[str, int, int]]]:
    """Our parameter name → (HF tensor name, first row, rows) of each piece that fills it."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    fused = {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj", 0, q_size),
            ("self_attn.k_proj", q_size, kv_size),
            ("self_attn.v_proj", q_size + kv_size, kv_size),
        ],
        "mlp.gate_up_proj": [("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, inter)],
    }
    out: dict[str, list[tuple[str, int, int]]] = {}
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        prefix, _, tail = module.rpartition(".layers.")
        layer_idx, _, sub = tail.partition(".")
        if sub in fused:
            base = f"{prefix}.layers.{layer_idx}."
            out[name] = [(f"{base}{hf}.{leaf}", row, n) for hf, row, n in fused[sub]]
        else:
            out[name] = [(name, 0, param.shape[0])]
    return out


def load_weights(
    model: LlamaForCausalLM, path: Path, dtype: torch.dtype, device: torch.device
) -> None:
    """Fill a meta-device model from safetensors. A tensor that needs no change (CPU, same dtype,
    not fused) becomes its parameter as a view of the memory-mapped file; the rest are copied
    once, straight into their (possibly fused) parameter, converting dtype on the way."""
    files = _weight_files(path)
    sources = _sources(model)
    missing = [hf for pieces in sources.values() for hf, _, _ in pieces if hf not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"model folder {path} lacks {len(missing)} weight(s): {shown}")

    shapes = {name: param.shape for name, param in model.named_parameters()}
    by_file: dict[Path, list[tuple[str, str, int, int]]] = defaultdict(list)
    for name, pieces in sources.items():
        for hf, row, n in pieces:
            by_file[files[hf]].append((name, hf, row, n))
    state: dict[str, torch.Tensor] = {}
    for file, entries in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name, hf, row, n in entries:
                t = f.get_tensor(hf)  # a view of the memory-mapped file: no copy yet
                shape = shapes[name]
                if t.shape != (n, *shape[1:]):
                    raise ConfigError(
                        f"weight {hf} in {file.name} has shape {tuple(t.shape)}, "
                        f"config implies {(n, *shape[1:])}"
                    )
                if len(sources[name]) == 1 and t.dtype == dtype and device.type == "cpu":
                    state[name] = t  # zero-copy: pages come in from the page cache on first use
                    continue
                if name not in state:
                    state[name] = torch.empty(shape, dtype=dtype, device=device)
                state[name][row : row + n].copy_(t)
    model.load_state_dict(state, strict=False, assign=True)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    pack_linear: bool = True,
) -> LoadedModel:
    """Load an HF Llama-family folder. max_model_len caps the context (and the RoPE table);
    by default it is the model's limit (max_position_embeddings, or a sliding window if smaller).
    pack_linear: on CPU in float32, pack matmul weights for oneDNN (Linear.pack)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model folder {path} does not exist")
    hf_config = _read_json(path / "config.json")
    cfg = model_config_from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config)
    device = torch.device(device)

    limit = cfg.max_position_embeddings
    window = _sliding_window(hf_config, cfg.architecture)
    if window is not None:
        limit = min(limit, window)
    if max_model_len is None:
        max_model_len = limit
    elif not 0 < max_model_len <= limit:
        raise ConfigError(
            f"max_model_len {max_model_len} is outside 1..{limit}, the limit of {path.name}"
            + (f" (sliding window {window} is not implemented)" if window == limit else "")
        )

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=max_model_len, rope_device=device)
    load_weights(model, path, torch_dtype, device)
    model.eval()
    if pack_linear and can_pack_linear(torch_dtype, device):
        model.pack_linears()
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        dtype=torch_dtype,
        eos_token_ids=eos_token_ids(path, hf_config),
        max_model_len=max_model_len,
        path=path,
    )


def load_tokenizer(path: str | Path):
    """The folder's own tokenizer (tokenizer.json etc.), never downloaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the tokenizer from {path}: {e}") from e
