"""Hugging Face model folder → ready-to-run model: config.json, safetensors weights, tokenizer.

Local folders only (never a hub). The model is built on the meta device, then each parameter
is either the memory-mapped safetensors tensor itself (CPU, same dtype) or one copy of it
(fused q/k/v and gate/up, dtype conversion, CUDA), so startup costs little more than mapping
the file. Weight files must not be rewritten in place while a model is loaded from them.
config.json and generation_config.json are read by kvledger.hf.config, as the planner reads them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvledger.errors import ConfigError
from kvledger.hf.config import (
    ModelConfig,
    config_dtype,
    dtype_name,
    eos_token_ids,
    model_config_from_hf,
    quantization_config,
    quantization_method,
    read_json,
    text_config,
)
from kvledger.model.checkpoint import CheckpointReader
from kvledger.model.layers import can_pack_linear
from kvledger.model.llama import LlamaForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any]) -> torch.dtype:
    """'auto' means the checkpoint's own dtype (the planner's reading), float32 when unstated."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        dtype = config_dtype(text_config(hf_config))
    name = dtype_name(dtype)
    if name is None:
        raise ConfigError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


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
    if (path / "gguf.json").is_file():
        return _load_gguf(model, path, dtype, device, hf_config or {})
    reader = CheckpointReader(path, hf_config)
    sources = _sources(model)
    if "model.embed_tokens.weight" not in reader and "embed_tokens.weight" in reader:
        # A bare decoder saved on its own (transformers' LlamaModel / Qwen3Model: embedders)
        # names its tensors without the "model." prefix.
        sources = {n: [(hf.removeprefix("model."), r, k) for hf, r, k in p] for n, p in sources.items()}
    if reader.quantization in ("gptq", "awq"):
        _load_packed_int4(model, reader, sources, quantization_config(hf_config or {}))
    elif reader.quantization == "w8a8-int8":
        _load_w8a8(model, reader, sources)
    from_tokens = bool((hf_config or {}).get("classifier_from_token")) and sources.pop("score.weight", None)
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
    if from_tokens:  # a reranker's head from LM-head rows (model/seq_cls.py)
        from kvledger.model.seq_cls import head_rows

        state["score.weight"] = head_rows(reader, path, hf_config or {}).to(dtype=dtype, device=device)
    reader.close()
    model.load_state_dict(state, strict=False, assign=True)


