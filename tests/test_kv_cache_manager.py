"""KVCacheManager: block tables, prefix caching, copy-on-write, swap maps and the ledger."""


import pytest
from cache_state import kv_state

import kvledger.cache.block_hash as block_hash_mod
from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.errors import CacheError, OutOfBlocksError

BS = 4


def _manager(num_blocks: int = 16, host: int = 0, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, bytes_per_token=10, num_host_blocks=host, **kw)


def _new(kv: KVCacheManager, rid: str, prompt: list[int], salt: str | None = None) -> int:
    """Admit a request the way the scheduler does; returns the number of cached tokens."""
    computed, num_cached = kv.get_computed_blocks(prompt, salt)
    assert kv.allocate_slots(rid, len(prompt) - num_cached, computed, salt)
    kv.cache_blocks(rid, prompt, len(prompt))
    return num_cached


def _append(kv: KVCacheManager, rid: str, tokens: list[int], new: list[int]) -> None:
    assert kv.allocate_slots(rid, len(new))
    tokens.extend(new)
    kv.cache_blocks(rid, tokens, len(tokens))


# -- block tables ---------------------------------------------------------------------------


def test_block_table_maps_logical_to_physical_blocks():
    kv = _manager()
    assert kv.allocate_slots("a", 10)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.requests["a"].num_tokens == 10
    assert kv.allocate_slots("b", 3)
    assert kv.block_table("b") == [3]
    assert kv.num_used_blocks == 4 and kv.num_free_blocks == 12
    kv.check_invariants()


def test_append_one_token_fills_the_partial_block_then_opens_a_new_one():
    kv = _manager()
    assert kv.allocate_slots("a", 6)
    for n in (7, 8):
        assert kv.allocate_slots("a", 1)
        assert kv.num_blocks_of("a") == 2 and kv.requests["a"].num_tokens == n
    assert kv.allocate_slots("a", 1)
    assert kv.num_blocks_of("a") == 3 and kv.requests["a"].num_tokens == 9
    kv.check_invariants()


def test_append_many_tokens_at_once():
    kv = _manager()
    assert kv.allocate_slots("a", 3)
    assert kv.allocate_slots("a", 14)  # 17 tokens -> 5 blocks
    assert kv.num_blocks_of("a") == 5
    assert kv.allocate_slots("a", 0)  # no-op
    assert kv.num_blocks_of("a") == 5
    kv.check_invariants()


@pytest.mark.parametrize("steps", [[1] * 13, [5, 1, 7], [4, 4, 4], [3, 9, 2, 1], [16]])
def test_internal_waste_is_at_most_one_partial_block(steps):
    kv = _manager(num_blocks=32)
    total = 0
    for k in steps:
        assert kv.allocate_slots("a", k)
        total += k
        slots = kv.num_blocks_of("a") * BS
        assert 0 <= slots - total < BS
        snap = kv.ledger()
        assert snap.tokens_stored == total
        assert snap.used_blocks * BS - snap.tokens_stored < BS
    kv.check_invariants()


def test_free_returns_every_block():
    kv = _manager()
    assert kv.allocate_slots("a", 13)
    assert kv.allocate_slots("b", 2)
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 16
    assert kv.ledger().requests == {}
    kv.check_invariants()


def test_allocate_that_does_not_fit_returns_false_and_changes_nothing():
    kv = _manager(num_blocks=4)
    assert kv.allocate_slots("a", 10)  # 3 blocks
    before = kv_state(kv)
    assert not kv.allocate_slots("a", 7)  # needs 2 more, 1 free
    assert kv_state(kv) == before
    assert not kv.allocate_slots("b", 5)  # new request needing 2
    assert kv_state(kv) == before and "b" not in kv.requests
    assert kv.allocate_slots("a", 6)  # exactly fits
    kv.check_invariants()


def test_allocate_with_cached_blocks_counts_revived_blocks_and_fails_cleanly():
    kv = _manager(num_blocks=4)
    prompt = list(range(9))
    _new(kv, "a", prompt)  # 3 blocks, two full ones cached
    kv.free("a")
    assert kv.allocate_slots("x", 4)  # take one plain block
    computed, n = kv.get_computed_blocks(prompt)
    assert n == 8 and len(computed) == 1 and len(computed[0]) == 2  # one group
    # Reviving the two cached blocks uses two of the three free blocks; 9 more tokens need 3.
    assert kv.blocks_needed("b", 9, computed) == 5
    before = kv_state(kv)
    assert not kv.allocate_slots("b", 9, computed)
    assert kv_state(kv) == before
    assert kv.allocate_slots("b", 1, computed)
    assert [kv.block_table("b")[:2]] == computed
    kv.check_invariants()


