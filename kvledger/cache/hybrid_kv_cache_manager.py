"""Per-group block tables over one shared BlockPool, for hybrid (full + sliding-window) models.

Each KV cache group (``kvledger.ledger.kv_cache_groups``) is a plain ``KVCacheManager`` with its
own window, drawing from the pool the groups share; this class answers the scheduler's
questions for all groups at once (a request fits when the sum of the groups' needs fits) and
applies each operation to every group, all or nothing. A sliding group releases the blocks
that fall wholly outside its window as the request advances, so a long Gemma-3 request holds
its full-attention layers' blocks plus a window's worth for the local layers.

Prefix caching: a hit must be usable by every group. The full-attention groups can serve any
prefix of their longest hit; a sliding group needs only the window's blocks before the hit
point, but which lengths it can serve is not prefix-closed (an evicted early block can matter
to a short hit and not to a long one). So the hit length is narrowed group by group until all
agree (vLLM's hybrid lookup does the same), then each group takes its blocks for that length.
"""

from __future__ import annotations

from kvledger.cache.block_hash import DEFAULT_HASH_ALGO, get_hash_fn
from kvledger.cache.block_pool import BlockPool
from kvledger.cache.kv_cache_manager import KVCacheManager, check_pool_holders, pool_fill
from kvledger.cache.table_delta import TableDeltas
from kvledger.errors import CacheError, OutOfBlocksError
from kvledger.ledger.snapshot import LedgerSnapshot


