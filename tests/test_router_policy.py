"""The dispatch policy on its own: exact prefix overlap from KV events, plus load."""

from __future__ import annotations

import msgspec
import pytest

from kvledger.cache.block_hash import hash_request_blocks
from kvledger.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvledger.errors import ConfigError
from kvledger.router.index import KVIndex
from kvledger.router.policy import NoReplicaError, Router

BS = 16
PREFIX = [(7 * i + 3) % 30000 for i in range(1000)]  # a 1,000-token system prompt (62 full blocks)


def _stored_payload(tokens: list[int]) -> bytes:
    """The engine's events for a prompt's full blocks, encoded as they travel (msgpack)."""
    hashes = hash_request_blocks(tokens, BS)
    events = [
        BlockStored(block_hashes=[h], parent_block_hash=hashes[i - 1] if i else None,
                    token_ids=tokens[i * BS : (i + 1) * BS], block_size=BS, lora_id=None, medium="GPU")
        for i, h in enumerate(hashes)
    ]
    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))


def test_index_follows_stored_removed_cleared_and_counts_gaps():
    idx = KVIndex()
    idx.apply_payload(0, _stored_payload(PREFIX))
    hashes = hash_request_blocks(PREFIX + [1, 2, 3], BS)
    assert idx.prefix_blocks(hashes) == 62
    idx.apply(1, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[hashes[10]], medium="GPU")]))
    assert idx.prefix_blocks(hashes) == 10  # a hit stops at the first missing block
    idx.apply(1, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))  # a replayed duplicate: ignored
    assert idx.prefix_blocks(hashes) == 10
    idx.apply(4, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert idx.prefix_blocks(hashes) == 0 and idx.gaps == 2


def test_cache_aware_sends_a_shared_1000_token_prefix_to_the_replica_holding_it():
    for holder in range(4):
        r = Router(4, "cache_aware", BS)
        r.replicas[holder].index.apply_payload(0, _stored_payload(PREFIX))
        for q in range(3):  # whatever the round-robin start
            d = r.choose(PREFIX + [100 + q] * 20)
            assert (d.rank, d.overlap_blocks) == (holder, 62)
    # Same tokens under another first block (another tenant's prompt): no overlap anywhere.
    r = Router(2, "cache_aware", BS)
    r.replicas[1].index.apply_payload(0, _stored_payload(PREFIX))
    assert r.choose([1] + PREFIX[1:]).overlap_blocks == 0


def test_load_outweighs_a_small_overlap_but_not_a_large_one():
    r = Router(2, "cache_aware", BS)
    r.replicas[0].index.apply_payload(0, _stored_payload(PREFIX))
    busy = r.replicas[0]
    # The prefix saves 62 blocks of KV and 62 of prefill (weighted 0.25) on replica 0:
    # cost 1.6 + 0.25 x queued blocks there, against 78.6 on the empty replica.
    busy.queued_tokens = 300 * BS  # 300 blocks of queued prefill: still cheaper than recomputing
    assert r.choose(PREFIX + [5]).rank == 0
    busy.queued_tokens = 320 * BS  # now more than the prefix is worth
    assert r.choose(PREFIX + [5]).rank == 1
    busy.queued_tokens = 0
    busy.tail_blocks = 80  # KV usage counts too
    assert r.choose(PREFIX + [5]).rank == 1


def test_round_robin_and_least_loaded():
    rr = Router(3, "round_robin", BS)
    rr.replicas[2].index.apply_payload(0, _stored_payload(PREFIX))
    assert [rr.choose(PREFIX).rank for _ in range(6)] == [0, 1, 2, 0, 1, 2]  # blind to the cache
    ll = Router(3, "least_loaded", BS)
    ll.replicas[2].index.apply_payload(0, _stored_payload(PREFIX))
    ll.replicas[0].queued_tokens = 500
    ll.replicas[1].tail_blocks = 3
    assert ll.choose(PREFIX).rank == 2 and ll.choose(PREFIX).overlap_blocks == 0


def test_bookkeeping_counts_shared_blocks_once_and_returns_to_zero():
    r = Router(2, "cache_aware", BS)
    reqs = [PREFIX + [200 + i] * 8 for i in range(3)]
    ranks = []
    for i, toks in enumerate(reqs):
        d = r.choose(toks)
        r.dispatched(f"r{i}", d, toks, max_tokens=16)
        ranks.append(d.rank)
        if i == 0:
            assert r.replicas[d.rank].queued_tokens == 1008
            r.prefilled("r0")  # its first token is out; its blocks are not in the events yet
    # No events yet: the in-flight prompt blocks already attract the same tenant.
    assert len(set(ranks)) == 1
    rep = r.replicas[ranks[0]]
    assert len(rep.active) == 62 + 3  # the shared prefix once, not three times; a private block each
    assert rep.tail_blocks == 3 * (-(-(1008 + 16) // BS) - 63)
    assert rep.queued_tokens == 2 * (1008 - 62 * BS)
    for i in range(1, 3):
        r.prefilled(f"r{i}")
    assert rep.queued_tokens == 0
    for i in range(3):
        r.finished(f"r{i}")
    assert (rep.queued_tokens, rep.active_blocks, rep.num_requests) == (0, 0, 0)
    assert rep.dispatched == 3 and rep.hit_blocks == 2 * 62


def test_dead_replica_leaves_rotation_and_returns_its_in_flight_requests():
    r = Router(2, "cache_aware", BS)
    r.replicas[0].index.apply_payload(0, _stored_payload(PREFIX))
    d = r.choose(PREFIX)
    r.dispatched("a", d, PREFIX, 8)
    assert r.mark_dead(0) == ["a"]
    assert r.replicas[0].num_requests == 0 and not r.replicas[0].index.hashes
    assert {r.choose(PREFIX).rank for _ in range(4)} == {1}
    r.mark_dead(1)
    with pytest.raises(NoReplicaError, match="no data-parallel replica is alive"):
        r.choose(PREFIX)


def test_bad_configuration_is_named():
    with pytest.raises(ConfigError, match="dp routing must be one of.*'fastest'"):
        Router(2, "fastest")
    with pytest.raises(ConfigError, match="data_parallel_size must be >= 1"):
        Router(0)


def _removed(tokens: list[int]) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=hash_request_blocks(tokens, BS), medium="GPU")])