def test_negative_token_count_is_rejected():
    kv = _manager()
    with pytest.raises(CacheError, match="must be >= 0"):
        kv.allocate_slots("a", -1)
    assert kv.requests == {}


def test_unknown_request_raises_and_changes_nothing():
    kv = _manager(host=4)
    assert kv.allocate_slots("a", 5)
    before = kv_state(kv)
    for call in (
        lambda: kv.free("nope"),
        lambda: kv.block_table("nope"),
        lambda: kv.num_blocks_of("nope"),
        lambda: kv.is_swapped("nope"),
        lambda: kv.fork("nope", "child"),
        lambda: kv.swap_out("nope"),
        lambda: kv.swap_in("nope"),
        lambda: kv.can_swap_out("nope"),
        lambda: kv.can_swap_in("nope"),
        lambda: kv.cache_blocks("nope", [1, 2, 3, 4], 4),
        lambda: kv.trim("nope", 1),
    ):
        with pytest.raises(CacheError, match="unknown request 'nope'"):
            call()
        assert kv_state(kv) == before


def test_double_free_raises_and_changes_nothing():
    kv = _manager()
    assert kv.allocate_slots("a", 5)
    assert kv.allocate_slots("b", 5)
    kv.free("a")
    before = kv_state(kv)
    with pytest.raises(CacheError, match="unknown request 'a'"):
        kv.free("a")
    assert kv_state(kv) == before
    kv.check_invariants()


def test_bad_block_size_is_rejected():
    with pytest.raises(CacheError, match="block_size must be positive"):
        KVCacheManager(4, 0)


# -- prefix caching -------------------------------------------------------------------------


def test_get_computed_blocks_never_covers_the_last_prompt_token():
    kv = _manager()
    prompt = list(range(8))  # exactly two full blocks
    assert _new(kv, "a", prompt) == 0
    blocks, n = kv.get_computed_blocks(prompt)
    assert n == 4 and blocks == [kv.block_table("a")[:1]]  # the last block is recomputed
    blocks, n = kv.get_computed_blocks(prompt + [99])
    assert n == 8 and blocks == [kv.block_table("a")]
    assert kv.get_computed_blocks(prompt[:1]) == ([[]], 0)
    assert kv.get_computed_blocks([]) == ([[]], 0)
    assert kv.get_computed_blocks(prompt[:4]) == ([[]], 0)


def test_new_request_reuses_every_cached_full_block_of_its_prompt():
    kv = _manager()
    prompt = list(range(14))  # 3 full blocks + 2 tokens
    _new(kv, "a", prompt)
    blocks, n = kv.get_computed_blocks(prompt[:12] + [50, 51, 52])
    assert n == 12 and blocks == [kv.block_table("a")[:3]]
    assert kv.allocate_slots("b", 3, blocks)
    assert kv.block_table("b")[:3] == kv.block_table("a")[:3]
    assert kv.block_table("b")[3] not in kv.block_table("a")
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in blocks[0])
    # A prompt that diverges in the second block reuses only the first.
    blocks, n = kv.get_computed_blocks(prompt[:5] + [77] * 8)
    assert n == 4 and blocks == [kv.block_table("a")[:1]]
    kv.check_invariants()


def test_only_computed_full_blocks_are_published():
    kv = _manager()
    prompt = list(range(10))
    assert kv.allocate_slots("a", 10)
    kv.cache_blocks("a", prompt, 6)  # only one block fully computed so far
    assert kv.get_computed_blocks(prompt + [1])[1] == 4
    kv.cache_blocks("a", prompt, 10)
    assert kv.get_computed_blocks(prompt + [1])[1] == 8


def test_freed_blocks_keep_their_content_until_the_pool_needs_room():
    kv = _manager(num_blocks=6)
    prompt = list(range(13))  # 4 blocks, 3 full
    _new(kv, "a", prompt)
    table = kv.block_table("a")
    kv.free("a")
    snap = kv.ledger()
    assert (snap.used_blocks, snap.cached_blocks, snap.free_blocks) == (0, 3, 3)
    assert kv.get_computed_blocks(prompt) == ([table[:3]], 12)
    # Allocations first take the never-cached blocks, then evict LRU, tail first.
    assert kv.allocate_slots("x", 12)
    assert set(kv.block_table("x")).isdisjoint(table[:3])
    assert kv.get_computed_blocks(prompt)[1] == 12
    assert kv.allocate_slots("y", 1)
    assert kv.block_table("y") == [table[2]]  # the freed request's tail goes first
    assert kv.get_computed_blocks(prompt) == ([table[:2]], 8)
    assert kv.pool.num_evictions == 1
    kv.check_invariants()


