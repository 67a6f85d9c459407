"""Per-request block tables over the BlockPool: prefix reuse, fork/copy-on-write and swap maps.

The manager accounts; it never touches tensors. Every physical copy it needs (a COW copy, a
swap in either direction) is returned or queued as (src, dst) block pairs for the runner to
carry out in one batched operation per step, and every change to a block table is queued as a
``TableDelta`` (``take_table_deltas``) for the runner's own copy of the tables. Operations that cannot be satisfied raise a
``CacheError`` (or return False for the scheduler's "would it fit" questions) and leave the
state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.cache.block_hash import DEFAULT_HASH_ALGO, get_hash_fn
from kvledger.cache.block_pool import BlockPool
from kvledger.cache.table_delta import TableDelta, TableDeltas
from kvledger.errors import CacheError, OutOfBlocksError
from kvledger.ledger.snapshot import LedgerSnapshot, RequestBlocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Block-table entry of a block released because it fell wholly outside the sliding window
# (-1 marks a block swapped out to the host).
RELEASED = -2


def first_live_block(next_position: int, window: int, block_size: int) -> int:
    """Blocks before this one hold no key that a query at next_position or later can see:
    such a query sees positions p - window < j <= p only."""
    return max(0, next_position - window + 1) // block_size


@dataclass(slots=True)
class _RequestBlocks:
    request_id: str
    block_table: list[int] = field(default_factory=list)  # -1 where the block is on the host
    num_tokens: int = 0  # token slots the table covers (computed + scheduled)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    salt: str | None = None
    host_blocks: dict[int, int] = field(default_factory=dict)  # logical idx -> host block
    # Between swap_out and swap_in, even when no block had to move (all of them shared).
    swapped: bool = False
    num_released: int = 0  # leading entries released from the sliding window (RELEASED)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_token: int = 0,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        sliding_window: int | None = None,
        hash_algo: str = DEFAULT_HASH_ALGO,
        pool: BlockPool | None = None,
        host_pool: BlockPool | None = None,
        hash_root: int | None = None,
    ) -> None:
        """``hash_algo``: the chained block hash (kvledger/cache/block_hash.py), process-stable
        unless "builtin", so routers can recompute it.

        ``sliding_window``: every layer attends to its last ``sliding_window`` tokens only
        (Mistral v0.1, Mixtral, Phi-3 with a window...), so blocks that fall wholly outside it
        are released as the request advances and stop being charged; a prefix-cache hit then
        needs only the blocks the window still covers.

        ``pool`` / ``host_pool`` / ``hash_root``: this manager is one KV cache group of a hybrid
        model (``HybridKVCacheManager``): it draws from a pool shared with the other groups, and
        its block hashes chain from ``hash_root`` so that no group can hit another's blocks."""
        if block_size <= 0:
            raise CacheError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise CacheError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.windowed = sliding_window is not None  # some blocks are released behind a window
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.bytes_per_block = bytes_per_token * block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self._hash = get_hash_fn(hash_algo)
        self.pool = pool or BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        if pool is not None:
            self.host_pool = host_pool
        else:
            self.host_pool = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None
        self.hash_root = hash_root
        self.requests: dict[str, _RequestBlocks] = {}
        # Table changes since the last take_table_deltas: request id -> first changed entry,
        # and the requests whose tables were dropped.
        self._dirty: dict[str, int] = {}
        self._removed: list[str] = []
        self._pending_copies: list[tuple[int, int]] = []
        # Counters the ledger and the metrics read (vLLM's names where they exist).
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens served from cached blocks
        self.num_cow_copies = 0

    # -- table deltas for the runner ----------------------------------------------------------
    def _new_entry(self, request_id: str, **kw) -> _RequestBlocks:
        req = _RequestBlocks(request_id, **kw)
        self.requests[request_id] = req
        self._changed(request_id, 0)
        return req

    def _changed(self, request_id: str, start: int) -> None:
        """Entries from ``start`` on of the request's table changed since the last delta."""
        d = self._dirty.get(request_id)
        if d is None or start < d:
            self._dirty[request_id] = start

    def blocks_alone(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Blocks a request needs with num_tokens slots once num_computed_tokens are computed
        (blocks behind a sliding window are released): the scheduler's "can it ever fit"."""
        n = cdiv(num_tokens, self.block_size)
        if self.sliding_window is not None:
            n -= first_live_block(num_computed_tokens, self.sliding_window, self.block_size)
        return n

    def prompt_blocks_bound(self, num_prompt_tokens: int, max_batched_tokens: int) -> int:
        """Most blocks a prompt of this length ever holds at once while it prefills in chunks
        of at most max_batched_tokens (plus its first output slot)."""
        need = cdiv(num_prompt_tokens + 1, self.block_size)
        if self.sliding_window is not None:  # blocks behind the window are released meanwhile
            need = min(need, cdiv(self.sliding_window + max_batched_tokens, self.block_size) + 1)
        return need

    def take_table_deltas(self) -> TableDeltas:
        """The table changes since the last call (the scheduler puts them in its output)."""
        reqs = self.requests
        changed = [TableDelta(rid, s, reqs[rid].block_table[s:]) for rid, s in self._dirty.items()]
        out = TableDeltas(self._removed, changed)
        self._dirty, self._removed = {}, []
        return out

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    def block_table(self, request_id: str) -> list[int]:
        return self._get(request_id).block_table

    def is_swapped(self, request_id: str) -> bool:
        return self._get(request_id).swapped

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._get(request_id).block_table)

    def _get(self, request_id: str) -> _RequestBlocks:
        try:
            return self.requests[request_id]
        except KeyError:
            raise CacheError(f"unknown request {request_id!r}") from None

    # -- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(
        self, token_ids: list[int], salt: str | None = None, max_blocks: int | None = None
    ) -> tuple[list[int], int]:
        """Longest run of cached full blocks that starts the prompt: (block ids, tokens).

        At least one prompt token is always left to compute, since its logits start decoding.
        ``max_blocks`` caps the run (a hybrid model's groups must agree on one length).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        limit = (len(token_ids) - 1) // bs
        max_blocks = limit if max_blocks is None else min(max_blocks, limit)
        if self.sliding_window is not None:
            return self._window_hit(token_ids, salt, max_blocks)
        hits: list[int] = []
        parent_hash: int | None = self.hash_root
        parent_id: int | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._hash(parent_hash, tokens, salt if i == 0 else None)
            block_id = self.pool.lookup(h, tokens, parent_id, salt if i == 0 else None)
            if block_id is None:
                break
            hits.append(block_id)
            parent_hash, parent_id = h, block_id
        return hits, len(hits) * bs

    def _window_hit(
        self, token_ids: list[int], salt: str | None, max_blocks: int
    ) -> tuple[list[int], int]:
        """Longest prefix whose window is cached: blocks before the window may be gone (they
        are returned as RELEASED). Within the run, each block's parent is checked by id as in
        the full-attention lookup; the run's first block is matched by its chained hash."""
        bs, window = self.block_size, self.sliding_window
        ids: list[int | None] = []
        run: list[int] = []  # length of the verified run of cached blocks ending at each index
        parent_hash: int | None = self.hash_root
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block_salt = salt if i == 0 else None
            h = self._hash(parent_hash, tokens, block_salt)
            parent_hash = h
            block_id = self.pool.lookup(h, tokens, None, block_salt, check_parent=False)
            ids.append(block_id)
            if block_id is None:
                run.append(0)
            elif i > 0 and run[i - 1] and self.pool.blocks[block_id].parent_block_id == ids[i - 1]:
                run.append(run[i - 1] + 1)
            else:
                run.append(1)
        for n in range(max_blocks, 0, -1):
            first = first_live_block(n * bs, window, bs)
            if run[n - 1] >= n - first:
                return [RELEASED] * first + [b for b in ids[first:n]], n * bs
        return [], 0

    def release_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the request's blocks that no query at num_computed_tokens or later can see
        (the engine does this for every scheduled request after each step)."""
        if self.sliding_window is not None:
            self._release_outside_window(self._get(request_id), num_computed_tokens)

    def _release_outside_window(self, req: _RequestBlocks, num_computed_tokens: int) -> None:
        """Release the leading blocks no future query can see (sliding window)."""
        dead = min(first_live_block(num_computed_tokens, self.sliding_window, self.block_size),
                   len(req.block_table))
        if dead <= req.num_released or req.swapped:
            return
        freed = []
        for i in range(req.num_released, dead):
            b = req.block_table[i]
            if b >= 0:
                freed.append(b)
            req.block_table[i] = RELEASED
        self._changed(req.request_id, req.num_released)
        req.num_released = dead
        self.pool.free(freed)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------------
    def blocks_needed(
        self, request_id: str, num_new_tokens: int, computed_blocks: list[int] = ()
    ) -> int:
        """Free blocks an ``allocate_slots`` call with these arguments would consume."""
        req = self.requests.get(request_id)
        bs = self.block_size
        if req is None:
            total = len(computed_blocks) * bs + num_new_tokens
            revived = sum(1 for b in computed_blocks if b >= 0 and self.pool.blocks[b].ref_cnt == 0)
            return cdiv(total, bs) - len(computed_blocks) + revived
        nt = req.num_tokens
        need = (nt + num_new_tokens + bs - 1) // bs - len(req.block_table)
        if need < 0:
            need = 0
        if num_new_tokens > 0 and nt % bs and self._needs_cow(req):
            need += 1
        return need

    def _needs_cow(self, req: _RequestBlocks) -> bool:
        """The next write lands in a shared, partly filled block."""
        if req.num_tokens % self.block_size == 0 or not req.block_table:
            return False
        last = req.block_table[(req.num_tokens - 1) // self.block_size]
        if last < 0:
            return False
        # A published block (partial again after a trim) is immutable as well.
        blk = self.pool.blocks[last]
        return blk.ref_cnt > 1 or blk.block_hash is not None

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        computed_blocks: list[int] = (),
        salt: str | None = None,
    ) -> bool:
        """Make the block table cover ``num_new_tokens`` more tokens; False if they don't fit.

        For a new request, ``computed_blocks`` (from ``get_computed_blocks``) become the head
        of its table by reference. A write into a shared partial block is preceded by a COW
        copy, queued for ``take_block_copies``.
        """
        if num_new_tokens < 0:
            raise CacheError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req = self.requests.get(request_id)
        if req is not None and req.swapped:
            raise CacheError(f"request {request_id!r} is swapped out; swap it in first")
        if self.blocks_needed(request_id, num_new_tokens, computed_blocks) > self.num_free_blocks:
            return False
        if req is None:
            for b in computed_blocks:
                if b >= 0:
                    self.pool.touch(b)
            req = self._new_entry(request_id, salt=salt, block_table=list(computed_blocks))
            req.num_tokens = len(computed_blocks) * self.block_size
            req.num_released = sum(1 for b in computed_blocks if b == RELEASED)
            # Hashes of reused blocks are recomputed lazily by cache_blocks from token ids.
        if num_new_tokens == 0:
            return True
        if self._needs_cow(req):
            idx = (req.num_tokens - 1) // self.block_size
            src = req.block_table[idx]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            req.block_table[idx] = dst
            self._changed(request_id, idx)
            self._pending_copies.append((src, dst))
            self.num_cow_copies += 1
        total = req.num_tokens + num_new_tokens
        extra = cdiv(total, self.block_size) - len(req.block_table)
        if extra > 0:
            start = len(req.block_table)
            req.block_table.extend(self.pool.allocate(extra))
            self._changed(request_id, start)
        req.num_tokens = total
        return True

    def blocks_needed_total(self, items: list[tuple[str, int]]) -> int:
        """Free blocks that ``allocate_many(items)`` would consume (running requests only).

        The scheduler's per-step hot path: one call for the whole batch, arithmetic inline.
        """
        bs = self.block_size
        reqs, blocks = self.requests, self.pool.blocks
        total = 0
        for rid, n in items:
            req = reqs[rid]
            nt = req.num_tokens
            table = req.block_table
            need = (nt + n + bs - 1) // bs - len(table)
            if need > 0:
                total += need
            if n and nt % bs:
                blk = blocks[table[(nt - 1) // bs]]
                if blk.ref_cnt > 1 or blk.block_hash is not None:
                    total += 1  # copy-on-write of the shared partial block
        return total

    def fits_many(self, items: list[tuple[str, int]], num_tokens: int) -> bool:
        """Whether ``allocate_many(items)`` fits; ``num_tokens`` is the items' token total.

        A request needs at most ``n // block_size + 1`` new blocks plus one copy-on-write, so
        ``num_tokens // block_size + 2 * len(items)`` bounds the batch: when that fits, as it
        does whenever memory is ample, the batch is not walked at all.
        """
        free = self.num_free_blocks
        if num_tokens // self.block_size + 2 * len(items) <= free:
            return True
        return self.blocks_needed_total(items) <= free

    def allocate_many(self, items: list[tuple[str, int]], checked: bool = False) -> bool:
        """``allocate_slots`` for many running requests, all or nothing.

        ``checked``: the caller has just seen ``fits_many(items, ...)`` hold (the scheduler
        does, to pick victims), so the batch is not counted again.
        """
        if not checked and self.blocks_needed_total(items) > self.num_free_blocks:
            return False
        bs = self.block_size
        reqs, blocks = self.requests, self.pool.blocks
        for rid, n in items:
            req = reqs[rid]
            nt = req.num_tokens
            if nt % bs and n <= bs - nt % bs and not req.swapped:
                blk = blocks[req.block_table[(nt - 1) // bs]]
                if blk.ref_cnt == 1 and blk.block_hash is None:
                    req.num_tokens = nt + n  # fits in its own partial block: no allocation
                    continue
            self.allocate_slots(rid, n)
        return True

    def cache_computed_blocks(self, requests) -> None:
        """``cache_blocks`` for a step's requests: the per-step hot path, which skips in line
        the requests that filled no new block."""
        window = self.sliding_window
        if not self.enable_prefix_caching and window is None:
            return
        bs = self.block_size
        reqs = self.requests
        for req in requests:
            rid = req.request_id
            if self.enable_prefix_caching and req.num_computed_tokens // bs > len(reqs[rid].block_hashes):
                self.cache_blocks(rid, req.all_token_ids, req.num_computed_tokens)
            if window is not None and rid in reqs:
                # After publishing: a released block stays in the prefix cache until evicted.
                self._release_outside_window(reqs[rid], req.num_computed_tokens)

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Publish the request's blocks that became full (and computed) under their hashes."""
        if not self.enable_prefix_caching:
            return
        req = self._get(request_id)
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        if num_full <= len(req.block_hashes):
            return  # the hot path: nothing new became full this step
        if req.swapped:
            raise CacheError(f"request {request_id!r} is swapped out; swap it in first")
        parent_hash = req.block_hashes[-1] if req.block_hashes else self.hash_root
        for i in range(len(req.block_hashes), num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._hash(parent_hash, tokens, req.salt if i == 0 else None)
            parent_id = req.block_table[i - 1] if i > 0 else None
            if req.block_table[i] >= 0:  # not a block released from the window
                self.pool.register_full_block(
                    req.block_table[i], h, tokens, parent_id, req.salt if i == 0 else None, parent_hash
                )
            req.block_hashes.append(h)
            parent_hash = h

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; the first write into a shared
        partial block copies it (copy-on-write)."""
        parent = self._get(parent_id)
        if child_id in self.requests:
            raise CacheError(f"request {child_id!r} already has blocks")
        if parent.swapped:
            raise CacheError(f"cannot fork swapped-out request {parent_id!r}")
        for b in parent.block_table:
            if b >= 0:
                self.pool.touch(b)
        self._new_entry(
            child_id,
            block_table=list(parent.block_table),
            num_tokens=parent.num_tokens,
            block_hashes=list(parent.block_hashes),
            salt=parent.salt,
            num_released=parent.num_released,
        )

    def free(self, request_id: str) -> None:
        """Return every block of the request, tail first (so the tail is evicted first)."""
        req = self._get(request_id)
        del self.requests[request_id]
        self._dirty.pop(request_id, None)
        self._removed.append(request_id)
        self.pool.free([b for b in reversed(req.block_table) if b >= 0])
        if req.host_blocks:
            self.host_pool.free(list(req.host_blocks.values()))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the table to cover ``num_tokens`` (drops slots reserved but never used)."""
        req = self._get(request_id)
        if req.swapped:
            raise CacheError(f"request {request_id!r} is swapped out; swap it in first")
        if self.sliding_window is not None and req.num_released > first_live_block(
            num_tokens, self.sliding_window, self.block_size
        ):
            raise CacheError(
                f"cannot trim request {request_id!r} to {num_tokens} tokens: the window there "
                "needs blocks already released"
            )
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(req.block_table):
            self.pool.free([b for b in reversed(req.block_table[keep:]) if b >= 0])
            del req.block_table[keep:]
            self._changed(request_id, keep)
        req.num_tokens = min(req.num_tokens, num_tokens)
        del req.block_hashes[num_tokens // self.block_size :]

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- swap ---------------------------------------------------------------------------
    def _private_blocks(self, req: _RequestBlocks) -> list[int]:
        """Logical indices whose device block only this request holds.

        Shared blocks stay resident: moving them frees no device memory, and their other
        holders keep using them. So nothing shared is ever copied twice.
        """
        return [i for i, b in enumerate(req.block_table) if b >= 0 and self.pool.blocks[b].ref_cnt == 1]

    def can_swap_out(self, request_id: str) -> bool:
        req = self._get(request_id)
        return self.host_pool is not None and len(self._private_blocks(req)) <= self.num_free_host_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's private blocks to the host pool: (device, host) pairs to copy."""
        req = self._get(request_id)
        if req.swapped:
            raise CacheError(f"request {request_id!r} is already swapped out")
        idx = self._private_blocks(req)
        if self.host_pool is None or len(idx) > self.num_free_host_blocks:
            raise OutOfBlocksError(
                f"host swap pool has {self.num_free_host_blocks} free blocks, need {len(idx)}"
            )
        host = self.host_pool.allocate(len(idx))
        pairs = []
        for i, h in zip(idx, host):
            pairs.append((req.block_table[i], h))
            req.host_blocks[i] = h
            req.block_table[i] = -1
            self._changed(request_id, i)
        req.swapped = True
        # Device blocks go back to the pool (their prefix hash stays: still reusable).
        self.pool.free([d for d, _ in reversed(pairs)])
        return pairs

    def swap_in_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Free blocks to swap a request back in and give it ``num_new_tokens`` more slots:
        its host blocks, new blocks, and a COW copy if its partial block is shared."""
        req = self._get(request_id)
        need = len(req.host_blocks)
        need += max(0, cdiv(req.num_tokens + num_new_tokens, self.block_size) - len(req.block_table))
        if num_new_tokens > 0 and self._needs_cow(req):
            need += 1
        return need

    def preemption_footprint(self, request_id: str) -> tuple[int, int]:
        """(private blocks a swap would move, leading blocks other requests also hold).

        The second is what a recompute can count on finding again in the prefix cache.
        """
        req = self._get(request_id)
        shared_prefix = 0
        for b in req.block_table:
            if b < 0 or self.pool.blocks[b].ref_cnt < 2:
                break
            shared_prefix += 1
        return len(self._private_blocks(req)), shared_prefix

    def can_swap_in(self, request_id: str) -> bool:
        return len(self._get(request_id).host_blocks) <= self.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back: (host, device) pairs to copy."""
        req = self._get(request_id)
        if not req.swapped:
            raise CacheError(f"request {request_id!r} is not swapped out")
        n = len(req.host_blocks)
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"need {n} free KV blocks to swap in, only {self.num_free_blocks}")
        dev = self.pool.allocate(n)
        pairs = []
        for (i, h), d in zip(sorted(req.host_blocks.items()), dev):
            req.block_table[i] = d
            self._changed(request_id, i)
            pairs.append((h, d))
        self.host_pool.free([h for h, _ in pairs])
        req.host_blocks.clear()
        req.swapped = False
        # The new device copies are private; re-publish full ones lazily via cache_blocks.
        req.block_hashes = req.block_hashes[: self._first_moved(pairs, req)]
        return pairs

    def _first_moved(self, pairs: list[tuple[int, int]], req: _RequestBlocks) -> int:
        moved = {d for _, d in pairs}
        for i, b in enumerate(req.block_table):
            if b in moved:
                return i
        return len(req.block_table)

    # -- the ledger -----------------------------------------------------------------------
    def ledger(self, groups: list[KVCacheManager] | None = None) -> LedgerSnapshot:
        """A snapshot of the live pool, computed from the same state the scheduler uses.

        ``groups``: a hybrid model's KV cache groups sharing this pool (this one first); each
        request's blocks are summed over them and a token counts once per group holding it."""
        bs = self.block_size
        blocks = self.pool.blocks
        fill: dict[int, int] = {}
        per_request: dict[str, RequestBlocks] = {}
        for m in groups or [self]:
            for rid, req in m.requests.items():
                private = shared = 0
                for i, b in enumerate(req.block_table):
                    if b < 0:
                        continue
                    n = min(bs, req.num_tokens - i * bs)
                    fill[b] = max(fill.get(b, 0), n)
                    if blocks[b].ref_cnt > 1:
                        shared += 1
                    else:
                        private += 1
                prev = per_request.get(rid)
                if prev is not None:
                    private += prev.private_blocks
                    shared += prev.shared_blocks
                per_request[rid] = RequestBlocks(
                    num_tokens=req.num_tokens,
                    blocks=private + shared,
                    private_blocks=private,
                    shared_blocks=shared,
                    swapped_blocks=len(req.host_blocks) + (prev.swapped_blocks if prev else 0),
                )
        used = self.pool.num_used_blocks
        tokens_stored = sum(fill.values())
        # Every used block is in some table (ref counts equal holders): no walk over the pool.
        shared_blocks = sum(1 for b in fill if blocks[b].ref_cnt > 1)
        cached = self.pool.num_cached_free
        return LedgerSnapshot(
            total_blocks=self.pool.num_blocks,
            used_blocks=used,
            free_blocks=self.pool.num_free_blocks - cached,
            cached_blocks=cached,
            block_size=bs,
            bytes_per_token=self.bytes_per_token,
            bytes_per_block=self.bytes_per_block,
            tokens_stored=tokens_stored,
            shared_blocks=shared_blocks,
            utilization=tokens_stored / (used * bs) if used else 1.0,
            usage=used / self.pool.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            cow_copies=self.num_cow_copies,
            host_total_blocks=self.host_pool.num_blocks if self.host_pool else 0,
            swapped_blocks=self.host_pool.num_used_blocks if self.host_pool else 0,
            requests=per_request,
        )

    def pool_fill(self) -> tuple[int, dict[int, int]]:
        """(unique tokens stored in used blocks, {shared block: fill}): the simulator's memory
        probe, every step (see ``pool_fill``)."""
        return pool_fill(self.pool, list(self.requests.values()), self.block_size)

    def resident_tokens(self) -> tuple[int, int]:
        """(requests with their blocks on the device, their tokens)."""
        resident = tokens = 0
        for req in self.requests.values():
            if not req.swapped:
                resident += 1
                tokens += req.num_tokens
        return resident, tokens

    def check_invariants(self) -> None:
        """Ref counts equal the number of holders; host blocks are held exactly once."""
        holders: dict[int, int] = {}
        host_holders: dict[int, int] = {}
        self.count_holders(holders, host_holders)
        check_pool_holders(self.pool, self.host_pool, holders, host_holders)

    def count_holders(self, holders: dict[int, int], host_holders: dict[int, int]) -> None:
        """Check each table's length and count its device and host blocks."""
        for req in self.requests.values():
            assert len(req.block_table) == cdiv(req.num_tokens, self.block_size), req
            for b in req.block_table:
                if b >= 0:
                    holders[b] = holders.get(b, 0) + 1
            for h in req.host_blocks.values():
                host_holders[h] = host_holders.get(h, 0) + 1


def check_pool_holders(
    pool: BlockPool, host_pool: BlockPool | None, holders: dict[int, int], host_holders: dict[int, int]
) -> None:
    """Every block's ref count equals the number of tables holding it."""
    pool.check_invariants()
    for blk in pool.blocks:
        assert blk.ref_cnt == holders.get(blk.block_id, 0), (blk, holders.get(blk.block_id))
    if host_pool:
        host_pool.check_invariants()
        for blk in host_pool.blocks:
            assert blk.ref_cnt == host_holders.get(blk.block_id, 0)


def pool_fill(pool: BlockPool, tables: list[_RequestBlocks], bs: int) -> tuple[int, dict[int, int]]:
    """(unique tokens stored in used blocks, {shared block: fill}).

    Fast path: sharing (prefix hits, forks) covers a prefix of each block table, so each table
    is scanned only while its blocks are shared. The identity "table entries = used blocks +
    sum over shared blocks of (holders - 1)" proves no shared block was missed; if it fails,
    every block is scanned. ``tables``: every table holding blocks of ``pool`` (all KV cache
    groups' of a hybrid model).
    """
    blocks = pool.blocks
    shared: dict[int, int] = {}
    private_tokens = entries = 0
    for req in tables:
        table, n = req.block_table, req.num_tokens
        if req.swapped:  # rare: some entries are on the host
            for i, b in enumerate(table):
                if b >= 0:
                    entries += 1
                    f = min(bs, n - i * bs)
                    if blocks[b].ref_cnt > 1:
                        shared[b] = max(shared.get(b, 0), f)
                    else:
                        private_tokens += f
            continue
        k = 0
        while k < len(table) and blocks[table[k]].ref_cnt > 1:
            f = min(bs, n - k * bs)
            if shared.get(table[k], -1) < f:
                shared[table[k]] = f
            k += 1
        entries += len(table)
        private_tokens += max(0, n - k * bs)
    extra = sum(blocks[b].ref_cnt - 1 for b in shared)
    if entries - extra == pool.num_used_blocks:
        return private_tokens + sum(shared.values()), shared
    fill: dict[int, int] = {}
    for req in tables:
        for i, b in enumerate(req.block_table):
            if b >= 0:
                fill[b] = max(fill.get(b, 0), min(bs, req.num_tokens - i * bs))
    return sum(fill.values()), {b: f for b, f in fill.items() if blocks[b].ref_cnt > 1}
