"""The block manager: per-request block tables over the BlockPool, prefix reuse, fork/copy-on-write
and swap maps, for one KV cache group or several.

A plain model is one group of every layer; a hybrid model (Gemma 2/3: full and sliding layers)
has several (``kvledger.ledger.kv_cache_groups``), each with its own tables and attention policy
over one shared pool (``KVCacheGroup``). The scheduler sees one manager either way: a request
fits when the sum of the groups' needs fits, and each operation is applied to every group, all
or nothing.

The manager accounts; it never touches tensors. Every physical copy it needs (a COW copy, a
swap in either direction) is returned or queued as (src, dst) block pairs for the runner to
carry out in one batched operation per step, and every change to a block table is queued as a
``TableDelta`` tagged with its group (``take_table_deltas``) for the runner's own copy of the
tables. Operations that cannot be satisfied raise a ``CacheError`` (or return False for the
scheduler's "would it fit" questions) and leave the state unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvledger.cache.attention_policy import attention_policy, cdiv
from kvledger.cache.block_hash import DEFAULT_HASH_ALGO, get_hash_fn
from kvledger.cache.block_pool import BlockPool
from kvledger.cache.kv_cache_group import KVCacheGroup, RequestTables
from kvledger.cache.kv_tiers import KVTiers
from kvledger.cache.table_delta import TableDeltas
from kvledger.cache.tier_hit import TierHit, find_tier_hit
from kvledger.errors import CacheError, ConfigError, OutOfBlocksError
from kvledger.ledger.snapshot import LedgerSnapshot, RequestBlocks, block_fill


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
        windows: Sequence[int | None] | None = None,
    ) -> None:
        """``windows``: each KV cache group's sliding window (None: full attention), in the
        layout's order; ``sliding_window`` is the one-group shorthand (every layer attends to
        its last ``sliding_window`` tokens: Mistral v0.1, Phi-3 with a window...). A window's
        blocks that fall wholly outside it are released as the request advances and stop being
        charged; a prefix-cache hit then needs only the blocks the window still covers.

        ``bytes_per_token``: one pool slot (a group's layers). ``hash_algo``: the chained block
        hash (kvledger/cache/block_hash.py), process-stable unless "builtin", so routers can
        recompute it."""
        if block_size <= 0:
            raise CacheError(f"block_size must be positive, got {block_size}")
        if windows is None:
            windows = [sliding_window]
        elif sliding_window is not None:
            raise CacheError("give sliding_window (one group) or windows (each group's), not both")
        if not windows:
            raise CacheError("a KV cache needs at least one group")
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.bytes_per_block = bytes_per_token * block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.host_pool = (
            BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None
        )
        hash_fn = get_hash_fn(hash_algo)
        self.groups = [
            KVCacheGroup(
                g,
                attention_policy(block_size, w),
                self.pool,
                hash_fn,
                None if g == 0 else hash_fn(None, (), f"kv-cache-group-{g}"),
                enable_prefix_caching,
            )
            for g, w in enumerate(windows)
        ]
        self.windows = list(windows)
        # Whether blocks_alone is more than cdiv(num_tokens, block_size): a window releases
        # blocks, or several groups hold tables (the scheduler inlines the plain case).
        self.windowed = len(self.groups) > 1 or any(w is not None for w in self.windows)
        self.requests: dict[str, RequestTables] = {}
        self._no_hit: list[list[int]] = [[] for _ in self.groups]
        self._removed: list[str] = []  # requests whose tables were dropped since the last deltas
        # Counters the ledger and the metrics read (vLLM's names where they exist).
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens served from cached blocks
        self.tiers: KVTiers | None = None  # lower tiers of the prefix cache (attach_tiers)

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

    @property
    def num_cow_copies(self) -> int:
        return sum(g.num_cow_copies for g in self.groups)

    def _get(self, request_id: str) -> RequestTables:
        try:
            return self.requests[request_id]
        except KeyError:
            raise CacheError(f"unknown request {request_id!r}") from None

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's table in ``group`` (SWAPPED / RELEASED where no device block)."""
        return self._get(request_id).tables[group].block_table

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [t.block_table for t in self._get(request_id).tables]

    def is_swapped(self, request_id: str) -> bool:
        return self._get(request_id).swapped

    def num_blocks_of(self, request_id: str) -> int:
        """Device blocks the request holds now, over all groups."""
        return sum(sum(1 for b in t.block_table if b >= 0) for t in self._get(request_id).tables)

    def blocks_alone(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Blocks a request needs with num_tokens slots once num_computed_tokens are computed
        (blocks behind a window released): the scheduler's "can it ever fit"."""
        return sum(g.policy.blocks_alone(num_computed_tokens, num_tokens) for g in self.groups)

    def prompt_blocks_bound(self, num_prompt_tokens: int, max_batched_tokens: int) -> int:
        """Most blocks a prompt of this length ever holds at once while it prefills in chunks
        of at most max_batched_tokens (plus its first output slot), over all groups."""
        return sum(
            g.policy.prompt_blocks_bound(num_prompt_tokens, max_batched_tokens) for g in self.groups
        )

    def resident_tokens(self) -> tuple[int, int]:
        """(requests with their blocks on the device, their tokens)."""
        resident = tokens = 0
        for req in self.requests.values():
            if not req.swapped:
                resident += 1
                tokens += req.num_tokens
        return resident, tokens

    # -- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(
        self, token_ids: list[int], salt: str | None = None
    ) -> tuple[list[list[int]], int]:
        """Each group's blocks of the longest cached prefix every group can serve, and its
        tokens. At least one prompt token is always left to compute (its logits start decoding).

        A full-attention group can serve any prefix of its longest hit; a sliding group needs
        only its window's blocks before the hit point, but which lengths it can serve is not
        prefix-closed. So the length is narrowed group by group until all agree (vLLM's hybrid
        lookup does the same); one group agrees with itself at once.
        """
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        n = (len(token_ids) - 1) // self.block_size
        hits: list[list[int] | None] = [None] * len(self.groups)
        agreed = False
        while not agreed and n > 0:
            agreed = True
            for g, group in enumerate(self.groups):
                if hits[g] is not None and len(hits[g]) == n:
                    continue
                hits[g] = group.longest_hit(token_ids, salt, n)
                if len(hits[g]) < n:
                    n, agreed = len(hits[g]), False
        if n <= 0:
            return [[] for _ in self.groups], 0
        # A longer prefix-closed hit truncates; the others agreed at n.
        return [h[:n] for h in hits], n * self.block_size

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Keep evicted prefix blocks in host memory / on disk (kvledger.cache.kv_tiers). Every
        group's blocks go there under their own group's hash chain (kvledger.cache.tier_hit)."""
        if not self.enable_prefix_caching:
            raise ConfigError("kv offloading keeps prefix-cache blocks: it needs prefix caching on")
        self.tiers = tiers
        self.pool.evicted = []

    def tier_hit(self, token_ids: list[int], salt: str | None, num_cached: int) -> TierHit | None:
        """A longer hit than the device's ``num_cached`` tokens with the lower tiers' blocks,
        valid in every group, leaving at least one prompt token to compute; None: none."""
        if self.tiers is None or self.tiers.empty:
            return None
        n = (len(token_ids) - 1) // self.block_size
        return find_tier_hit(self.groups, self.tiers, token_ids, salt, num_cached // self.block_size, n)

    def allocate_tier_hit(self, request_id: str, hit: TierHit, salt: str | None) -> list[int] | None:
        """Tables for a new request from ``hit``: device blocks by reference, a fresh block for
        each load (returned in ``hit.loads``' order); None if they do not fit (nothing changes)."""
        if request_id in self.requests:
            raise CacheError(f"request {request_id!r} already has blocks")
        if hit.revived(self.pool) + len(hit.loads) > self.num_free_blocks:
            return None
        # Hits are taken before the fresh blocks are allocated (they may sit in the free queue).
        tables = [g.take_hit(request_id, t) for g, t in zip(self.groups, hit.tables)]
        fresh = self.pool.allocate(len(hit.loads))
        for (gi, i, _), b in zip(hit.loads, fresh):
            tables[gi].block_table[i] = b
        self.requests[request_id] = RequestTables(request_id, tables, hit.num_blocks * self.block_size, salt)
        return fresh

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Once per request, at its first admission; the tiers count what the device missed."""
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens
        if self.tiers is not None:
            self.tiers.query_tokens += num_prompt_tokens - num_hit_tokens

    # -- allocation -------------------------------------------------------------------------
    def _hits(self, computed_blocks: Sequence[list[int]]) -> Sequence[list[int]]:
        if not computed_blocks:
            return self._no_hit
        if len(computed_blocks) != len(self.groups):
            raise CacheError(
                f"computed_blocks has {len(computed_blocks)} lists, one per KV cache group "
                f"({len(self.groups)}) expected: pass get_computed_blocks' as they are"
            )
        return computed_blocks

    def blocks_needed(
        self, request_id: str, num_new_tokens: int, computed_blocks: Sequence[list[int]] = ()
    ) -> int:
        """Free blocks an ``allocate_slots`` call with these arguments would consume."""
        req = self.requests.get(request_id)
        if req is None:
            hits = self._hits(computed_blocks)
            return sum(g.blocks_to_admit(c, num_new_tokens) for g, c in zip(self.groups, hits))
        nt = req.num_tokens
        return sum(
            g.blocks_to_write(t.block_table, nt, num_new_tokens)
            for g, t in zip(self.groups, req.tables)
        )

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        computed_blocks: Sequence[list[int]] = (),
        salt: str | None = None,
    ) -> bool:
        """Make the request's tables cover ``num_new_tokens`` more tokens; False if they don't
        fit (nothing changes then).

        For a new request, ``computed_blocks`` (from ``get_computed_blocks``) become the head
        of its tables by reference. A write into a shared partial block is preceded by a COW
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
            # Every group takes its hit before any allocates: a group's new blocks come from the
            # front of the shared free queue, where another group's cached hit blocks may sit.
            hits = self._hits(computed_blocks)
            tables = [g.take_hit(request_id, c) for g, c in zip(self.groups, hits)]
            req = RequestTables(request_id, tables, len(hits[0]) * self.block_size, salt)
            self.requests[request_id] = req
        if num_new_tokens:
            for g in self.groups:
                g.write(req, num_new_tokens)
            req.num_tokens += num_new_tokens
        return True

    def blocks_needed_total(self, items: list[tuple[str, int]]) -> int:
        """Free blocks that ``allocate_many(items)`` would consume (running requests only)."""
        total = 0
        for g in self.groups:
            total += g.blocks_to_write_many(items, self.requests)
        return total

    def fits_many(self, items: list[tuple[str, int]], num_tokens: int) -> bool:
        """Whether ``allocate_many(items)`` fits; ``num_tokens`` is the items' token total.

        A request needs at most ``n // block_size + 1`` new blocks plus one copy-on-write per
        group, so that times the groups bounds the batch: when it fits, as it does whenever
        memory is ample, the batch is not walked at all.
        """
        free = self.pool.num_free_blocks
        if len(self.groups) * (num_tokens // self.block_size + 2 * len(items)) <= free:
            return True
        return self.blocks_needed_total(items) <= free

    def allocate_many(self, items: list[tuple[str, int]], checked: bool = False) -> bool:
        """``allocate_slots`` for many running requests, all or nothing; group by group, as
        the hot path of every step (``KVCacheGroup.write_many``).

        ``checked``: the caller has just seen ``fits_many(items, ...)`` hold (the scheduler
        does, to pick victims), so the batch is not counted again.
        """
        if not checked and self.blocks_needed_total(items) > self.pool.num_free_blocks:
            return False
        last = self.groups[-1]
        for g in self.groups:
            g.write_many(items, self.requests, advance=g is last)
        return True

    # -- after a step ----------------------------------------------------------------------
    def cache_computed_blocks(self, stepped: list[Any]) -> None:
        """Publish the step's newly full blocks and release those behind each window, for the
        step's requests: ``Scheduler.update_after_step`` calls it."""
        for g in self.groups:
            g.publish_and_release(stepped, self.requests)

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Publish the request's blocks that became full (and computed) under their hashes."""
        if not self.enable_prefix_caching:
            return
        req = self._get(request_id)
        for g in self.groups:
            g.publish(req, token_ids, num_computed_tokens)

    def release_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the request's blocks that no query at num_computed_tokens or later can see
        (``cache_computed_blocks`` does this for every scheduled request after each step)."""
        req = self._get(request_id)
        for g in self.groups:
            g.release(req, num_computed_tokens)

    # -- fork, free, trim -------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; the first write into a shared
        partial block copies it (copy-on-write)."""
        parent = self._get(parent_id)
        if child_id in self.requests:
            raise CacheError(f"request {child_id!r} already has blocks")
        if parent.swapped:
            raise CacheError(f"cannot fork swapped-out request {parent_id!r}")
        tables = [g.fork(child_id, t) for g, t in zip(self.groups, parent.tables)]
        self.requests[child_id] = RequestTables(child_id, tables, parent.num_tokens, parent.salt)

    def free(self, request_id: str) -> None:
        """Return every block of the request, tail first (so the tail is evicted first)."""
        req = self._get(request_id)
        del self.requests[request_id]
        self._removed.append(request_id)
        for g, t in zip(self.groups, req.tables):
            host = g.free(request_id, t)
            if host:
                self.host_pool.free(host)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the tables to cover ``num_tokens`` (drops slots reserved but never used)."""
        req = self._get(request_id)
        if req.swapped:
            raise CacheError(f"request {request_id!r} is swapped out; swap it in first")
        if any(g.trim_refused(t, num_tokens) for g, t in zip(self.groups, req.tables)):
            raise CacheError(
                f"cannot trim request {request_id!r} to {num_tokens} tokens: the window there "
                "needs blocks already released"
            )
        for g in self.groups:
            g.trim(req, num_tokens)
        req.num_tokens = min(req.num_tokens, num_tokens)

    # -- for the runner ---------------------------------------------------------------------
    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call."""
        return [c for g in self.groups for c in g.take_copies()]

    def take_table_deltas(self) -> TableDeltas:
        """The table changes since the last call, each tagged with its group (the scheduler
        puts them in its output); a freed request's tables go in every group at once."""
        changed = [d for g in self.groups for d in g.take_deltas(self.requests)]
        out = TableDeltas(self._removed, changed)
        self._removed = []
        return out

    # -- swap: each group's private device blocks move, released ones are not there --------
    def _private(self, req: RequestTables) -> list[list[int]]:
        return [g.private_blocks(t) for g, t in zip(self.groups, req.tables)]

    def can_swap_out(self, request_id: str) -> bool:
        need = sum(len(i) for i in self._private(self._get(request_id)))
        return self.host_pool is not None and need <= self.num_free_host_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's private blocks to the host pool: (device, host) pairs to copy."""
        req = self._get(request_id)
        if req.swapped:
            raise CacheError(f"request {request_id!r} is already swapped out")
        idx = self._private(req)
        need = sum(len(i) for i in idx)
        if self.host_pool is None or need > self.num_free_host_blocks:
            raise OutOfBlocksError(
                f"host swap pool has {self.num_free_host_blocks} free blocks, need {need}"
            )
        pairs: list[tuple[int, int]] = []
        for g, t, i in zip(self.groups, req.tables, idx):
            pairs += g.swap_out(request_id, t, i, self.host_pool.allocate(len(i)))
        req.swapped = True
        return pairs

    def swap_in_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Free blocks to swap a request back in and give it ``num_new_tokens`` more slots:
        its host blocks, new blocks, and a COW copy if its partial block is shared."""
        req = self._get(request_id)
        return sum(
            len(t.host_blocks) + g.blocks_to_write(t.block_table, req.num_tokens, num_new_tokens)
            for g, t in zip(self.groups, req.tables)
        )

    def can_swap_in(self, request_id: str) -> bool:
        return sum(len(t.host_blocks) for t in self._get(request_id).tables) <= self.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back: (host, device) pairs to copy."""
        req = self._get(request_id)
        if not req.swapped:
            raise CacheError(f"request {request_id!r} is not swapped out")
        n = sum(len(t.host_blocks) for t in req.tables)
        if n > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {n} free KV blocks to swap in, only {self.num_free_blocks}"
            )
        pairs: list[tuple[int, int]] = []
        for g, t in zip(self.groups, req.tables):
            moved = g.swap_in(request_id, t)
            if moved:
                self.host_pool.free([h for h, _ in moved])
            pairs += moved
        req.swapped = False
        return pairs

    def preemption_footprint(self, request_id: str) -> tuple[int, int]:
        """(private blocks a swap would move, over all groups; leading blocks of group 0 that
        other requests also hold). The second is what a recompute can count on finding again
        in the prefix cache."""
        req = self._get(request_id)
        private = sum(len(i) for i in self._private(req))
        return private, self.groups[0].shared_prefix(req.tables[0])

    # -- the ledger -----------------------------------------------------------------------
    def tables(self) -> Iterator[tuple[str, int, list[int], dict[int, int]]]:
        """(request id, token slots, block table, host blocks) of every group's table, group by
        group: what the block map (``kvledger.ledger.block_map``) draws."""
        for g in range(len(self.groups)):
            for rid, req in self.requests.items():
                t = req.tables[g]
                yield rid, req.num_tokens, t.block_table, t.host_blocks

    def ledger(self) -> LedgerSnapshot:
        """A snapshot of the live pool, computed from the same state the scheduler uses; each
        request's blocks are summed over its groups (a token is stored once per group)."""
        bs = self.block_size
        blocks = self.pool.blocks
        fill: dict[int, int] = {}
        per_request: dict[str, RequestBlocks] = {}
        for rid, req in self.requests.items():
            n = req.num_tokens
            private = shared = swapped = 0
            for t in req.tables:
                for i, b in enumerate(t.block_table):
                    if b < 0:
                        continue
                    f = block_fill(n, i, bs)
                    if fill.get(b, 0) < f:
                        fill[b] = f
                    if blocks[b].ref_cnt > 1:
                        shared += 1
                    else:
                        private += 1
                swapped += len(t.host_blocks)
            per_request[rid] = RequestBlocks(
                num_tokens=n,
                blocks=private + shared,
                private_blocks=private,
                shared_blocks=shared,
                swapped_blocks=swapped,
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
            utilization=tokens_stored / (used * bs) if used else None,  # no slot: no ratio
            usage=used / self.pool.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            cow_copies=self.num_cow_copies,
            host_total_blocks=self.host_pool.num_blocks if self.host_pool else 0,
            swapped_blocks=self.host_pool.num_used_blocks if self.host_pool else 0,
            requests=per_request,
        )

    def pool_fill(self) -> tuple[int, dict[int, int]]:
        """(unique tokens stored in used blocks, {shared block: fill}): ``ledger()``'s figures
        without per-request objects, for the simulator's memory probe every step.

        Fast path: in a prefix-closed group sharing (prefix hits, forks) covers a prefix of
        each table, so each is scanned only while its blocks are shared; other groups' tables
        hold a window's worth of live blocks and are scanned whole. The identity "live entries
        = used blocks + sum over shared blocks of (holders - 1)" proves no shared block was
        missed; if it fails, every entry is scanned.
        """
        bs = self.block_size
        blocks = self.pool.blocks
        shared: dict[int, int] = {}
        private_tokens = entries = 0
        for g in self.groups:
            closed, gi = g.policy.prefix_closed, g.index
            for req in self.requests.values():
                t = req.tables[gi]
                table, n = t.block_table, req.num_tokens
                if req.swapped or not closed:  # some entries are on the host or released
                    for i in range(t.num_released, len(table)):
                        b = table[i]
                        if b < 0:
                            continue
                        entries += 1
                        f = block_fill(n, i, bs)
                        if blocks[b].ref_cnt > 1:
                            if shared.get(b, -1) < f:
                                shared[b] = f
                        else:
                            private_tokens += f
                    continue
                k = 0
                while k < len(table) and blocks[table[k]].ref_cnt > 1:
                    f = block_fill(n, k, bs)
                    if shared.get(table[k], -1) < f:
                        shared[table[k]] = f
                    k += 1
                entries += len(table)
                private_tokens += max(0, n - k * bs)
        extra = sum(blocks[b].ref_cnt - 1 for b in shared)
        if entries - extra == self.pool.num_used_blocks:
            return private_tokens + sum(shared.values()), shared
        fill: dict[int, int] = {}
        for _, n, table, _ in self.tables():
            for i, b in enumerate(table):
                if b >= 0:
                    f = block_fill(n, i, bs)
                    if fill.get(b, 0) < f:
                        fill[b] = f
        return sum(fill.values()), {b: f for b, f in fill.items() if blocks[b].ref_cnt > 1}

    def check_invariants(self) -> None:
        """Every table covers its request's slots; ref counts equal the number of tables
        holding each block; host blocks are held exactly once."""
        holders: dict[int, int] = {}
        host_holders: dict[int, int] = {}
        for req in self.requests.values():
            assert len(req.tables) == len(self.groups), req
            for t in req.tables:
                assert len(t.block_table) == cdiv(req.num_tokens, self.block_size), req
                for b in t.block_table:
                    if b >= 0:
                        holders[b] = holders.get(b, 0) + 1
                for h in t.host_blocks.values():
                    host_holders[h] = host_holders.get(h, 0) + 1
        self.pool.check_invariants()
        for blk in self.pool.blocks:
            assert blk.ref_cnt == holders.get(blk.block_id, 0), (blk, holders.get(blk.block_id))
        if self.host_pool:
            self.host_pool.check_invariants()
            for blk in self.host_pool.blocks:
                assert blk.ref_cnt == host_holders.get(blk.block_id, 0)
