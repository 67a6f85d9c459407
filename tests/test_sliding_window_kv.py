"""Sliding-window KV in the block manager (issue 20): blocks wholly outside the window are
released as a request advances and stop being charged; a prefix hit needs only the window's
blocks; fork, swap and preemption handle released entries; the engine stays exact."""

from __future__ import annotations

from types import SimpleNamespace

from kvledger.cache.attention_policy import RELEASED, cdiv, first_live_block
from kvledger.cache.kv_cache_manager import KVCacheManager

BS, W = 4, 10


def _manager(num_blocks: int = 64, host: int = 0, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BS, bytes_per_token=10, enable_prefix_caching=caching,
        num_host_blocks=host, sliding_window=W,
    )


def _step(kv: KVCacheManager, rid: str, tokens: list[int], new: list[int]) -> None:
    """One engine step of len(new) tokens for rid: allocate, compute, publish and release."""
    assert kv.allocate_slots(rid, len(new))
    tokens.extend(new)
    req = SimpleNamespace(request_id=rid, all_token_ids=tokens, num_computed_tokens=len(tokens))
    kv.cache_computed_blocks([req])


def test_first_live_block_by_hand():
    # Next query at 13 sees 4..13 (window 10): block 1 (positions 4-7) is the first needed.
    assert first_live_block(13, 10, 4) == 1
    assert first_live_block(12, 10, 4) == 0  # sees 3..12: block 0 still needed
    assert first_live_block(5, 10, 4) == 0


def test_long_request_used_blocks_stay_bounded_by_the_window():
    """Token by token over 25 windows: the request never holds more than the window's blocks
    plus the one being written, the ledger charges only those, and nothing leaks."""
    kv = _manager(caching=False)
    tokens: list[int] = []
    _step(kv, "a", tokens, list(range(7)))  # prefill
    bound = cdiv(W - 1, BS) + 1 + 1  # blocks a window can span, plus the one being filled
    for t in range(250):
        _step(kv, "a", tokens, [t % 50])
        held = sum(b >= 0 for b in kv.block_table("a"))
        assert held <= bound, (len(tokens), kv.block_table("a"))
        assert kv.num_used_blocks == held
        assert kv.ledger().requests["a"].blocks == held
        kv.check_invariants()
    table = kv.block_table("a")
    assert len(table) == cdiv(len(tokens), BS) and table[0] == RELEASED
    assert kv.requests["a"].tables[0].num_released == first_live_block(len(tokens), W, BS)
    kv.free("a")
    assert kv.num_used_blocks == 0


def test_chunked_prefill_holds_window_plus_chunk():
    kv = _manager(caching=False)
    tokens: list[int] = []
    for _ in range(8):
        _step(kv, "a", tokens, list(range(12)))
        kv.check_invariants()
        # Before the next chunk: only blocks from the first one a query at len(tokens) sees.
        assert sum(b >= 0 for b in kv.block_table("a")) == cdiv(len(tokens), BS) - first_live_block(len(tokens), W, BS)


def test_prefix_hit_needs_only_the_window_blocks():
    kv = _manager()
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks before the last token
    tokens: list[int] = []
    _step(kv, "a", tokens, prompt)
    kv.free("a")
    ids = [_published(kv, prompt, i) for i in range(10)]
    first = first_live_block(40, W, BS)  # a query at 40 sees 31..40: blocks 7, 8, 9 (+ new)
    assert first == 7
    hits, n = kv.get_computed_blocks(prompt)
    assert n == 40 and hits == [[RELEASED] * 7 + ids[7:]]
    # Evict blocks 0-5: the same hit, the evicted blocks were outside its window.
    for i in range(6):
        kv.pool._evict(kv.pool.blocks[ids[i]])
    assert kv.get_computed_blocks(prompt) == (hits, 40)
    assert kv.allocate_slots("b", 1, hits)
    assert kv.num_used_blocks == 4  # window blocks 7, 8, 9 and the new one
    kv.check_invariants()
    kv.free("b")
    # Evict block 9: the longest hit whose window is whole is 9 blocks (needs 6, 7, 8).
    kv.pool._evict(kv.pool.blocks[ids[9]])
    assert kv.get_computed_blocks(prompt) == ([[RELEASED] * 6 + ids[6:9]], 36)
    # And block 6 too: no shorter prefix has its window either (0-5 are gone).
    kv.pool._evict(kv.pool.blocks[ids[6]])
    assert kv.get_computed_blocks(prompt) == ([[]], 0)


def _published(kv: KVCacheManager, prompt: list[int], i: int) -> int:
    """Block id under which block i of prompt is cached."""
    from kvledger.cache.block_pool import hash_block

    h = None
    for j in range(i + 1):
        h = hash_block(h, tuple(prompt[j * BS : (j + 1) * BS]), None)
    return kv.pool._hash_index[h]


def test_fork_and_swap_move_only_live_blocks():
    kv = _manager(host=32)
    tokens: list[int] = []
    _step(kv, "a", tokens, list(range(30)))
    live = [b for b in kv.block_table("a") if b >= 0]
    kv.fork("a", "b")
    assert kv.block_table("b") == kv.block_table("a")
    assert kv.num_used_blocks == len(live)  # shared, not copied
    kv.free("b")
    pairs = kv.swap_out("a")
    assert sorted(d for d, _ in pairs) == sorted(live)
    assert kv.num_used_blocks == 0
    back = kv.swap_in("a")
    assert len(back) == len(live)
    assert kv.block_table("a")[: first_live_block(30, W, BS)] == [RELEASED] * first_live_block(30, W, BS)
    _step(kv, "a", tokens, [7])
    kv.check_invariants()
    kv.free("a")
    assert kv.num_used_blocks == 0 and kv.num_free_host_blocks == 32