def _load_packed_int4(
    model: LlamaForCausalLM, reader: CheckpointReader, sources: dict[str, list[tuple[str, int, int]]], qc: dict
) -> None:
    """GPTQ / AWQ projections (model/packed_int4.py) into their Linear as group-wise weights; their
    entries leave ``sources`` (a projection the checkpoint stores unquantised stays there)."""
    from kvledger.model.layers import Linear
    from kvledger.model.packed_int4 import concat_rows, to_group_weight
    from kvledger.storage import host_memory

    method = reader.quantization
    modules = dict(model.named_modules())
    for name in list(sources):
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight" or not isinstance(modules.get(owner), Linear):
            continue
        stems = [hf.removesuffix(".weight") for hf, _, _ in sources[name]]
        if not all(f"{s}.qweight" in reader for s in stems):
            continue
        parts = []
        for s in stems:
            t = {k: reader.get(f"{s}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{s}.{k}" in reader}
            parts.append(to_group_weight(method, qc, t))
        w = parts[0] if len(parts) == 1 else concat_rows(parts)
        lin = modules[owner]
        if (w.q.shape[0], w.q.shape[1] * 2) != tuple(lin.weight.shape):
            raise ConfigError(f"{method} weights of {owner} hold {tuple(w.q.shape)} codes; config.json implies {tuple(lin.weight.shape)}")
        lin.set_quantized(replace(w, q=host_memory.copy_of(w.q)))
        del sources[name]


def _load_w8a8(model: LlamaForCausalLM, reader: CheckpointReader, sources: dict[str, list[tuple[str, int, int]]]) -> None:
    """compressed-tensors INT8 W8A8 projections (int8 ``weight``, ``weight_scale`` per output
    channel) into their Linear as they are (model/quant_int8.py); others stay in ``sources``."""
    from kvledger.model.layers import Linear
    from kvledger.model.quant_int8 import from_codes
    from kvledger.storage import host_memory

    modules = dict(model.named_modules())
    for name in list(sources):
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight" or not isinstance(modules.get(owner), Linear):
            continue
        pieces = [reader.get(hf) for hf, _, _ in sources[name]]
        if any(t.dtype != torch.int8 for t in pieces):
            continue
        scales = []
        for hf, _, n in sources[name]:
            stem = hf.removesuffix("weight")
            if stem + "weight_scale" not in reader:
                raise ConfigError(f"int8 weight {hf} has no {stem}weight_scale in the checkpoint")
            s = reader.get(stem + "weight_scale").to(torch.float32).reshape(-1)
            if s.numel() != n:
                raise ConfigError(f"{stem}weight_scale has {s.numel()} values for {n} output channels")
            scales.append(s)
        codes = torch.cat(pieces)
        if tuple(codes.shape) != tuple(modules[owner].weight.shape):
            raise ConfigError(f"int8 weights of {owner} have shape {tuple(codes.shape)}; config.json implies {tuple(modules[owner].weight.shape)}")
        modules[owner].set_quantized(from_codes(codes, torch.cat(scales), alloc=host_memory.weight_zeros))
        del sources[name]


def _gguf_tiles(src, pieces: list[tuple[str, int, int]], shape: tuple[int, int]):
    """A layer projection's GGUF pieces (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) in csrc/q4_gemm.c's tiles:
    one quant_q4.Q4Weight where they share a type, else a Q4Split of the runs of one type."""
    from kvledger.model import quant_q4
    from kvledger.model.quant_group import GroupWeight
    from kvledger.storage import host_memory

    alloc = host_memory.weight_zeros
    parts = []
    for kind, run in itertools.groupby(pieces, key=lambda p: src.type_of(p[0])):
        run = list(run)
        if kind in ("Q4_0", "Q8_0"):
            got = [src.group(hf) for hf, _, _ in run]
            w = quant_q4.pack(GroupWeight(torch.cat([c for c, _, _ in got]), torch.cat([s for _, s, _ in got]),
                                          got[0][2]), alloc=alloc)  # fmt: skip
        else:
            read = src.q6_k if kind == "Q6_K" else src.k_quant
            fields = [torch.cat(f) for f in zip(*(read(hf) for hf, _, _ in run))]
            w = (quant_q4.pack_q6(*fields, alloc=alloc) if kind == "Q6_K"
                 else quant_q4.pack_k(*fields, kquant=kind, alloc=alloc))  # fmt: skip
        if w.shape != (sum(n for _, _, n in run), shape[1]):
            raise ConfigError(f"GGUF tensor {src.gguf_name(run[0][0])} does not match the shape config.json implies {shape}")
        parts.append(w)
    return parts[0] if len(parts) == 1 else quant_q4.Q4Split(tuple(parts))


def _load_gguf(
    model: LlamaForCausalLM, path: Path, dtype: torch.dtype, device: torch.device, hf_config: dict[str, Any]
) -> None:
    """Fill the model from the GGUF file a cache folder names (hf/gguf_file.py): layer projections
    of the quantised types kvledger runs stay as they are (in bf16 / fp16 models every such type in
    quant_q4's tiles; in float32 ones Q8_0 / Q4_0 as group-wise weights, every piece of a fused
    projection of one such type), everything else floats in ``dtype``."""
    from kvledger.hf.gguf_file import FLOAT, KEPT, KEPT_INT8_ACTIVATIONS, GGUFWeights
    from kvledger.model import quant_q4
    from kvledger.model.layers import Linear
    from kvledger.model.quant_group import GroupWeight
    from kvledger.storage import host_memory

    src = GGUFWeights(path, hf_config)
    sources = _sources(model)
    missing = [hf for pieces in sources.values() for hf, _, _ in pieces if hf not in src]
    if missing:
        shown = ", ".join(src.gguf_name(h) for h in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"GGUF file {src.path.name} lacks {len(missing)} tensor(s): {shown}")
    # the layer projections and an untied LM head (llama.cpp's Q4_K_M holds it in Q6_K: for a large
    # vocabulary a good part of the weights a decode step streams)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and (".layers." in f".{n}" or n == "lm_head")}
    shapes = {name: param.shape for name, param in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    grouped: dict[str, GroupWeight | quant_q4.Q4Weight | quant_q4.Q4Split] = {}
    dequantised: dict[str, str] = {}  # GGUF tensor -> its type, for the ones held as floats
    k_tiles = device.type == "cpu" and quant_q4.int8_activations(dtype)
    for name, pieces in sources.items():
        owner, _, leaf = name.rpartition(".")
        kinds = {src.type_of(hf) for hf, _, _ in pieces}
        shape = shapes[name]
        if leaf == "weight" and owner in linears and kinds <= set(KEPT_INT8_ACTIVATIONS) and k_tiles:
            grouped[owner] = _gguf_tiles(src, pieces, tuple(shape))
            continue
        if leaf == "weight" and owner in linears and len(kinds) == 1 and kinds <= set(KEPT) and device.type == "cpu":
            parts = [src.group(hf) for hf, _, _ in pieces]
            codes = torch.cat([c for c, _, _ in parts])
            bits = parts[0][2]
            if codes.shape != (shape[0], shape[1] * bits // 8):
                raise ConfigError(f"GGUF tensor {src.gguf_name(pieces[0][0])} does not match the shape config.json implies {tuple(shape)}")
            held = host_memory.copy_of(codes, host_memory.weight_zeros)  # final: tiles are for bf16 / fp16 models
            grouped[owner] = GroupWeight(held, torch.cat([s for _, s, _ in parts]).contiguous(), bits)
            continue
        dequantised |= {src.gguf_name(hf): src.type_of(hf) for hf, _, _ in pieces if src.type_of(hf) not in FLOAT}
        state[name] = torch.empty(shape, dtype=dtype, device=device)
        for hf, row, n in pieces:
            t = src.get(hf)
            if t.shape != (n, *shape[1:]):
                raise ConfigError(
                    f"GGUF tensor {src.gguf_name(hf)} has shape {tuple(t.shape)}, config implies {(n, *shape[1:])}"
                )
            state[name][row : row + n].copy_(t)
    src.close()
    model.load_state_dict(state, strict=False, assign=True)
    for owner, w in grouped.items():
        linears[owner].set_quantized(w)
    if dequantised:
        import logging

        named = [f"{t} ({k})" for t, k in sorted(dequantised.items())]
        logging.getLogger("kvledger").warning(
            "%s: %d tensor(s) held dequantised in %s: %s (kvledger runs the layer projections and an "
            "untied LM head as they are: Q8_0 and Q4_0, and Q4_K, Q5_K and Q6_K in bf16 / fp16 models)",
            src.path.name, len(named), str(dtype).removeprefix("torch."),
            ", ".join(named[:4]) + (", ..." if len(named) > 4 else ""),
        )  # fmt: skip


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    pack_linear: bool = True,
    weights: bool = True,
    quantization: str | None = None,
    hf_overrides: dict | None = None,
) -> LoadedModel:
    """Load an HF Llama-family folder. max_model_len caps the context (and the RoPE table);
    by default it is the model's limit (max_position_embeddings, or a sliding window if smaller).
    pack_linear: on CPU in float32, pack matmul weights for oneDNN (Linear.pack).
    weights=False: the model stays on the meta device (a tensor-parallel driver needs only its
    shape; the ranks load their shards). quantization: "int8" stores the decoder layers' weights
    as W8A8 (model/quant_int8.py), before the rest is packed. hf_overrides: keys laid over
    config.json (vLLM's)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model folder {path} does not exist")
    hf_config = {**read_json(path / "config.json"), **(hf_overrides or {})}
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
        if quantization is not None:
            model.quantize_layers(quantization)
        else:
            model.tile_group_weights()  # a GGUF / GPTQ / AWQ checkpoint's group-wise weights
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