def test_lru_order_across_requests():
    kv = _manager(num_blocks=8)
    pa, pb = [1] * 9, [2] * 9
    _new(kv, "a", pa)
    _new(kv, "b", pb)
    ta, tb = kv.block_table("a"), kv.block_table("b")
    kv.free("a")
    kv.free("b")
    # Six blocks: two plain + a's partial + b's partial first, then a's tail.
    assert kv.allocate_slots("x", 4 * 5)
    assert ta[1] in kv.block_table("x") and tb[1] not in kv.block_table("x")
    assert kv.get_computed_blocks(pa) == ([ta[:1]], 4)
    assert kv.get_computed_blocks(pb) == ([tb[:2]], 8)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_hash_collision_never_aliases_different_tokens(monkeypatch, salt):
    monkeypatch.setitem(block_hash_mod.HASH_FNS, "sha256", lambda parent, tokens, salt=None: 42)
    kv = _manager()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _new(kv, "a", prompt, salt)
    # Every block has the same hash; only exact content (and parent) may hit.
    assert kv.get_computed_blocks([9, 9, 9, 9, 5, 6, 7, 8, 9], salt) == ([[]], 0)
    assert kv.get_computed_blocks([1, 2, 3, 5, 5, 6, 7, 8, 9], salt) == ([[]], 0)
    blocks, n = kv.get_computed_blocks([1, 2, 3, 4, 0, 0, 0, 0, 9], salt)
    assert (blocks, n) == ([kv.block_table("a")[:1]], 4)
    # Block 1's content [5..8] under the wrong parent is no hit either.
    assert kv.get_computed_blocks([5, 6, 7, 8, 5, 6, 7, 8, 9], salt) == ([[]], 0)
    kv.free("a")
    assert kv.get_computed_blocks([9, 9, 9, 9, 1], salt) == ([[]], 0)
    kv.check_invariants()


def test_salt_separates_otherwise_identical_prefixes():
    kv = _manager()
    prompt = list(range(9))
    _new(kv, "a", prompt, salt="tenant-a")
    assert kv.get_computed_blocks(prompt) == ([[]], 0)
    assert kv.get_computed_blocks(prompt, "tenant-b") == ([[]], 0)
    assert kv.get_computed_blocks(prompt, "tenant-a") == ([kv.block_table("a")[:2]], 8)
    assert _new(kv, "b", prompt) == 0
    assert set(kv.block_table("a")).isdisjoint(kv.block_table("b"))
    assert kv.get_computed_blocks(prompt) == ([kv.block_table("b")[:2]], 8)


def test_salt_is_verified_on_a_hash_collision(monkeypatch):
    # With a colliding hash, the first block of a salted prompt must not be served to the
    # same tokens under another (or no) salt: the salt is part of the verified identity.
    monkeypatch.setitem(block_hash_mod.HASH_FNS, "sha256", lambda parent, tokens, salt=None: 7)
    kv = _manager()
    prompt = list(range(9))
    _new(kv, "a", prompt, salt="tenant-a")
    assert kv.get_computed_blocks(prompt) == ([[]], 0)
    assert kv.get_computed_blocks(prompt, "tenant-b") == ([[]], 0)
    assert kv.get_computed_blocks(prompt, "tenant-a") == ([kv.block_table("a")[:1]], 4)


def test_a_cached_block_shared_by_n_requests_is_stored_once():
    kv = _manager(num_blocks=64)
    prefix = list(range(100, 112))  # 3 full blocks
    _new(kv, "r0", prefix + [0])
    for i in range(1, 8):
        assert _new(kv, f"r{i}", prefix + [i]) == 12
    heads = {tuple(kv.block_table(f"r{i}")[:3]) for i in range(8)}
    assert len(heads) == 1
    snap = kv.ledger()
    assert snap.shared_blocks == 3
    assert snap.used_blocks == 3 + 8  # the prefix once, a private tail block each
    assert snap.tokens_stored == 12 + 8
    assert all(r.shared_blocks == 3 and r.private_blocks == 1 for r in snap.requests.values())
    # Freeing all but one keeps the prefix alive, freeing the last caches it.
    for i in range(7):
        kv.free(f"r{i}")
    assert kv.ledger().shared_blocks == 0 and kv.num_used_blocks == 4
    kv.free("r7")
    assert kv.ledger().cached_blocks == 3
    kv.check_invariants()


