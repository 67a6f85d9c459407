"""BlockPool: O(1) free queue, reference counts, prefix index and LRU eviction."""

import pytest
from cache_state import pool_state

from kvledger.cache.block_pool import BlockPool, hash_block
from kvledger.errors import CacheError, KVLedgerError, OutOfBlocksError


def _register(pool: BlockPool, block_id: int, tokens: tuple[int, ...], parent: int | None = None):
    parent_hash = pool.blocks[parent].block_hash if parent is not None else None
    h = hash_block(parent_hash, tokens)
    pool.register_full_block(block_id, h, tokens, parent)
    return h


def test_new_pool_is_all_free_and_hands_out_blocks_in_order():
    pool = BlockPool(4)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_free) == (4, 0, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert all(pool.blocks[b].ref_cnt == 1 for b in (0, 1, 2))
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    pool.check_invariants()


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_pool_size_is_a_cache_error(n):
    with pytest.raises(CacheError, match="num_blocks must be positive"):
        BlockPool(n)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match="need 2 free KV blocks, only 1 available"):
        pool.allocate(2)
    assert pool_state(pool) == before
    assert issubclass(OutOfBlocksError, CacheError) and issubclass(CacheError, KVLedgerError)


def test_free_returns_blocks_and_they_are_reused():
    pool = BlockPool(3)
    a = pool.allocate(3)
    pool.free(a)
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 0
    assert sorted(pool.allocate(3)) == [0, 1, 2]
    pool.check_invariants()


def test_touch_and_free_count_references():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch(b)
    pool.touch(b)
    assert pool.blocks[b].ref_cnt == 3
    pool.free([b])
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 1 and pool.num_used_blocks == 1
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 0 and pool.num_used_blocks == 0
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    before = pool_state(pool)
    with pytest.raises(CacheError, match="double free of KV block 0"):
        pool.free([b, a])  # b is valid, a is not: nothing may be released
    assert pool_state(pool) == before
    pool.check_invariants()


def test_double_free_within_one_call_raises_and_changes_nothing():
    # The same block twice in one call is a double free too (ref_cnt 1, two releases).
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    before = pool_state(pool)
    with pytest.raises(CacheError, match="double free"):
        pool.free([a, a])
    assert pool_state(pool) == before
    pool.check_invariants()


def test_free_of_a_shared_block_twice_in_one_call_is_fine():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.touch(a)
    pool.free([a, a])
    assert pool.blocks[a].ref_cnt == 0 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_registered_block_stays_cached_after_free_and_can_be_taken_back():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    h = _register(pool, b, (1, 2, 3, 4))
    pool.free([b])
    assert pool.num_cached_free == 1 and pool.num_free_blocks == 4
    assert pool.lookup(h, (1, 2, 3, 4), None) == b
    pool.touch(b)  # a prefix hit revives it without a copy
    assert pool.blocks[b].ref_cnt == 1 and pool.num_cached_free == 0
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_lookup_verifies_tokens_and_parent_not_just_the_hash():
    pool = BlockPool(4)
    p, c = pool.allocate(2)
    _register(pool, p, (1, 1))
    h = _register(pool, c, (2, 2), parent=p)
    assert pool.lookup(h, (2, 2), p) == c
    assert pool.lookup(h, (2, 3), p) is None  # same hash, other tokens: no alias
    assert pool.lookup(h, (2, 2), None) is None  # other parent
    assert pool.lookup(h + 1, (2, 2), p) is None


def test_unhashed_free_block_is_handed_out_before_any_cached_one():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    _register(pool, a, (1,))
    _register(pool, b, (2,), parent=a)
    pool.free([b, a])  # cached
    pool.free([d])  # plain free block, freed *after* the cached ones
    assert pool.allocate(1) == [d]
    assert pool.num_evictions == 0 and pool.num_cached_free == 2
    pool.check_invariants()


def test_lru_evicts_least_recently_freed_and_tail_first():
    pool = BlockPool(6)
    r1 = pool.allocate(3)
    r2 = pool.allocate(3)
    for blocks, base in ((r1, 10), (r2, 20)):
        parent = None
        for i, b in enumerate(blocks):
            _register(pool, b, (base + i,), parent)
            parent = b
    pool.free(list(reversed(r1)))  # freed first, tail first (as the manager does)
    pool.free(list(reversed(r2)))
    assert pool.num_cached_free == 6
    # r1's tail, then its middle, then its head; only then r2's tail.
    order = [pool.allocate(1)[0] for _ in range(4)]
    assert order == [r1[2], r1[1], r1[0], r2[2]]
    assert pool.num_evictions == 4 and pool.num_cached_free == 2
    # Evicted blocks lost their identity; the rest are still found.
    assert all(pool.blocks[b].block_hash is None for b in order)
    assert pool.lookup(pool.blocks[r2[0]].block_hash, (20,), None) == r2[0]
    pool.check_invariants()


def test_touch_moves_a_cached_block_to_the_back_of_the_lru():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    _register(pool, a, (1,))
    _register(pool, b, (2,))
    pool.free([a])
    pool.free([b])  # LRU order: a, b
    pool.touch(a)  # a hit ...
    pool.free([a])  # ... and released again: a is now the most recently used
    assert pool.allocate(1) == [b]


def test_eviction_removes_index_entry():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    h = _register(pool, b, (7, 7))
    pool.free([b])
    assert pool.allocate(1) == [b]
    assert pool.lookup(h, (7, 7), None) is None
    assert h not in pool._hash_index
    pool.check_invariants()


def test_first_writer_wins_and_reregistration_is_a_no_op():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = _register(pool, a, (5,))
    _register(pool, b, (5,))  # a duplicate of the same content
    assert pool.lookup(h, (5,), None) == a
    pool.register_full_block(a, 123, (9,), None)  # already published: unchanged
    assert pool.blocks[a].block_hash == h and pool.blocks[a].token_ids == (5,)
    pool.check_invariants()


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    h = _register(pool, a, (1,))
    assert pool.blocks[a].block_hash is None and pool.lookup(h, (1,), None) is None
    pool.free([a])
    assert pool.num_cached_free == 0


def test_reset_prefix_cache_drops_only_free_cached_blocks():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    ha = _register(pool, a, (1,))
    _register(pool, b, (2,))
    hc = _register(pool, c, (3,))
    pool.free([a, b])
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_free == 0 and pool.num_evictions == 0
    assert pool.lookup(ha, (1,), None) is None
    assert pool.lookup(hc, (3,), None) == c  # in use: kept
    pool.check_invariants()
