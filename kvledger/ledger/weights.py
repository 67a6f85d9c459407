"""Weight bytes of a model stored in a quantised format, for `kvledger plan --quantization`.

The ledger counts what the pool cannot have: a byte of weights is a byte of KV cache fewer. W8A8
(model/quant_int8.py) holds each decoder-layer projection as one int8 byte per weight plus, per
output row, a float32 scale and an int32 code sum; int4 half a byte per weight plus a scale per 32
(fp16 in the W4A8 tiles of bf16 / fp16 models, model/quant_q4.py; float32 otherwise,
model/quant_group.py); the embedding, the LM head and the norms stay in
the model dtype. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import itertools
import math

from kvledger import envs
from kvledger.errors import ConfigError
from kvledger.ledger.spec import ModelSpec


# Bytes a [rows, k] projection is held in, per format and model dtype (bytes a value): int8 (W8A8):
# its codes in tiles of 16 rows by 4 columns (padding included) plus a float32 scale and an int32
# code sum per row; int4 multiplied with int8 activations (W4A8, bf16 / fp16 models by default,
# model/quant_q4.py): half a byte per weight and an fp16 scale per 32, rows padded to tiles of 16;
# int4 with float activations (float32 models): half a byte per weight plus a float32 scale per 32.
# Rows that are not whole groups stay in the model dtype (None).
def _int8(rows: int, k: int, dtype_bytes: int) -> int | None:
    return -(-rows // 16) * 16 * (-(-k // 4) * 4) + rows * 8


def _int4(rows: int, k: int, dtype_bytes: int) -> int | None:
    if k % 32:
        return None
    if int4_tiles(dtype_bytes):
        padded = -(-rows // 16) * 16
        return padded * k // 2 + padded * (k // 32) * 2
    return rows * k // 2 + rows * (k // 32) * 4


def int4_tiles(dtype_bytes: int) -> bool:
    """Whether 4-bit weights of a model of this dtype are held as W4A8 tiles
    (model/quant_q4.int8_activations, without torch)."""
    choice = envs.KVLEDGER_INT4_ACTIVATIONS
    return dtype_bytes != 4 if choice == "auto" else choice == "int8"


FORMATS = {"int8": _int8, "int4": _int4}


def layer_projections(spec: ModelSpec) -> list[tuple[int, int]]:
    """(output rows, row length) of one decoder layer's projections: fused qkv, o, fused
    gate_up, down."""
    if spec.intermediate_size is None:
        raise ConfigError(f"{spec.name}: no intermediate_size, so its layer weights are unknown")
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]


def quantized_weight_bytes(spec: ModelSpec, method: str, total_bytes: int) -> int:
    """``total_bytes`` (the model in its dtype) with the layer projections in ``method``."""
    if method not in FORMATS:
        raise ConfigError(f"quantization must be one of {', '.join(FORMATS)}; got {method!r}")
    if spec.architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise ConfigError(f"quantization {method!r} is planned for dense Llama-family models, not {spec.architecture}")
    saved = 0
    for rows, k in layer_projections(spec):
        held = FORMATS[method](rows, k, spec.dtype_bytes)
        if held is not None:
            saved += rows * k * spec.dtype_bytes - held
    if spec.num_layers * sum(r * k for r, k in layer_projections(spec)) * spec.dtype_bytes > total_bytes:
        raise ConfigError(f"{spec.name}: its layer projections alone exceed the weight size given")
    return total_bytes - spec.num_layers * saved


# The decoder-layer projections the engine holds fused, by their GGUF tensor names (a fused one is
# kept quantised where the loader keeps every piece: in tiles, runs of one type each; otherwise all
# pieces of one type).
_GGUF_FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
# in tiles: bits a code, bytes of scales a row per group of 32 and per 256 columns
_GGUF_TILED = {"Q4_0": (4, 2, 0), "Q8_0": (8, 2, 0), "Q4_K": (4, 2, 4), "Q5_K": (5, 2, 4), "Q6_K": (6, 2, 2)}


def _gguf_held(kinds: list[str], rows: list[int], k: int, dtype_bytes: int) -> int | None:
    """Bytes the pieces ([rows_i, k] of GGUF type kinds_i) of one fused projection are held in
    (model/quant_q4.py's tiles where activations are int8: each run of one type its own, rows
    padded to 16; else model/quant_group.py's group-wise weights), or None where the loader
    dequantises it into the model dtype."""
    if int4_tiles(dtype_bytes):
        if not set(kinds) <= set(_GGUF_TILED):
            return None
        held = 0
        for kind, run in itertools.groupby(zip(kinds, rows), key=lambda p: p[0]):
            padded = -(-sum(r for _, r in run) // 16) * 16
            bits, group_bytes, super_bytes = _GGUF_TILED[kind]
            held += padded * (k * bits // 8 + (k // 32) * group_bytes + (k // 256) * super_bytes)
        return held
    if len(set(kinds)) == 1 and kinds[0] in ("Q4_0", "Q8_0"):
        bits = 4 if kinds[0] == "Q4_0" else 8
        return sum(rows) * k * bits // 8 + sum(rows) * (k // 32) * 4
    return None


def gguf_weight_bytes(path: str, dtype_bytes: int) -> int:
    """The weight bytes the engine holds for a GGUF file on CPU: every tensor in the model dtype,
    but the layer projections kept in their format (`kvledger plan --model file.gguf`)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from None
    tensors = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in reader.tensors}
    total = sum(math.prod(shape) * dtype_bytes for name, (_, shape) in tensors.items() if name != "rope_freqs.weight")
    layers = {name.split(".")[1] for name in tensors if name.startswith("blk.")}
    for i in layers:
        for parts in _GGUF_FUSED:
            names = [f"blk.{i}.{p}.weight" for p in parts]
            if not all(n in tensors for n in names):
                continue
            k = tensors[names[0]][1][0]  # GGUF lists the fastest dimension (a row's length) first
            rows = [tensors[n][1][1] for n in names]
            held = _gguf_held([tensors[n][0] for n in names], rows, k, dtype_bytes)
            if held is not None:
                total -= sum(rows) * k * dtype_bytes - held
    if "output.weight" in tensors:  # an untied LM head, held as the projections are
        kind, (k, rows) = tensors["output.weight"]
        held = _gguf_held([kind], [rows], k, dtype_bytes)
        if held is not None:
            total -= rows * k * dtype_bytes - held
    return total

