"""The live ledger of an engine: the block manager's snapshot plus what only the workers know.

``KVCacheManager.ledger()`` counts blocks, tokens and sharing from the pool state the
scheduler uses; this adds the storage format, the workers' real allocations (one row per
tensor-parallel rank), the quantised formats' overlay and sink cache, the preemption and swap
counters, and on CUDA the device's memory with the start-up profile the pool was sized from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.ledger.snapshot import LedgerSnapshot


@dataclass
class SwapStats:
    out_blocks: int = 0
    in_blocks: int = 0
    out_s: float = 0.0
    in_s: float = 0.0


def live_ledger(
    kv: Any,
    executor: Any,
    *,
    kv_cache_dtype: str,
    scale_bytes_per_token: int,
    overlay_bytes_per_request: int,
    device: str,
    preemptions: dict[str, int],
    swaps: SwapStats,
    gpu_memory_utilization: float,
    memory_profile: Any = None,
    speculation: dict | None = None,
) -> LedgerSnapshot:
    """``kv``: the block manager; ``executor``: its ``ranks`` (WorkerReady) and ``stats()``
    (WorkerStats of rank 0) are read."""
    snap = kv.ledger()
    tp = executor.world_size
    stats = executor.stats()
    snap.kv_cache_dtype = kv_cache_dtype
    snap.scale_bytes_per_token = scale_bytes_per_token
    snap.overlay_bytes_per_request = overlay_bytes_per_request
    snap.tensor_parallel_size = tp
    snap.device = device
    snap.overlay_slots = stats.overlay_slots
    snap.overlay_bytes = stats.overlay_bytes
    snap.overlay_slots_used = stats.overlay_slots_used
    snap.sink_cache_entries = stats.sink_cache_entries
    snap.sink_cache_bytes = stats.sink_cache_bytes
    snap.sink_cache_hits = stats.sink_cache_hits
    snap.sink_cache_misses = stats.sink_cache_misses
    if tp > 1:  # the ranks hold the pools: one row each
        snap.ranks = [
            {"rank": r.rank, "pid": r.pid, "host": r.host, "kv_heads": r.num_kv_heads,
             "bytes_per_block": r.bytes_per_block, "device_pool_bytes": r.device_pool_bytes,
             "host_pool_bytes": r.host_pool_bytes, "weight_bytes": r.weight_bytes,
             "used_bytes": snap.used_blocks * r.bytes_per_block}
            for r in executor.ranks
        ]  # fmt: skip
        snap.device_pool_bytes = sum(r.device_pool_bytes for r in executor.ranks)
        snap.model_bytes_per_block = sum(r.bytes_per_block for r in executor.ranks)
    else:
        snap.model_bytes_per_block = snap.bytes_per_block
        snap.device_pool_bytes = executor.ranks[0].device_pool_bytes + stats.overlay_bytes
        if stats.device_memory is not None:
            d = dict(stats.device_memory, gpu_memory_utilization=gpu_memory_utilization)
            if memory_profile is not None:
                d.update(
                    weights=memory_profile.weights,
                    peak_activation=memory_profile.peak_activation,
                    non_torch=memory_profile.non_torch,
                )
            snap.device_memory = d
    snap.preemptions = dict(preemptions)
    snap.swapped_out_blocks = swaps.out_blocks
    snap.swapped_in_blocks = swaps.in_blocks
    snap.swap_out_bytes = swaps.out_blocks * kv.bytes_per_block
    snap.swap_in_bytes = swaps.in_blocks * kv.bytes_per_block
    snap.swap_out_seconds = swaps.out_s
    snap.swap_in_seconds = swaps.in_s
    snap.speculation = speculation
    if getattr(kv, "tiers", None) is not None:
        snap.tiers = kv.tiers.stats()
    return snap
