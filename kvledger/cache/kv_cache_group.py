"""One KV cache group's block tables over the shared BlockPool.

A plain model has one group of every layer; a hybrid one (Gemma 2/3) has several
(``kvledger.ledger.kv_cache_groups``), all drawing from one pool. Each request has a table in
every group, covering the same token slots; the group's attention policy
(``kvledger.cache.attention_policy``) says which of its blocks are still live. The group does
one group's share of each operation and queues its table changes and copy-on-write copies;
``KVCacheManager`` asks every group and keeps the all-or-nothing checks.

Two rules of the block arithmetic live here once: a write that lands in a shared or published
partial block copies it first (``needs_cow``), and writing ``n`` tokens after ``num_tokens``
takes ``cdiv(num_tokens + n, block_size) - len(table)`` new blocks (``blocks_to_write``). The
third, the tokens a block stores, is the ledger's (``kvledger.ledger.snapshot.block_fill``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvledger.cache.attention_policy import RELEASED, SWAPPED, AttentionPolicy, PromptBlock, cdiv
from kvledger.cache.block_hash import BlockHashFn
from kvledger.cache.block_pool import BlockPool
from kvledger.cache.table_delta import TableDelta
from kvledger.errors import CacheError


@dataclass(slots=True)
class GroupTable:
    """One request's block table in one group."""

    block_table: list[int] = field(default_factory=list)  # SWAPPED / RELEASED: no device block
    block_hashes: list[int] = field(default_factory=list)  # full blocks' hashes, this group's chain
    host_blocks: dict[int, int] = field(default_factory=dict)  # logical index -> host block
    num_released: int = 0  # leading entries RELEASED behind the sliding window


@dataclass(slots=True)
class RequestTables:
    """A request as the block manager knows it: one table per group over the same slots."""

    request_id: str
    tables: list[GroupTable]
    num_tokens: int = 0  # token slots every table covers (computed + scheduled)
    salt: str | None = None
    # Between swap_out and swap_in, even when no block had to move (all of them shared).
    swapped: bool = False


