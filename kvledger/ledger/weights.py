"""Weight bytes of a model stored in a quantised format, for `kvledger plan --quantization`.

The ledger counts what the pool cannot have: a byte of weights is a byte of KV cache fewer. W8A8
(model/quant_int8.py) holds each decoder-layer projection as one int8 byte per weight plus, per
output row, a float32 scale and an int32 code sum; int4 half a byte per weight plus a scale per 32
(fp16 in the W4A8 tiles of bf16 / fp16 models, model/quant_q4.py; float32 otherwise,
model/quant_group.py); the embedding, the LM head and the norms stay in
the model dtype. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

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