class HybridKVCacheManager:
    """The KVCacheManager interface over KV cache groups (group 0 is full attention)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: list[int | None],
        bytes_per_token: int = 0,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        hash_algo: str = DEFAULT_HASH_ALGO,
    ) -> None:
        """``windows``: each group's sliding window (None: full attention), group 0 full.
        ``bytes_per_token``: one pool slot (group_size layers' K/V for one token)."""
        if len(windows) < 2 or windows[0] is not None:
            raise CacheError("a hybrid KV cache needs a full-attention group 0 and more groups")
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None
        self.groups = [
            KVCacheManager(
                num_blocks,
                block_size,
                bytes_per_token=bytes_per_token,
                enable_prefix_caching=enable_prefix_caching,
                sliding_window=w,
                pool=self.pool,
                host_pool=self.host_pool,
                hash_algo=hash_algo,
                # Group 0 hashes as a single-group cache would (its KV events match a router's).
                hash_root=None if g == 0 else get_hash_fn(hash_algo)(None, (), f"kv-cache-group-{g}"),
            )
            for g, w in enumerate(windows)
        ]
        self.windows = list(windows)
        self.hash_algo = hash_algo
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.bytes_per_block = bytes_per_token * block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = None  # not every layer slides: the single-window shortcuts are off
        self.windowed = True
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Sliding groups first where an operation may refuse (trim), so a refusal changes nothing.
        self._sliding_first = sorted(self.groups, key=lambda m: m.sliding_window is None)

    # -- queries ---------------------------------------------------------------------------
    @property
    def requests(self):
        """The full-attention group's entries: one per request holding blocks, every token."""
        return self.groups[0].requests

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

    def block_table(self, request_id: str) -> list[int]:
        return self.groups[0].block_table(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [g.block_table(request_id) for g in self.groups]

    def is_swapped(self, request_id: str) -> bool:
        return self.groups[0].is_swapped(request_id)

    def num_blocks_of(self, request_id: str) -> int:
        """Device blocks the request holds now, over all groups."""
        return sum(sum(1 for b in g.block_table(request_id) if b >= 0) for g in self.groups)

    def blocks_alone(self, num_computed_tokens: int, num_tokens: int) -> int:
        return sum(g.blocks_alone(num_computed_tokens, num_tokens) for g in self.groups)

    def prompt_blocks_bound(self, num_prompt_tokens: int, max_batched_tokens: int) -> int:
        return sum(g.prompt_blocks_bound(num_prompt_tokens, max_batched_tokens) for g in self.groups)

    # -- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(
        self, token_ids: list[int], salt: str | None = None
    ) -> tuple[list[list[int]], int]:
        """Per-group blocks of the longest prefix every group can serve, and its tokens."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        bs = self.block_size
        n = (len(token_ids) - 1) // bs
        hits: list[list[int] | None] = [None] * len(self.groups)
        agreed = False
        while not agreed and n > 0:
            agreed = True
            for g, m in enumerate(self.groups):
                if hits[g] is not None and len(hits[g]) == n:
                    continue
                ids, _ = m.get_computed_blocks(token_ids, salt, max_blocks=n)
                hits[g] = ids
                if len(ids) < n:
                    n, agreed = len(ids), False
        if n == 0:
            return [[] for _ in self.groups], 0
        # Full groups' hits are prefix-closed: a longer one truncates; sliding groups agreed at n.
        return [h[:n] for h in hits], n * bs

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def release_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        for g in self.groups:
            g.release_outside_window(request_id, num_computed_tokens)

    # -- allocation -------------------------------------------------------------------------
    def _computed(self, computed_blocks) -> list:
        return list(computed_blocks) if computed_blocks else [()] * len(self.groups)

    def blocks_needed(self, request_id: str, num_new_tokens: int, computed_blocks=()) -> int:
        comp = self._computed(computed_blocks)
        return sum(g.blocks_needed(request_id, num_new_tokens, c) for g, c in zip(self.groups, comp))

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, computed_blocks=(), salt: str | None = None
    ) -> bool:
        if num_new_tokens < 0:
            raise CacheError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if request_id in self.requests and self.is_swapped(request_id):
            raise CacheError(f"request {request_id!r} is swapped out; swap it in first")
        if self.blocks_needed(request_id, num_new_tokens, computed_blocks) > self.num_free_blocks:
            return False
        if request_id not in self.requests:
            # Every group takes its prefix hit first: a group's new blocks come from the front
            # of the shared free queue, where another group's cached hit blocks may sit.
            for g, c in zip(self.groups, self._computed(computed_blocks)):
                g.allocate_slots(request_id, 0, c, salt)
        for g in self.groups:
            ok = g.allocate_slots(request_id, num_new_tokens)
            assert ok, "the groups' blocks were counted together"
        return True

    def blocks_needed_total(self, items: list[tuple[str, int]]) -> int:
        return sum(g.blocks_needed_total(items) for g in self.groups)

    def fits_many(self, items: list[tuple[str, int]], num_tokens: int) -> bool:
        free = self.num_free_blocks
        if len(self.groups) * (num_tokens // self.block_size + 2 * len(items)) <= free:
            return True
        return self.blocks_needed_total(items) <= free

    def allocate_many(self, items: list[tuple[str, int]], checked: bool = False) -> bool:
        if not checked and self.blocks_needed_total(items) > self.num_free_blocks:
            return False
        for g in self.groups:
            g.allocate_many(items, checked=True)
        return True

    def cache_computed_blocks(self, scheduled) -> None:
        for g in self.groups:
            g.cache_computed_blocks(scheduled)

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        for g in self.groups:
            g.cache_blocks(request_id, token_ids, num_computed_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        for g in self._sliding_first:
            g.trim(request_id, num_tokens)

    def take_table_deltas(self) -> TableDeltas:
        """Every group's table changes, each delta tagged with its group (a freed request's
        tables go in every group at once, so it is listed once)."""
        out = TableDeltas()
        for g, m in enumerate(self.groups):
            d = m.take_table_deltas()
            if g == 0:
                out.removed = d.removed
            for c in d.changed:
                c.group = g
            out.changed.extend(d.changed)
        return out

    def pool_fill(self) -> tuple[int, dict[int, int]]:
        """The simulator's memory probe over every group's tables (they share one pool)."""
        tables = [r for m in self.groups for r in m.requests.values()]
        return pool_fill(self.pool, tables, self.block_size)

    def resident_tokens(self) -> tuple[int, int]:
        return self.groups[0].resident_tokens()

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [c for g in self.groups for c in g.take_block_copies()]

    # -- swap: every group's private device blocks move, released ones are not there ---------
    def can_swap_out(self, request_id: str) -> bool:
        need = sum(len(g._private_blocks(g._get(request_id))) for g in self.groups)
        return self.host_pool is not None and need <= self.num_free_host_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        if self.is_swapped(request_id):
            raise CacheError(f"request {request_id!r} is already swapped out")
        if not self.can_swap_out(request_id):
            raise OutOfBlocksError(f"host swap pool has {self.num_free_host_blocks} free blocks, too few")
        return [p for g in self.groups for p in g.swap_out(request_id)]

    def swap_in_blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        return sum(g.swap_in_blocks_needed(request_id, num_new_tokens) for g in self.groups)

    def can_swap_in(self, request_id: str) -> bool:
        n = sum(len(g._get(request_id).host_blocks) for g in self.groups)
        return n <= self.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        if not self.is_swapped(request_id):
            raise CacheError(f"request {request_id!r} is not swapped out")
        if not self.can_swap_in(request_id):
            raise OutOfBlocksError(f"too few free KV blocks ({self.num_free_blocks}) to swap in")
        return [p for g in self.groups for p in g.swap_in(request_id)]

    def preemption_footprint(self, request_id: str) -> tuple[int, int]:
        """(private blocks over all groups, leading shared blocks of the full-attention group)."""
        private = sum(g.preemption_footprint(request_id)[0] for g in self.groups)
        return private, self.groups[0].preemption_footprint(request_id)[1]

    # -- the ledger -----------------------------------------------------------------------
    def ledger(self) -> LedgerSnapshot:
        """The pool's snapshot with each request's blocks summed over its groups (a token is
        stored once per group that still holds it)."""
        snap = self.groups[0].ledger(self.groups)
        snap.prefix_cache_queries = self.prefix_cache_queries
        snap.prefix_cache_hits = self.prefix_cache_hits
        snap.cow_copies = self.num_cow_copies
        return snap

    def check_invariants(self) -> None:
        holders: dict[int, int] = {}
        host_holders: dict[int, int] = {}
        for g in self.groups:
            assert g.requests.keys() == self.requests.keys()
            g.count_holders(holders, host_holders)
        check_pool_holders(self.pool, self.host_pool, holders, host_holders)
