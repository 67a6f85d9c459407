"""The planning half of the ledger: bytes per token, capacity, fragmentation and sharing.

Pure Python (no torch), so `kvledger plan` answers instantly and the engine, the server and
the simulator can all size the pool from the same arithmetic. The model's side (ModelSpec, the
presets, a folder's spec) is kvledger.ledger.spec.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvledger.errors import ConfigError
from kvledger.ledger.kv_cache_groups import kv_cache_layout
from kvledger.ledger.spec import ModelSpec

GiB = 1024**3
GB = 1000**3

# KV storage formats: bytes per element of K/V data. fp8 is e4m3; fp8_int8 is K fp8, V int8.
KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "fp8_int8": 1}
QUANTIZED_KV_DTYPES = frozenset({"fp8", "int8", "fp8_int8"})
KV_SCALE_BYTES = 2  # one float16 scale per token per KV head, for K and for V
_MODEL_TO_KV = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


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


def block_file_bytes(bytes_per_block: int, block_size: int) -> int:
    """One block file of the disk tier: the payload plus its header (magic, JSON with the
    fingerprint, facts, identity and token ids: about 512 B + 8 B per token; an estimate)."""
    return bytes_per_block + 512 + 8 * block_size


def tier_capacity(bytes_per_block: int, block_size: int, host_bytes: int, disk_bytes: int) -> dict:
    """Blocks and tokens each lower tier of the prefix cache holds within its bytes
    (kvledger/cache/kv_tiers.py; the engine sizes its tiers with this)."""
    host = host_bytes // bytes_per_block if bytes_per_block else 0
    disk = disk_bytes // block_file_bytes(bytes_per_block, block_size) if bytes_per_block else 0
    return {
        "host": {"bytes": host_bytes, "blocks": host, "tokens": host * block_size},
        "disk": {"bytes": disk_bytes, "blocks": disk, "tokens": disk * block_size,
                 "file_bytes": block_file_bytes(bytes_per_block, block_size)},
    }  # fmt: skip
