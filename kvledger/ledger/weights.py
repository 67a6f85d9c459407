"""Weight bytes of a model stored in a quantised format, for `kvledger plan --quantization`.

The ledger counts what the pool cannot have: a byte of weights is a byte of KV cache fewer. W8A8
(model/quant_int8.py) holds each decoder-layer projection as one int8 byte per weight plus, per
output row, a float32 scale and an int32 code sum; the embedding, the LM head and the norms stay in
the model dtype. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from kvledger.errors import ConfigError
from kvledger.ledger.spec import ModelSpec

# bytes per weight, and bytes per output row (scales and sums) of each on-the-fly format
FORMATS: dict[str, tuple[float, int]] = {"int8": (1.0, 8)}


def layer_linear_shape(spec: ModelSpec) -> tuple[int, int]:
    """(weights, output rows) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    if spec.intermediate_size is None:
        raise ConfigError(f"{spec.name}: no intermediate_size, so its layer weights are unknown")
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    weights = h * (q + 2 * kv) + q * h + 3 * h * inter
    rows = q + 2 * kv + h + 2 * inter + h
    return weights, rows


def quantized_weight_bytes(spec: ModelSpec, method: str, total_bytes: int) -> int:
    """``total_bytes`` (the model in its dtype) with the layer projections in ``method``."""
    if method not in FORMATS:
        raise ConfigError(f"quantization must be one of {', '.join(FORMATS)}; got {method!r}")
    if spec.architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise ConfigError(f"quantization {method!r} is planned for dense Llama-family models, not {spec.architecture}")
    per_weight, per_row = FORMATS[method]
    weights, rows = layer_linear_shape(spec)
    dense = spec.num_layers * weights * spec.dtype_bytes
    if dense > total_bytes:
        raise ConfigError(f"{spec.name}: its layer projections alone exceed the weight size given")
    quant = spec.num_layers * (int(weights * per_weight) + rows * per_row)
    return total_bytes - dense + quant
