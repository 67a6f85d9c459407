"""KV cache groups for hybrid models (issue 20): the layout of layers into groups and pool
tensors, and the KVCacheManager's per-group block tables over one shared pool: sliding
groups release blocks outside the window, prefix hits need the whole prefix in the full
group and only the window in sliding ones, swap and fork move live blocks only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvledger.cache.attention_policy import RELEASED, cdiv, first_live_block
from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.ledger.kv_cache_groups import kv_cache_layout

BS, W = 4, 10


def test_layout_gemma3_pattern_by_hand():
    # 12 layers, every 6th full (Gemma 3): 2 full, 10 sliding -> groups of 2 layers, 2 tensors.
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(12)]
    lay = kv_cache_layout(windows)
    assert lay.group_size == 2 and lay.is_hybrid
    assert [g.layers for g in lay.groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert lay.windows == [None] + [1024] * 5
    assert lay.layer_group[6] == 3 and lay.layer_slot[6] == 1 and lay.layer_slot[11] == 1
    # Each (group, tensor) pair belongs to exactly one layer: groups never share a block's slot.
    assert len({(lay.layer_group[i], lay.layer_slot[i]) for i in range(12)}) == 12


def test_layout_uniform_models_keep_one_group():
    lay = kv_cache_layout([None] * 4)
    assert not lay.is_hybrid and lay.group_size == 4 and lay.layer_slot == (0, 1, 2, 3)
    assert kv_cache_layout([9] * 3).windows == [9]


def test_layout_uneven_counts_pad_the_last_group():
    lay = kv_cache_layout([None, 7, 7, None, 7, 7, 7])  # 2 full, 5 sliding
    assert [len(g.layers) for g in lay.groups] == [2, 2, 2, 1]


def _manager(num_blocks: int = 96, host: int = 0, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BS, bytes_per_token=10, enable_prefix_caching=caching,
        num_host_blocks=host, windows=[None, W, W],
    )


def _step(kv, rid: str, tokens: list[int], new: list[int]) -> None:
    assert kv.allocate_slots(rid, len(new))
    tokens.extend(new)
    req = SimpleNamespace(request_id=rid, all_token_ids=tokens, num_computed_tokens=len(tokens))
    kv.cache_computed_blocks([req])


def _live(table: list[int]) -> int:
    return sum(b >= 0 for b in table)


def test_long_request_sliding_groups_stay_bounded_full_group_grows():
    kv = _manager(caching=False)
    tokens: list[int] = []
    _step(kv, "a", tokens, list(range(7)))
    bound = cdiv(W - 1, BS) + 2
    for t in range(120):
        _step(kv, "a", tokens, [t % 50])
        full, s1, s2 = kv.block_tables("a")
        assert _live(full) == cdiv(len(tokens), BS)
        assert _live(s1) <= bound and _live(s2) <= bound
        assert kv.num_used_blocks == _live(full) + _live(s1) + _live(s2)
        assert kv.ledger().requests["a"].blocks == kv.num_used_blocks
    kv.check_invariants()
    assert kv.block_tables("a")[1][0] == RELEASED
    kv.free("a")
    assert kv.num_used_blocks == 0


def test_scheduler_bounds_count_every_group():
    kv = _manager()
    n = 100
    assert kv.blocks_alone(n - 1, n) == cdiv(n, BS) + 2 * (cdiv(n, BS) - first_live_block(n - 1, W, BS))
    assert kv.prompt_blocks_bound(1000, 8) == cdiv(1001, BS) + 2 * (cdiv(W + 8, BS) + 1)


def test_prefix_hit_full_group_needs_whole_prefix_sliding_group_only_window():
    kv = _manager()
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks before the last one
    tokens: list[int] = []
    _step(kv, "a", tokens, prompt)
    full, s1, s2 = (list(t) for t in kv.block_tables("a"))
    kv.free("a")
    hits, n = kv.get_computed_blocks(prompt)
    first = first_live_block(40, W, BS)
    assert n == 40
    assert hits[0] == full[:10]  # the whole prefix for full attention
    for h, table in ((hits[1], s1), (hits[2], s2)):
        # Before the window: nothing needed. Block 7 was released from "a" (its last query
        # did not need it) but stays in the prefix cache, and a hit at 40 needs it again.
        assert h[:first] == [RELEASED] * first and h[7] >= 0 and table[7] == RELEASED
        assert h[8:] == table[8:10]
    # A sliding group's evicted block before the window does not matter ...
    (early,) = kv.groups[1].longest_hit(prompt[:5], None, 1)  # its cached block 0
    kv.pool._evict(kv.pool.blocks[early])
    assert kv.get_computed_blocks(prompt)[1] == 40
    # ... one inside it shortens the hit for every group; a full group's early block empties it.
    kv.pool._evict(kv.pool.blocks[s2[9]])
    hits, n = kv.get_computed_blocks(prompt)
    assert n < 40 and all(len(h) == n // BS for h in hits)
    kv.pool._evict(kv.pool.blocks[full[0]])
    assert kv.get_computed_blocks(prompt) == ([[], [], []], 0)
    # The hit is taken by reference: allocate it and check the tables and ref counts.
    kv.check_invariants()


def test_hit_is_allocated_per_group_and_groups_never_cross():
    kv = _manager()
    prompt = list(range(200, 233))  # 33 tokens
    tokens: list[int] = []
    _step(kv, "a", tokens, prompt)
    hits, n = kv.get_computed_blocks(prompt + [1, 2, 3])
    assert n == 32
    # Groups hash apart: no block of one group is offered to another.
    assert len({b for h in hits for b in h if b >= 0}) == sum(1 for h in hits for b in h if b >= 0)
    tables = kv.block_tables("a")
    for g, h in enumerate(hits):
        others = {b for k, t in enumerate(tables) if k != g for b in t if b >= 0}
        assert not others & set(h)
    assert kv.allocate_slots("b", 36 - n, hits)
    kv.check_invariants()
    assert kv.block_tables("b")[0][:8] == kv.block_tables("a")[0][:8]
    kv.free("a")
    kv.free("b")


def test_swap_and_fork_move_only_live_blocks():
    kv = _manager(host=64)
    tokens: list[int] = []
    for _ in range(6):
        _step(kv, "a", tokens, list(range(11)))  # 66 tokens
    live = kv.num_used_blocks
    kv.fork("a", "c")
    assert kv.num_used_blocks == live  # the child shares everything
    kv.free("c")
    assert kv.can_swap_out("a")
    pairs = kv.swap_out("a")
    assert len(pairs) == live and kv.num_used_blocks == 0  # released entries did not move
    assert kv.ledger().requests["a"].swapped_blocks == live
    kv.check_invariants()
    back = kv.swap_in("a")
    assert len(back) == live and kv.num_used_blocks == live
    kv.check_invariants()
    kv.trim("a", 65)
    with pytest.raises(Exception, match="released"):
        kv.trim("a", 20)  # the window at 20 needs blocks the sliding groups released
    kv.check_invariants()
    kv.free("a")
    assert kv.num_used_blocks == 0


def test_all_or_nothing_when_the_groups_together_do_not_fit():
    kv = _manager(num_blocks=10, caching=False)
    assert kv.blocks_needed("a", 16) == 12  # 4 blocks in each of 3 groups
    assert not kv.allocate_slots("a", 16)
    assert "a" not in kv.requests and kv.num_used_blocks == 0
    assert kv.allocate_slots("a", 12)
    kv.free("a")


def test_runner_tables_follow_every_groups_deltas():
    """The runner keeps one BlockTable per group, fed only by the tagged table deltas: after
    growth, window releases, a fork, swap out and in, a trim and frees, each equals the
    manager's table of its group (issue 17's runner-side block table)."""
    from kvledger.worker.block_table import BlockTable

    kv = _manager(host=64)
    tables = [BlockTable(rows=1, cols=2) for _ in range(3)]

    def check() -> None:
        deltas = kv.take_table_deltas()
        assert {d.group for d in deltas.changed} <= {0, 1, 2}
        for g, bt in enumerate(tables):
            bt.apply(deltas, g)
            assert set(bt.index) == set(kv.requests)
            for rid in kv.requests:
                assert bt.table(rid) == kv.block_tables(rid)[g], (g, rid)

    tokens: list[int] = []
    for _ in range(6):
        _step(kv, "a", tokens, list(range(11)))
        check()
    kv.fork("a", "c")
    check()
    _step(kv, "c", list(tokens), [1, 2, 3])  # copy-on-write of the shared partial block
    check()
    kv.free("c")
    kv.swap_out("a")
    check()
    kv.swap_in("a")
    check()
    kv.trim("a", 65)
    check()
    kv.free("a")
    check()
    assert all(len(bt) == 0 for bt in tables)


def test_one_groups_new_blocks_never_evict_anothers_hit():
    """All of a prompt's hit blocks are taken before any group allocates: otherwise group 0's
    new blocks could evict (from the front of the free queue) the cached blocks group 1 is
    about to take back, and one block would serve two groups."""
    kv = _manager(num_blocks=14)
    a, c = list(range(300, 308)), list(range(400, 408))
    _step(kv, "a", [], a)  # 2 full blocks per group, all cached
    kv.free("a")  # free queue (cached part): a's g0, g1, g2 blocks, then ...
    _step(kv, "c", [], c)
    kv.free("c")  # ... c's, which g0's new blocks may take instead
    hits, n = kv.get_computed_blocks(a + [1, 2, 3, 4, 5])
    assert n == 8
    assert kv.allocate_slots("b", 5, hits)
    kv.check_invariants()
    tables = [set(b for b in t if b >= 0) for t in kv.block_tables("b")]
    assert not (tables[0] & tables[1]) and not (tables[0] & tables[2]) and not (tables[1] & tables[2])
    assert [t[:2] for t in kv.block_tables("b")] == hits
    kv.free("b")


def _scripted(kv: KVCacheManager) -> list:
    """Admission with a prefix hit, a fork, batched decode with copy-on-write, swap out and in,
    a free: every table, delta and copy after each step, and the ledger at the end."""
    log: list = []
    tokens: dict[str, list[int]] = {}

    def step(rids: list[str]) -> None:
        reqs = [
            SimpleNamespace(request_id=r, all_token_ids=t, num_computed_tokens=len(t))
            for r, t in ((r, tokens[r]) for r in rids)
        ]
        kv.cache_computed_blocks(reqs)
        d = kv.take_table_deltas()
        tables = {r: kv.block_tables(r) for r in sorted(tokens)}
        deltas = [(x.request_id, x.start, x.block_ids, x.group) for x in d.changed]
        log.append((tables, kv.take_block_copies(), d.removed, deltas))

    prompt = list(range(1, 15))
    tokens["a"] = list(prompt)
    assert kv.allocate_slots("a", 14)
    step(["a"])
    hits, n = kv.get_computed_blocks(prompt[:12] + [50, 51])
    log.append((hits, n))
    tokens["b"] = prompt[:12] + [50, 51]
    assert kv.allocate_slots("b", 14 - n, hits)
    step(["b"])
    kv.fork("b", "c")
    tokens["c"] = list(tokens["b"])
    step([])
    for _ in range(3):
        assert kv.allocate_many([("a", 1), ("b", 2), ("c", 1)], checked=True)
        tokens["a"].append(7)
        tokens["b"] += [8, 8]
        tokens["c"].append(9)
        step(["a", "b", "c"])
    log.append((kv.preemption_footprint("b"), kv.swap_out("b")))
    step([])
    log.append(kv.swap_in("b"))
    step(["b"])
    kv.free("a")
    del tokens["a"]
    step([])
    kv.check_invariants()
    log.append(kv.ledger().to_dict())
    return log


def test_a_plain_model_is_the_one_group_case():
    """One manager type: a plain cache, the one-group use of the grouped constructor and a hybrid
    cache are one class; plain and one-group behave identically step by step (tables, deltas,
    copies, ledger), with or without a window; and the block ids are the ones the two managers
    before issue 40 gave (same allocation order: the simulator's and engine's figures hold)."""
    from kvledger.config import CacheConfig, SchedulerConfig
    from kvledger.core.scheduler import Scheduler

    def make(**kw) -> KVCacheManager:
        return KVCacheManager(40, BS, bytes_per_token=8, num_host_blocks=16, **kw)

    plain, grouped, hybrid = make(), make(windows=[None]), make(windows=[None, 6])
    assert type(plain) is type(grouped) is type(hybrid) is KVCacheManager
    built = [Scheduler.build(SchedulerConfig(), CacheConfig(block_size=BS), 40, 8, windows=w).kv
             for w in (None, [None], [6], [None, 6])]
    assert {type(kv) for kv in built} == {KVCacheManager}
    assert [len(kv.groups) for kv in built] == [1, 1, 1, 2]

    log = _scripted(plain)
    assert log == _scripted(grouped)
    assert _scripted(make(sliding_window=6)) == _scripted(make(windows=[6]))
    hybrid_log = _scripted(hybrid)
    # Block ids as the pre-refactor KVCacheManager / HybridKVCacheManager allocated them.
    assert log[1] == ([[0, 1, 2]], 12)
    assert log[-2][0] == {"b": [[0, 1, 2, 9, 10]], "c": [[0, 1, 2, 4, 8]]}
    assert hybrid_log[1] == ([[0, 1, 2], [RELEASED, 5, 6]], 12)
    assert hybrid_log[-2][0] == {
        "b": [[0, 1, 2, 18, 19], [RELEASED] * 3 + [20, 21]],
        "c": [[0, 1, 2, 8, 15], [RELEASED] * 3 + [9, 17]],
    }
    ledger = hybrid_log[-1]
    assert (ledger["used_blocks"], ledger["shared_blocks"], ledger["tokens_stored"]) == (11, 3, 38)
    b = ledger["requests"]["b"]
    assert (b["private_blocks"], b["shared_blocks"]) == (4, 3)


def test_bad_windows_are_rejected():
    from kvledger.errors import CacheError

    with pytest.raises(CacheError, match="sliding_window must be positive"):
        KVCacheManager(8, BS, windows=[None, 0])
    with pytest.raises(CacheError, match="not both"):
        KVCacheManager(8, BS, sliding_window=4, windows=[None, 4])
    with pytest.raises(CacheError, match="at least one group"):
        KVCacheManager(8, BS, windows=[])
    kv = KVCacheManager(8, BS, windows=[None, 4])
    with pytest.raises(CacheError, match="one per KV cache group"):
        kv.allocate_slots("a", 4, [[]])  # a hit must come as get_computed_blocks gives it
    assert not kv.requests and kv.num_used_blocks == 0