class KVCacheGroup:
    """Group ``index``'s share of the manager's operations, under its attention ``policy``."""

    def __init__(
        self,
        index: int,
        policy: AttentionPolicy,
        pool: BlockPool,
        hash_fn: BlockHashFn,
        hash_root: int | None,
        enable_caching: bool,
    ) -> None:
        """``hash_root``: this group's block hashes chain from it, so no group can hit
        another's blocks (group 0's is None: it hashes as a single-group cache would, so its
        KV events match a router's)."""
        self.index = index
        self.policy = policy
        self.block_size = policy.block_size
        self.pool = pool
        self.blocks = pool.blocks  # the pool's block metadata, by id (a fixed list)
        self.hash_fn = hash_fn
        self.hash_root = hash_root
        self.enable_caching = enable_caching
        # Since the last take_deltas: request id -> first changed table entry.
        self.dirty: dict[str, int] = {}
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pairs not yet taken
        self.num_cow_copies = 0

    # -- table deltas ------------------------------------------------------------------------
    def changed(self, request_id: str, start: int) -> None:
        """Entries from ``start`` on of the request's table changed since the last delta."""
        d = self.dirty.get(request_id)
        if d is None or start < d:
            self.dirty[request_id] = start

    def take_deltas(self, requests: dict[str, RequestTables]) -> list[TableDelta]:
        g = self.index
        out = [
            TableDelta(rid, s, requests[rid].tables[g].block_table[s:], g)
            for rid, s in self.dirty.items()
        ]
        self.dirty = {}
        return out

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    # -- the two rules -----------------------------------------------------------------------
    def needs_cow(self, table: list[int], num_tokens: int) -> bool:
        """The next write lands in a partial block that is shared or published (a block
        published and made partial again by a trim is immutable too): it is copied first."""
        bs = self.block_size
        if not num_tokens % bs:
            return False
        b = table[(num_tokens - 1) // bs]
        if b < 0:
            return False
        blk = self.blocks[b]
        return blk.ref_cnt > 1 or blk.block_hash is not None

    def blocks_to_write(self, table: list[int], num_tokens: int, n: int) -> int:
        """Free blocks that writing ``n`` tokens after ``num_tokens`` takes: new blocks, and
        a copy-on-write copy."""
        need = cdiv(num_tokens + n, self.block_size) - len(table)
        if need < 0:
            need = 0
        if n and self.needs_cow(table, num_tokens):
            need += 1
        return need

    # -- prefix cache ------------------------------------------------------------------------
    def chain(
        self, token_ids: list[int], salt: str | None, start: int, stop: int, parent_hash: int | None
    ) -> Iterator[PromptBlock]:
        """Blocks start..stop-1 of ``token_ids`` with their chained hashes, from ``parent_hash``
        (block start - 1's; the group's root before block 0), the salt in block 0's identity.
        Lazy: a walk that stops at a miss hashes no further."""
        bs, h = self.block_size, parent_hash
        for i in range(start, stop):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block_salt = salt if i == 0 else None
            h = self.hash_fn(h, tokens, block_salt)
            yield h, tokens, block_salt

    def longest_hit(self, token_ids: list[int], salt: str | None, max_blocks: int) -> list[int]:
        """This group's cached blocks for the prompt's first blocks, by its policy's rule."""
        prompt = self.chain(token_ids, salt, 0, max_blocks, self.hash_root)
        return self.policy.longest_hit(self.pool, prompt)

    def publish(self, req: RequestTables, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the table's blocks that became full (and computed) under their hashes."""
        t = req.tables[self.index]
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        if num_full <= len(t.block_hashes):
            return  # the hot path: nothing new became full
        if req.swapped:
            raise CacheError(f"request {req.request_id!r} is swapped out; swap it in first")
        table, hashes = t.block_table, t.block_hashes
        parent_hash = hashes[-1] if hashes else self.hash_root
        start = len(hashes)
        for i, (h, tokens, salt) in enumerate(
            self.chain(token_ids, req.salt, start, num_full, parent_hash), start
        ):
            if table[i] >= 0:  # not a block released behind the window
                parent_id = table[i - 1] if i > 0 else None
                self.pool.register_full_block(table[i], h, tokens, parent_id, salt, parent_hash)
            hashes.append(h)
            parent_hash = h

    def release(self, req: RequestTables, num_computed_tokens: int) -> None:
        """Release the leading blocks no query at num_computed_tokens or later can see."""
        t = req.tables[self.index]
        table = t.block_table
        dead = min(self.policy.first_live_block(num_computed_tokens), len(table))
        if dead <= t.num_released or req.swapped:
            return
        freed = [b for b in table[t.num_released : dead] if b >= 0]
        table[t.num_released : dead] = [RELEASED] * (dead - t.num_released)
        self.changed(req.request_id, t.num_released)
        t.num_released = dead
        self.pool.free(freed)

    def publish_and_release(self, stepped: list[Any], requests: dict[str, RequestTables]) -> None:
        """``publish`` then ``release`` for a step's requests (the scheduler's, with
        ``request_id``, ``all_token_ids`` and ``num_computed_tokens``): the per-step hot path,
        which skips in line the requests that filled no new block. (A released block stays in
        the prefix cache until evicted.)"""
        bs, g = self.block_size, self.index
        if self.enable_caching:
            for r in stepped:
                req = requests[r.request_id]
                if r.num_computed_tokens // bs > len(req.tables[g].block_hashes):
                    self.publish(req, r.all_token_ids, r.num_computed_tokens)
        if self.policy.releases:
            for r in stepped:
                req = requests.get(r.request_id)
                if req is not None:
                    self.release(req, r.num_computed_tokens)

    # -- allocation --------------------------------------------------------------------------
    def take_hit(self, request_id: str, computed: list[int]) -> GroupTable:
        """A new request's table headed by its prefix hit, taken by reference."""
        for b in computed:
            if b >= 0:
                self.pool.touch(b)
        self.changed(request_id, 0)
        # Hashes of the hit blocks are recomputed lazily by publish, from the token ids.
        return GroupTable(list(computed), num_released=sum(1 for b in computed if b == RELEASED))

    def blocks_to_admit(self, computed: list[int], n: int) -> int:
        """Free blocks a new request with this prefix hit and n more tokens takes: its new
        blocks, and the hit blocks it revives from the free queue."""
        revived = sum(1 for b in computed if b >= 0 and self.blocks[b].ref_cnt == 0)
        return self.blocks_to_write(computed, len(computed) * self.block_size, n) + revived

    def write(self, req: RequestTables, n: int) -> None:
        """Room in the table for n > 0 tokens after req.num_tokens (the caller advances it):
        a copy of a shared partial block first, then new blocks."""
        table = req.tables[self.index].block_table
        nt = req.num_tokens
        if self.needs_cow(table, nt):
            i = (nt - 1) // self.block_size
            src = table[i]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            table[i] = dst
            self.changed(req.request_id, i)
            self.copies.append((src, dst))
            self.num_cow_copies += 1
        extra = self.blocks_to_write(table, nt, n)  # new blocks only, once the copy is made
        if extra:
            start = len(table)
            table.extend(self.pool.allocate(extra))
            self.changed(req.request_id, start)

    def blocks_to_write_many(
        self, items: list[tuple[str, int]], requests: dict[str, RequestTables]
    ) -> int:
        """``blocks_to_write`` summed over running requests (the scheduler's batch count)."""
        g = self.index
        total = 0
        for rid, n in items:
            req = requests[rid]
            total += self.blocks_to_write(req.tables[g].block_table, req.num_tokens, n)
        return total

    def write_many(
        self, items: list[tuple[str, int]], requests: dict[str, RequestTables], advance: bool
    ) -> None:
        """``write`` for running requests that fit (the per-step hot path): a request whose
        tokens fit in its own partial block is skipped in line. ``advance``: this is the last
        group, so it moves each request's num_tokens on (the others have read it already)."""
        bs, g, needs_cow = self.block_size, self.index, self.needs_cow
        for rid, n in items:
            req = requests[rid]
            nt = req.num_tokens
            r = nt % bs
            if not (
                r and n <= bs - r and not req.swapped
                and not needs_cow(req.tables[g].block_table, nt)
            ):
                if req.swapped:
                    raise CacheError(f"request {rid!r} is swapped out; swap it in first")
                if n:
                    self.write(req, n)
            if advance:
                req.num_tokens = nt + n

    # -- fork, free, trim --------------------------------------------------------------------
    def fork(self, child_id: str, parent: GroupTable) -> GroupTable:
        """The child's table: every block of the parent's, by reference."""
        for b in parent.block_table:
            if b >= 0:
                self.pool.touch(b)
        self.changed(child_id, 0)
        return GroupTable(
            list(parent.block_table), list(parent.block_hashes), {}, parent.num_released
        )

    def free(self, request_id: str, t: GroupTable) -> list[int]:
        """Return the table's device blocks tail first (so the tail is evicted first); its
        host blocks are returned to the caller, who owns the host pool."""
        self.dirty.pop(request_id, None)
        self.pool.free([b for b in reversed(t.block_table) if b >= 0])
        return list(t.host_blocks.values())

    def trim_refused(self, t: GroupTable, num_tokens: int) -> bool:
        """Whether the window at num_tokens needs blocks this table released already."""
        return t.num_released > self.policy.first_live_block(num_tokens)

    def trim(self, req: RequestTables, num_tokens: int) -> None:
        """Shrink the table to cover num_tokens (the caller has checked ``trim_refused``)."""
        t = req.tables[self.index]
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(t.block_table):
            self.pool.free([b for b in reversed(t.block_table[keep:]) if b >= 0])
            del t.block_table[keep:]
            self.changed(req.request_id, keep)
        del t.block_hashes[num_tokens // self.block_size :]

    # -- swap --------------------------------------------------------------------------------
    def private_blocks(self, t: GroupTable) -> list[int]:
        """Logical indices whose device block only this request holds.

        Shared blocks stay resident: moving them frees no device memory, and their other
        holders keep using them. So nothing shared is ever copied twice.
        """
        blocks = self.blocks
        return [i for i, b in enumerate(t.block_table) if b >= 0 and blocks[b].ref_cnt == 1]

    def shared_prefix(self, t: GroupTable) -> int:
        """Leading blocks other requests also hold (what a recompute can count on finding)."""
        n = 0
        for b in t.block_table:
            if b < 0 or self.blocks[b].ref_cnt < 2:
                break
            n += 1
        return n

    def swap_out(
        self, request_id: str, t: GroupTable, idx: list[int], host: list[int]
    ) -> list[tuple[int, int]]:
        """Move the blocks at logical indices ``idx`` to ``host``: (device, host) pairs."""
        pairs = []
        for i, h in zip(idx, host):
            pairs.append((t.block_table[i], h))
            t.host_blocks[i] = h
            t.block_table[i] = SWAPPED
            self.changed(request_id, i)
        # Device blocks go back to the pool (their prefix hash stays: still reusable).
        self.pool.free([d for d, _ in reversed(pairs)])
        return pairs

    def swap_in(self, request_id: str, t: GroupTable) -> list[tuple[int, int]]:
        """Bring the table's host blocks back to new device blocks: (host, device) pairs."""
        dev = self.pool.allocate(len(t.host_blocks))
        pairs = []
        for (i, h), d in zip(sorted(t.host_blocks.items()), dev):
            t.block_table[i] = d
            self.changed(request_id, i)
            pairs.append((h, d))
        # The new copies are private: full ones are re-published lazily, from the first moved.
        if t.host_blocks:
            del t.block_hashes[min(t.host_blocks) :]
        t.host_blocks.clear()
        return pairs
