"""Stateful property test: random request lifecycles against a simulated device.

The machine drives the KVCacheManager the way the scheduler and runner do (prefix lookup and
admission, appends, n > 1 forks, frees, swap out and in, speculative rejections) while a fake device stores, for every
physical slot, the value written there. A slot's value is what a real K/V entry depends on:
the salt and the whole token prefix up to that position. After every step, each request's
logical positions must resolve (through its block table, or its host blocks while swapped) to
slots holding exactly its own values, which catches any COW, swap, eviction or prefix-cache
aliasing bug, and the manager's ledger and reference counts must agree with a shadow model.
Device positions resolve through a runner-side ``BlockTable`` fed only by the manager's table
deltas, so a delta that misses any change (COW, swap, release, trim, free) fails here.
``WINDOWS`` is the manager's KV cache groups: one full-attention group here, a sliding window and
a hybrid model's groups in tests/test_sliding_window_properties.py. With several groups every
group writes its own table's blocks and a slot's value names its group, so no group may ever
read another's block.
"""

from __future__ import annotations

import pytest
from cache_state import kv_state
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvledger.cache.block_hash as block_hash_mod
from kvledger.cache.attention_policy import RELEASED, first_live_block
from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.errors import CacheError, OutOfBlocksError
from kvledger.ledger.block_map import block_map
from kvledger.worker.block_table import BlockTable

BS = 4
NUM_BLOCKS = 20
NUM_HOST_BLOCKS = 10
MAX_REQUESTS = 6

# Prompts start from one of a few shared prefixes so that prefix hits are frequent, and use a
# two-letter alphabet so that identical blocks under different parents occur too.
PREFIXES = [[], [1, 2, 1, 2], [1, 2, 1, 2, 2, 2, 1, 1], [2, 1, 2, 1, 1, 1, 2, 2, 1]]
tokens_st = st.lists(st.sampled_from([1, 2]), min_size=0, max_size=9)
salt_st = st.sampled_from([None, None, None, "s"])

SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class KVCacheMachine(RuleBasedStateMachine):
    WINDOWS: list[int | None] = [None]  # each KV cache group's window
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(
            self.NUM_BLOCKS, BS, bytes_per_token=8, num_host_blocks=NUM_HOST_BLOCKS,
            windows=self.WINDOWS,
        )
        self.groups = range(len(self.WINDOWS))
        self.tokens: dict[str, list[int]] = {}  # shadow: each request's logical positions
        self.salts: dict[str, str | None] = {}
        self.swapped: set[str] = set()
        self.device: dict[int, tuple] = {}  # slot -> value
        self.host: dict[int, tuple] = {}
        self.next_id = 0
        # The runner's copy, one per group (small: rows and columns grow).
        self.tables = [BlockTable(rows=2, cols=2) for _ in self.groups]

    # -- the simulated runner -------------------------------------------------------------------
    def _value(self, g: int, rid: str, pos: int) -> tuple:
        return (g, self.salts[rid], tuple(self.tokens[rid][: pos + 1]))

    @staticmethod
    def _copy_block(src: dict, s: int, dst: dict, d: int) -> None:
        for o in range(BS):
            if s * BS + o in src:
                dst[d * BS + o] = src[s * BS + o]
            else:
                dst.pop(d * BS + o, None)

    def _run_step(self, swap_out=(), swap_in=()) -> None:
        """The runner's order: swap-out copies, then COW copies, then swap-in copies."""
        for d, h in swap_out:
            self._copy_block(self.device, d, self.host, h)
        for s, d in self.kv.take_block_copies():
            self._copy_block(self.device, s, self.device, d)
        for h, d in swap_in:
            self._copy_block(self.host, h, self.device, d)

    def _write(self, rid: str, start: int, end: int) -> None:
        for g in self.groups:
            table = self.kv.block_table(rid, g)
            for pos in range(start, end):
                b = table[pos // BS]
                assert b >= 0, (g, rid, pos, table)
                self.device[b * BS + pos % BS] = self._value(g, rid, pos)

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _publish(self, rid: str) -> None:
        """After a step: the request's full computed blocks join the prefix cache."""
        self.kv.cache_blocks(rid, self.tokens[rid], len(self.tokens[rid]))

    def _visible(self, g: int, rid: str, pos: int) -> bool:
        """Whether a position must still resolve to its value in group g: everywhere but in
        blocks released behind g's window, which only a position no query sees may be in."""
        if self.kv.block_table(rid, g)[pos // BS] != RELEASED:
            return True
        window = self.WINDOWS[g]
        assert window is not None, (g, rid, pos)
        assert pos // BS < first_live_block(len(self.tokens[rid]), window, BS), (g, rid, pos)
        return False

    def _resident(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.swapped)

    # -- rules ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.tokens) < MAX_REQUESTS)
    @rule(prefix=st.sampled_from(PREFIXES), tail=tokens_st, salt=salt_st)
    def new_request(self, prefix, tail, salt):
        prompt = prefix + tail
        if not prompt:
            prompt = [1]
        rid = self._new_id()
        computed, num_cached = self.kv.get_computed_blocks(prompt, salt)
        assert len(computed) == len(self.groups)
        assert all(num_cached == len(c) * BS < len(prompt) for c in computed)
        before = kv_state(self.kv)
        if not self.kv.allocate_slots(rid, len(prompt) - num_cached, computed, salt):
            assert kv_state(self.kv) == before
            assert rid not in self.kv.requests
            return
        self.kv.record_prefix_lookup(len(prompt), num_cached)
        assert all(self.kv.block_table(rid, g)[: len(c)] == c for g, c in enumerate(computed))
        self.tokens[rid], self.salts[rid] = list(prompt), salt
        self._run_step()
        self._write(rid, num_cached, len(prompt))
        self._publish(rid)

    @precondition(lambda self: any(r not in self.swapped for r in self.tokens))
    @rule(data=st.data(), new=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=6))
    def append(self, data, new, rid=None):
        if rid is None:
            rid = data.draw(st.sampled_from(self._resident()))
        before = kv_state(self.kv)
        # The scheduler's fit test (a bound first, the exact count when memory is tight)
        # agrees with the exact count, for this request and for every resident one at once.
        for items in ([(rid, len(new))], [(r, len(new)) for r in self._resident()]):
            exact = self.kv.blocks_needed_total(items) <= self.kv.num_free_blocks
            assert self.kv.fits_many(items, sum(n for _, n in items)) == exact
        if not self.kv.allocate_slots(rid, len(new)):
            assert kv_state(self.kv) == before
            return
        start = len(self.tokens[rid])
        self.tokens[rid].extend(new)
        self._run_step()
        self._write(rid, start, len(self.tokens[rid]))
        self._publish(rid)

    @precondition(
        lambda self: (
            len(self.tokens) < MAX_REQUESTS and any(r not in self.swapped for r in self.tokens)
        )
    )
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._resident()))
        child = self._new_id()
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]
        assert self.kv.block_tables(child) == self.kv.block_tables(parent)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid], self.salts[rid]
        self.swapped.discard(rid)
        before = kv_state(self.kv)
        with pytest.raises(CacheError):
            self.kv.free(rid)  # a double free is refused ...
        assert kv_state(self.kv) == before  # ... and changes nothing

    @precondition(lambda self: any(r not in self.swapped for r in self.tokens))
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self._resident()))
        tables = [list(t) for t in self.kv.block_tables(rid)]
        private = [b for t in tables for b in t if b >= 0 and self.kv.pool.blocks[b].ref_cnt == 1]
        if not self.kv.can_swap_out(rid):
            before = kv_state(self.kv)
            with pytest.raises(OutOfBlocksError):
                self.kv.swap_out(rid)
            assert kv_state(self.kv) == before
            return
        pairs = self.kv.swap_out(rid)
        assert sorted(d for d, _ in pairs) == sorted(private)  # only private blocks move
        assert len({h for _, h in pairs}) == len(pairs)
        assert self.kv.is_swapped(rid)
        self.swapped.add(rid)
        self._run_step(swap_out=pairs)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        if not self.kv.can_swap_in(rid):
            before = kv_state(self.kv)
            with pytest.raises(OutOfBlocksError):
                self.kv.swap_in(rid)
            assert kv_state(self.kv) == before
            return
        host = {h for t in self.kv.requests[rid].tables for h in t.host_blocks.values()}
        pairs = self.kv.swap_in(rid)
        assert {h for h, _ in pairs} == host
        assert not self.kv.is_swapped(rid)
        self.swapped.discard(rid)
        self._run_step(swap_in=pairs)
        # The engine republishes the request's full blocks after its next step.
        self._publish(rid)

    @precondition(lambda self: any(r not in self.swapped for r in self.tokens))
    @rule(data=st.data(), k=st.integers(1, 3))
    def reject_and_correct(self, data, k):
        # Speculative decoding: the last k positions are rejected (trim), possibly back into
        # a block already published in the prefix cache, and a corrected token (3, which no
        # prompt contains) is written in their place: that write must not alter the block.
        rid = data.draw(st.sampled_from(self._resident()))
        n = max(0, len(self.tokens[rid]) - k)
        self.kv.trim(rid, n)
        del self.tokens[rid][n:]
        self.kv.check_invariants()
        self.append(data, [3], rid=rid)

    @rule()
    def reset_prefix_cache(self):
        self.kv.pool.reset_prefix_cache()

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_consistent(self):
        kv = self.kv
        kv.check_invariants()  # ref counts == holders, free queue and index consistent
        snap = kv.ledger()
        assert snap.free_blocks + snap.used_blocks + snap.cached_blocks == snap.total_blocks
        assert set(snap.requests) == set(self.tokens) == set(kv.requests)
        # Independent holder count over the block tables: no leak, no double free.
        holders: dict[int, int] = {}
        host_holders: dict[int, int] = {}
        for rid, toks in self.tokens.items():
            req = kv.requests[rid]
            assert req.num_tokens == len(toks)
            assert kv.is_swapped(rid) == (rid in self.swapped)
            r = snap.requests[rid]
            live = shared = swapped = 0  # the request's, summed over its groups
            for g in self.groups:
                table, host_blocks = kv.block_table(rid, g), req.tables[g].host_blocks
                assert len(table) == -(-len(toks) // BS)  # at most one partial block
                for b in table:
                    if b >= 0:
                        holders[b] = holders.get(b, 0) + 1
                for h in host_blocks.values():
                    host_holders[h] = host_holders.get(h, 0) + 1
                assert all(table[i] == -1 for i in host_blocks)
                live += sum(b >= 0 for b in table)
                shared += sum(b >= 0 and holders_total(kv, b) > 1 for b in table)
                swapped += len(host_blocks)
            assert r.private_blocks + r.shared_blocks == live == r.blocks
            assert r.swapped_blocks == swapped
            assert r.shared_blocks == shared
        assert snap.used_blocks == len(holders)
        assert all(kv.pool.blocks[b].ref_cnt == n for b, n in holders.items())
        assert set(host_holders.values()) <= {1}
        assert snap.swapped_blocks == len(host_holders) == kv.host_pool.num_used_blocks
        assert snap.shared_blocks == sum(1 for n in holders.values() if n > 1)
        assert not any(g.copies for g in kv.groups)  # every COW copy was taken by the runner
        # The simulator's memory probe says what the ledger says.
        stored, shared_fill = kv.pool_fill()
        assert stored == snap.tokens_stored and len(shared_fill) == snap.shared_blocks
        # The dashboard's block map (one cell per block, and grouped) says the same.
        for cells in (self.NUM_BLOCKS, 3):
            bm = block_map(kv, max_cells=cells)
            c = bm["counts"]
            assert (c["free"], c["cached"]) == (snap.free_blocks, snap.cached_blocks)
            assert (c["used"] + c["shared"], c["shared"]) == (snap.used_blocks, snap.shared_blocks)
            assert c["swapped_out"] == len(host_holders)
            assert sum(cell["n"] for cell in bm["cells"] if "n" in cell) == sum(holders.values())

    def _apply_deltas(self) -> None:
        deltas = self.kv.take_table_deltas()
        assert {d.group for d in deltas.changed} <= set(self.groups)
        for g, bt in enumerate(self.tables):
            bt.apply(deltas, g)

    @invariant()
    def runner_tables_follow_the_deltas(self):
        self._apply_deltas()
        for g, bt in enumerate(self.tables):
            assert set(bt.index) == set(self.kv.requests)
            for rid in self.kv.requests:
                assert bt.table(rid) == self.kv.block_table(rid, g)
                row = bt.index[rid]
                assert not bt.array[row, len(self.kv.block_table(rid, g)) :].any()
            used = set(bt.index.values())
            assert not bt.array[[r for r in range(len(bt.array)) if r not in used]].any()

    @invariant()
    def every_position_holds_its_own_value(self):
        self._apply_deltas()
        for rid, toks in self.tokens.items():
            req = self.kv.requests[rid]
            for g, bt in enumerate(self.tables):
                table = bt.table(rid)  # what a runner sees
                host_blocks = req.tables[g].host_blocks
                for pos in range(len(toks)):
                    i, o = divmod(pos, BS)
                    if not self._visible(g, rid, pos):
                        continue
                    if i in host_blocks:
                        got = self.host.get(host_blocks[i] * BS + o)
                    else:
                        got = self.device.get(table[i] * BS + o)
                    assert got == self._value(g, rid, pos), (g, rid, pos, got)

    def teardown(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_used_blocks == 0
        assert self.kv.host_pool.num_used_blocks == 0
        assert self.kv.ledger().used_blocks == 0 and not self.kv.requests


def holders_total(kv: KVCacheManager, block_id: int) -> int:
    return kv.pool.blocks[block_id].ref_cnt


def test_kv_cache_state_machine():
    run_state_machine_as_test(KVCacheMachine, settings=SETTINGS)


def _colliding_hash(parent_hash, token_ids, salt=None):
    # Ignores the parent and the salt and keeps 2 bits: almost every lookup is a collision,
    # so only the exact-content verification stands between a prompt and a false hit.
    return hash(token_ids) & 3


def test_kv_cache_state_machine_with_colliding_hashes(monkeypatch):
    monkeypatch.setitem(block_hash_mod.HASH_FNS, "sha256", _colliding_hash)
    run_state_machine_as_test(KVCacheMachine, settings=SETTINGS)
