"""Snapshots of every piece of block-pool / cache-manager state, for "a failed call changed
nothing" comparisons (shared by the pool, manager and state-machine tests)."""

from __future__ import annotations

import copy

from kvledger.cache.block_pool import BlockPool
from kvledger.cache.kv_cache_manager import KVCacheManager


def pool_state(pool: BlockPool | None) -> tuple | None:
    """Everything observable about a pool."""
    if pool is None:
        return None
    return (
        list(pool._free),
        dict(pool._hash_index),
        pool.num_cached_free,
        pool.num_evictions,
        [(b.ref_cnt, b.block_hash, b.token_ids, b.parent_block_id) for b in pool.blocks],
    )


def kv_state(kv: KVCacheManager) -> tuple:
    """The ledger plus every piece of the manager's internal state."""
    return (
        kv.ledger().to_dict(),
        copy.deepcopy(kv.requests),
        pool_state(kv.pool),
        pool_state(kv.host_pool),
        [(list(g.copies), dict(g.dirty)) for g in kv.groups],  # COW pairs, table deltas queued
        (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.num_cow_copies),
    )