def test_prefix_caching_disabled():
    kv = _manager(enable_prefix_caching=False)
    prompt = list(range(9))
    _new(kv, "a", prompt)
    assert kv.get_computed_blocks(prompt) == ([[]], 0)
    kv.free("a")
    assert kv.ledger().cached_blocks == 0


def test_record_prefix_lookup_counters_reach_the_ledger():
    kv = _manager()
    kv.record_prefix_lookup(20, 12)
    kv.record_prefix_lookup(5, 0)
    snap = kv.ledger()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (25, 12)


# -- fork and copy-on-write -----------------------------------------------------------------


def test_fork_shares_every_block():
    kv = _manager()
    assert kv.allocate_slots("p", 10)
    kv.fork("p", "c")
    assert kv.block_table("c") == kv.block_table("p")
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in kv.block_table("p"))
    snap = kv.ledger()
    assert snap.used_blocks == 3 and snap.shared_blocks == 3 and snap.tokens_stored == 10
    assert kv.take_block_copies() == []
    kv.check_invariants()


def test_first_write_into_a_shared_partial_block_copies_it_once():
    kv = _manager()
    assert kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    kv.fork("p", "d")
    shared = kv.block_table("p")[1]
    assert kv.blocks_needed("c", 1) == 1
    assert kv.allocate_slots("c", 1)
    (pair,) = kv.take_block_copies()
    assert pair[0] == shared and kv.block_table("c") == [kv.block_table("p")[0], pair[1]]
    assert kv.take_block_copies() == []  # drained
    assert kv.allocate_slots("c", 1)  # the copy is private now: written in place
    assert kv.take_block_copies() == []
    assert kv.allocate_slots("p", 1)  # p and d still share the old block
    (pair2,) = kv.take_block_copies()
    assert pair2[0] == shared
    assert kv.allocate_slots("d", 2)  # d holds it alone now: no copy
    assert kv.take_block_copies() == [] and kv.block_table("d")[1] == shared
    assert kv.ledger().cow_copies == 2
    kv.check_invariants()


def test_fork_on_a_block_boundary_needs_no_copy():
    kv = _manager()
    assert kv.allocate_slots("p", 8)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 1) and kv.allocate_slots("p", 1)
    assert kv.take_block_copies() == []
    assert kv.block_table("c")[:2] == kv.block_table("p")[:2]
    assert kv.block_table("c")[2] != kv.block_table("p")[2]
    kv.check_invariants()


def test_cow_that_does_not_fit_returns_false_and_changes_nothing():
    kv = _manager(num_blocks=3)
    assert kv.allocate_slots("p", 5)
    kv.fork("p", "c")
    assert kv.allocate_slots("x", 1)  # the pool is now full
    before = kv_state(kv)
    assert kv.blocks_needed("c", 1) == 1
    assert not kv.allocate_slots("c", 1)
    assert kv_state(kv) == before


def test_fork_errors():
    kv = _manager(host=4)
    assert kv.allocate_slots("p", 5)
    kv.fork("p", "c")
    before = kv_state(kv)
    with pytest.raises(CacheError, match="already has blocks"):
        kv.fork("p", "c")
    assert kv_state(kv) == before
    kv.swap_out("p")
    before = kv_state(kv)
    with pytest.raises(CacheError, match="cannot fork swapped-out"):
        kv.fork("p", "e")
    assert kv_state(kv) == before


# -- swap -----------------------------------------------------------------------------------