def _serve_and_evict(r: Router, toks: list[int]) -> int:
    """Route ``toks``, let its replica cache then evict every block of it, finish the request."""
    d = r.choose(toks)
    r.dispatched("x", d, toks, max_tokens=8)
    r.replicas[d.rank].index.apply_payload(0, _stored_payload(toks))
    r.finished("x")
    r.replicas[d.rank].index.apply(1, _removed(toks))
    assert not any(rep.index.prefix_blocks(hash_request_blocks(toks, BS)) for rep in r.replicas)
    return d.rank


def test_a_tenant_evicted_everywhere_goes_back_to_the_replica_that_served_it():
    for history in (True, False):
        r = Router(2, "cache_aware", BS, history_blocks=1024 if history else 0)
        home = _serve_and_evict(r, PREFIX + [1] * 20)
        r.replicas[home].tail_blocks = 5  # the home is now a little busier than the other replica
        d = r.choose(PREFIX + [2] * 30)  # same tenant, another question; no replica caches it
        if history:
            assert (d.rank, d.overlap_blocks, d.reason) == (home, 0, "history")
        else:  # without the history it lands by load alone: on the other replica
            assert d.rank == 1 - home and d.reason == "cost"


def test_a_new_prefix_goes_to_the_replica_with_the_least_placed_volume_not_the_least_load():
    r = Router(2, "cache_aware", BS)
    home = _serve_and_evict(r, PREFIX)
    assert r.history_volume[home] == 62 and r.history_volume[1 - home] == 0
    r.replicas[1 - home].tail_blocks = 50  # busier, but nothing placed there yet
    other = [(11 * i + 5) % 30000 for i in range(800)]  # another tenant's prompt
    d = r.choose(other)
    assert (d.rank, d.reason) == (1 - home, "new")


def test_history_is_bounded_and_forgets_a_dead_replica():
    r = Router(2, "cache_aware", BS, history_blocks=40)
    d = r.choose(PREFIX)
    r.dispatched("a", d, PREFIX, 8)
    assert len(r._history) == 40 and sum(r.history_volume) == 40  # the oldest 22 blocks dropped
    assert r.history_home(hash_request_blocks(PREFIX, BS)) is None  # its leading blocks are gone
    assert r.history_home(hash_request_blocks(PREFIX, BS)[22:]) == d.rank
    r.mark_dead(d.rank)
    assert not r._history and r.history_volume == [0, 0]


def test_imbalance_guard_overrides_the_prefix_only_beyond_both_thresholds():
    r = Router(2, "cache_aware", BS)
    r.replicas[0].index.apply_payload(0, _stored_payload(PREFIX))
    r.replicas[1].num_requests = 30
    r.replicas[0].num_requests = 94  # 64 more than replica 1 (and > 1.5x): still a candidate
    assert r.choose(PREFIX + [5]).rank == 0
    r.replicas[0].num_requests = 95  # > 30 + 64 and > 1.5 x 30: out, despite its 62 cached blocks
    assert r.choose(PREFIX + [5]).rank == 1
    r.replicas[1].num_requests = 64  # 95 - 64 = 31 over, under 64: back in
    assert r.choose(PREFIX + [5]).rank == 0
    loose = Router(2, "cache_aware", BS, balance_abs=10**9)  # the cost alone keeps the prefix
    loose.replicas[0].index.apply_payload(0, _stored_payload(PREFIX))
    loose.replicas[0].num_requests, loose.replicas[1].num_requests = 95, 30
    assert loose.choose(PREFIX + [5]).rank == 0


def test_a_busy_holder_keeps_its_prefix_unless_busier_than_a_typical_other_replica():
    def router(**kw) -> Router:
        r = Router(3, "cache_aware", BS, **kw)
        r.replicas[0].index.apply_payload(0, _stored_payload(PREFIX))
        r.replicas[0].tail_blocks = 90  # busy holder
        r.replicas[2].tail_blocks = 200  # replica 1 is momentarily idle, replica 2 busier still
        return r

    # Against the idlest replica alone the copy looks cheaper; against the average other it is not.
    assert router(move_floor=0).choose(PREFIX + [5]).rank == 1
    assert router().choose(PREFIX + [5]).rank == 0
    r = router()
    r.replicas[0].tail_blocks = 400  # far busier than a typical other replica: the copy pays
    assert r.choose(PREFIX + [5]).rank == 1
