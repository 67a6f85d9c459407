"""The live memory ledger: one snapshot type that every report (API, /v1/ledger, metrics,
simulator) reads, so all figures come from the same block-pool state."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def block_fill(num_tokens: int, index: int, block_size: int) -> int:
    """Tokens stored in block ``index`` of a table covering ``num_tokens`` (only the last block
    is partial): the one fill rule of the ledger, the simulator's probe and the block map."""
    return min(block_size, num_tokens - index * block_size)


@dataclass
class RequestBlocks:
    num_tokens: int
    blocks: int  # device blocks in the table
    private_blocks: int  # held by this request alone
    shared_blocks: int  # held with others (prefix cache, n > 1 forks)
    swapped_blocks: int  # on the host pool while swapped out


@dataclass
class LedgerSnapshot:
    total_blocks: int
    used_blocks: int
    free_blocks: int  # free and empty
    cached_blocks: int  # free but still holding reusable prefix content
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    tokens_stored: int
    shared_blocks: int  # used blocks with more than one holder
    utilization: float | None  # tokens stored / token slots of used blocks; None: no block used
    usage: float  # used blocks / total blocks (vLLM's kv_cache_usage_perc)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cow_copies: int = 0
    host_total_blocks: int = 0
    swapped_blocks: int = 0  # blocks currently held in the host pool
    requests: dict[str, RequestBlocks] = field(default_factory=dict)
    # Filled in by the engine (preemption and swap traffic, storage format).
    kv_cache_dtype: str = "auto"
    # Quantised formats: bytes_per_token includes scale_bytes_per_token (one float16 per token per
    # KV head, K and V); the full-precision overlay (sinks + recent window per request) and the
    # sink cache for prefix hits live outside the blocks and come out of the same budget.
    scale_bytes_per_token: int = 0
    overlay_bytes_per_request: int = 0
    overlay_slots: int = 0
    overlay_slots_used: int = 0
    overlay_bytes: int = 0
    sink_cache_entries: int = 0
    sink_cache_bytes: int = 0
    sink_cache_hits: int = 0
    sink_cache_misses: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0
    # Speculative decoding (None: off): KV slots the last step reserved for draft tokens and
    # their bytes, the blocks its rollbacks released (every rejected draft's slot is released
    # in the step that rejects it, so between steps none is held), and the running totals.
    speculation: dict | None = None
    # The tiered prefix cache (None: off): per tier ("host", "disk") its capacity, blocks and
    # bytes held, hits and blocks stored; the tokens it served; load / store traffic with bytes
    # per second (kvledger/cache/kv_tiers.py).
    tiers: dict | None = None

    # The real device allocation behind the ledger (not the formula): the pool's tensors and the
    # overlay, and on CUDA the profiled split of the device (worker/gpu_memory.py).
    device: str = "cpu"
    device_pool_bytes: int = 0
    device_memory: dict | None = None
    # Tensor parallelism: bytes_per_token / bytes_per_block above are one rank's (what the block
    # manager counts); model_bytes_per_block is every rank's together (a KV head replicated on
    # several ranks counts on each), and ranks lists each rank's real pools and weights.
    tensor_parallel_size: int = 1
    model_bytes_per_block: int = 0
    ranks: list[dict] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.total_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        d["used_bytes"] = self.used_bytes
        return d