def test_swap_out_and_in_moves_private_blocks_only():
    kv = _manager(num_blocks=8, host=8)
    prefix = list(range(8))
    _new(kv, "a", prefix + [1, 1, 1])  # blocks: 2 full (prefix), 1 partial
    _new(kv, "b", prefix + [2, 2, 2, 2, 2])  # shares the 2 prefix blocks
    ta = list(kv.block_table("a"))
    assert kv.can_swap_out("b")
    pairs = kv.swap_out("b")
    tb = kv.block_table("b")
    assert tb[:2] == ta[:2]  # shared blocks stay resident
    assert tb[2:] == [-1, -1]
    assert [d for d, _ in pairs] not in (ta,) and len(pairs) == 2
    assert len({h for _, h in pairs}) == 2
    assert kv.is_swapped("b") and not kv.is_swapped("a")
    snap = kv.ledger()
    assert snap.swapped_blocks == 2 and snap.requests["b"].swapped_blocks == 2
    assert snap.requests["b"].shared_blocks == 2 and snap.requests["b"].private_blocks == 0
    assert kv.num_used_blocks == 3
    # b's full block (computed, published) stays in the prefix cache after leaving.
    assert kv.get_computed_blocks(prefix + [2, 2, 2, 2, 9])[1] == 12
    kv.check_invariants()
    with pytest.raises(CacheError, match="swapped out; swap it in first"):
        kv.allocate_slots("b", 1)
    with pytest.raises(CacheError, match="already swapped out"):
        kv.swap_out("b")
    assert kv.can_swap_in("b")
    back = kv.swap_in("b")
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert kv.block_table("b")[2:] == [d for _, d in back]
    assert kv.block_table("b")[:2] == ta[:2]
    assert not kv.is_swapped("b") and kv.num_free_host_blocks == 8
    assert kv.ledger().swapped_blocks == 0
    with pytest.raises(CacheError, match="not swapped out"):
        kv.swap_in("b")
    assert kv.allocate_slots("b", 1)
    kv.check_invariants()


def test_swap_without_host_pool_or_room_fails_cleanly():
    kv = _manager(num_blocks=8)
    assert kv.allocate_slots("a", 9)
    assert not kv.can_swap_out("a")
    before = kv_state(kv)
    with pytest.raises(OutOfBlocksError):
        kv.swap_out("a")
    assert kv_state(kv) == before

    kv = _manager(num_blocks=8, host=2)
    assert kv.allocate_slots("a", 9)  # 3 private blocks, 2 host blocks
    assert not kv.can_swap_out("a")
    before = kv_state(kv)
    with pytest.raises(OutOfBlocksError, match="host swap pool has 2 free blocks, need 3"):
        kv.swap_out("a")
    assert kv_state(kv) == before


def test_swap_in_without_room_fails_cleanly():
    kv = _manager(num_blocks=4, host=4)
    assert kv.allocate_slots("a", 12)
    kv.swap_out("a")
    assert kv.allocate_slots("b", 10)  # 3 of 4 device blocks
    assert not kv.can_swap_in("a")
    before = kv_state(kv)
    with pytest.raises(OutOfBlocksError, match="need 3 free KV blocks to swap in, only 1"):
        kv.swap_in("a")
    assert kv_state(kv) == before
    kv.free("b")
    assert len(kv.swap_in("a")) == 3
    kv.check_invariants()


def test_free_of_a_swapped_request_returns_its_host_blocks():
    kv = _manager(num_blocks=4, host=4)
    assert kv.allocate_slots("a", 7)
    kv.swap_out("a")
    assert kv.num_free_host_blocks == 2
    kv.free("a")
    assert kv.num_free_host_blocks == 4 and kv.num_used_blocks == 0
    kv.check_invariants()


def test_swap_of_a_request_whose_blocks_are_all_shared():
    # A fresh fork child holds only shared blocks: swapping it out moves nothing, but it is
    # still swapped out (no writes, no fork) until swapped back in, and swap_in must work.
    kv = _manager(num_blocks=8, host=4)
    assert kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    assert kv.can_swap_out("c")
    assert kv.swap_out("c") == []
    assert kv.is_swapped("c")
    with pytest.raises(CacheError, match="swap it in first"):
        kv.allocate_slots("c", 1)
    assert kv.can_swap_in("c")
    assert kv.swap_in("c") == []
    assert not kv.is_swapped("c")
    assert kv.allocate_slots("c", 1)
    assert len(kv.take_block_copies()) == 1  # the shared partial block is copied on write
    kv.check_invariants()


def test_swapped_in_blocks_are_republished():
    kv = _manager(num_blocks=8, host=8)
    prompt = list(range(9))
    _new(kv, "a", prompt)
    kv.swap_out("a")
    kv.pool.reset_prefix_cache()  # the device copies are gone
    assert kv.get_computed_blocks(prompt) == ([[]], 0)
    kv.swap_in("a")
    kv.cache_blocks("a", prompt, len(prompt))
    assert kv.get_computed_blocks(prompt) == ([kv.block_table("a")[:2]], 8)
    kv.check_invariants()


def test_trim_and_cache_blocks_of_a_swapped_request_raise():
    # Host-resident entries are -1 in the block table; they must never reach the pool
    # (blocks[-1] is the pool's last block, here in use by another request).
    kv = _manager(num_blocks=4, host=8)
    prompt = list(range(9))
    _new(kv, "a", prompt)
    kv.swap_out("a")
    assert kv.allocate_slots("z", 16)  # every device block, including block 3
    before = kv_state(kv)
    with pytest.raises(CacheError, match="swapped out"):
        kv.trim("a", 5)
    assert kv_state(kv) == before
    with pytest.raises(CacheError, match="swapped out"):
        kv.cache_blocks("a", prompt + [5, 5, 5], 12)
    assert kv_state(kv) == before
    kv.check_invariants()


# -- trim -----------------------------------------------------------------------------------


def test_trim_drops_unused_slots():
    kv = _manager()
    assert kv.allocate_slots("a", 13)
    kv.trim("a", 9)
    assert kv.num_blocks_of("a") == 3 and kv.requests["a"].num_tokens == 9
    assert kv.num_used_blocks == 3
    kv.check_invariants()


def test_write_after_trim_into_a_published_block_does_not_corrupt_the_cache():
    kv = _manager()
    prompt = list(range(8))
    _new(kv, "a", prompt)  # both blocks full and published
    published = kv.block_table("a")[1]
    kv.trim("a", 6)  # block 1 is partial again ...
    tokens = prompt[:6]
    _append(kv, "a", tokens, [70, 71])  # ... and must not be overwritten in place
    copies = kv.take_block_copies()
    assert copies == [(published, kv.block_table("a")[1])]
    # The published block still holds exactly prompt[4:8]; a new request may use it.
    blocks, n = kv.get_computed_blocks(prompt + [1])
    assert n == 8 and blocks[0][1] == published != kv.block_table("a")[1]
    blocks, n = kv.get_computed_blocks(tokens + [1])
    assert n == 8 and blocks[0][1] == kv.block_table("a")[1]
    kv.check_invariants()


# -- the ledger -----------------------------------------------------------------------------


def test_ledger_figures_by_hand():
    kv = _manager(num_blocks=10, host=4)
    prefix = list(range(8))
    _new(kv, "a", prefix + [1, 1])  # 3 blocks: 2 full, 1 with 2 tokens
    _new(kv, "b", prefix + [2])  # shares 2, 1 own block with 1 token
    kv.fork("b", "c")  # shares all 3 of b's
    _new(kv, "d", [9] * 9)  # 3 private blocks, 9 tokens
    kv.swap_out("d")
    snap = kv.ledger()
    assert snap.total_blocks == 10 and snap.block_size == BS
    assert snap.bytes_per_token == 10 and snap.bytes_per_block == 40
    assert snap.used_blocks == 4  # the prefix 2, a's partial, b/c's partial
    assert snap.cached_blocks == 2  # d's two full blocks, freed by the swap
    assert snap.free_blocks == 4
    assert snap.free_blocks + snap.used_blocks + snap.cached_blocks == snap.total_blocks
    assert snap.tokens_stored == 8 + 2 + 1
    assert snap.shared_blocks == 3
    assert snap.utilization == pytest.approx(11 / 16)
    assert snap.usage == pytest.approx(0.4)
    assert snap.host_total_blocks == 4 and snap.swapped_blocks == 3
    r = snap.requests
    assert (r["a"].private_blocks, r["a"].shared_blocks, r["a"].swapped_blocks) == (1, 2, 0)
    assert (r["b"].private_blocks, r["b"].shared_blocks, r["b"].swapped_blocks) == (0, 3, 0)
    assert (r["c"].private_blocks, r["c"].shared_blocks, r["c"].blocks) == (0, 3, 3)
    assert (r["d"].blocks, r["d"].swapped_blocks, r["d"].num_tokens) == (0, 3, 9)
    d = snap.to_dict()
    assert d["total_bytes"] == 400 and d["used_bytes"] == 160
    assert d["requests"]["a"]["private_blocks"] == 1


def test_empty_ledger():
    snap = _manager().ledger()
    assert (snap.used_blocks, snap.free_blocks, snap.cached_blocks) == (0, 16, 0)
    # No used block: no slot to be filled, so no ratio (1.0 read as 'full' to a reader).
    assert snap.utilization is None and snap.usage == 0.0 and snap.tokens_stored == 0
