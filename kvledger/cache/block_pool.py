"""Physical KV blocks: free list, reference counts, prefix-hash index and LRU eviction.

Pure bookkeeping, no torch: the pool only says which block ids hold what. A block with
``ref_cnt == 0`` sits in the free queue; if it still carries a prefix hash it is *cached*
(its K/V are intact and a later request with the same prefix can take it back), and it is
evicted, least recently freed first, only when an allocation needs room.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from kvledger.cache.block_hash import DEFAULT_HASH_ALGO, get_hash_fn
from kvledger.cache.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvledger.cache.kv_tier_messages import TierBlock
from kvledger.errors import CacheError, OutOfBlocksError


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Prefix identity of a *full* block: hash chained over (parent hash, tokens, salt).
    block_hash: int | None = None
    # Exact content behind the hash, checked on every hit so a collision can never alias.
    token_ids: tuple[int, ...] | None = None
    parent_block_id: int | None = None
    salt: str | None = None  # part of a first block's identity, verified like its tokens
    parent_hash: int | None = None  # the previous block's chained hash (what a tier entry keeps)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int:
    """Chained block hash under the default algorithm (kvledger/cache/block_hash.py)."""
    return get_hash_fn(DEFAULT_HASH_ALGO)(parent_hash, token_ids, salt)


class BlockPool:
    """``num_blocks`` equal-size blocks; allocation and free are O(1) per block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise CacheError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free queue in eviction order: front = next to hand out. Uncached blocks are put at
        # the front so that cached prefix content is the last thing overwritten.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_index: dict[int, int] = {}
        self.num_cached_free = 0  # free blocks still holding a reusable prefix
        self.num_evictions = 0
        # KV events (vLLM's format) for changes of the prefix index, when the engine publishes
        # them; None: not recorded. Drained once per step by take_events().
        self.events: list[KVCacheEvent] | None = None
        # The tiered cache (kvledger.cache.kv_tiers): indexed blocks evicted by an allocation,
        # as (block id, identity), for the lower tiers to keep; None: not recorded.
        self.evicted: list[tuple[int, TierBlock]] | None = None

    def enable_events(self) -> None:
        self.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (empty when events are off)."""
        out, self.events = self.events, ([] if self.events is not None else None)
        return out or []

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (truly free plus evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(
        self,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent_block_id: int | None,
        salt: str | None = None,
        check_parent: bool = True,
    ) -> int | None:
        """Block id holding exactly this content after this parent, or None. check_parent
        False (sliding windows, whose earlier blocks may be gone): the chained hash alone
        stands for the prefix before the block."""
        block_id = self._hash_index.get(block_hash)
        if block_id is None:
            return None
        blk = self.blocks[block_id]
        if blk.token_ids != token_ids or blk.salt != salt:
            return None
        if check_parent and blk.parent_block_id != parent_block_id:
            return None
        return block_id

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref_cnt 1 each), evicting cached content LRU-first if needed."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} free KV blocks, only {len(self._free)} available")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            blk = self.blocks[block_id]
            if blk.block_hash is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_id: int) -> None:
        """Take one more reference on a block (a prefix-cache hit or a fork)."""
        blk = self.blocks[block_id]
        if blk.ref_cnt == 0:
            del self._free[block_id]
            if blk.block_hash is not None:
                self.num_cached_free -= 1
        blk.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue.

        Callers pass a request's blocks in reverse order so that its tail (least likely to
        be shared by a future prompt) is evicted first.
        """
        for block_id, n in Counter(block_ids).items():
            if self.blocks[block_id].ref_cnt < n:
                raise CacheError(f"double free of KV block {block_id}")
        for block_id in block_ids:
            blk = self.blocks[block_id]
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[block_id] = None
                if blk.block_hash is not None:
                    self.num_cached_free += 1
                else:
                    self._free.move_to_end(block_id, last=False)

    # -- prefix index ----------------------------------------------------------------------
    def register_full_block(
        self,
        block_id: int,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent_block_id: int | None,
        salt: str | None = None,
        parent_hash: int | None = None,
    ) -> None:
        """Publish a just-filled block under its prefix hash (first writer wins).

        ``parent_hash`` (the previous block's chained hash) only goes into the KV event."""
        if not self.enable_caching:
            return
        blk = self.blocks[block_id]
        if blk.block_hash is not None:
            return
        blk.block_hash = block_hash
        blk.token_ids = token_ids
        blk.parent_block_id = parent_block_id
        blk.salt = salt
        blk.parent_hash = parent_hash
        if self._hash_index.setdefault(block_hash, block_id) == block_id and self.events is not None:
            # Events follow the index: a duplicate of an indexed block is not findable, so not news.
            self.events.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=parent_hash,
                    token_ids=list(token_ids),
                    block_size=len(token_ids),
                    lora_id=None,
                    medium=MEDIUM,
                )
            )

    def _evict(self, blk: KVBlock, record: bool = True) -> None:
        if self._hash_index.get(blk.block_hash) == blk.block_id:
            del self._hash_index[blk.block_hash]
            if record and self.events is not None:
                self.events.append(BlockRemoved(block_hashes=[blk.block_hash], medium=MEDIUM))
            if record and self.evicted is not None:
                self.evicted.append(
                    (blk.block_id, TierBlock(blk.block_hash, blk.parent_hash, blk.token_ids, blk.salt))
                )
        if blk.ref_cnt == 0:
            self.num_cached_free -= 1
        blk.block_hash = None
        blk.token_ids = None
        blk.parent_block_id = None
        blk.salt = None
        blk.parent_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached-but-free prefix; returns how many blocks were dropped."""
        dropped = 0
        removed = []
        for block_id in list(self._free):
            blk = self.blocks[block_id]
            if blk.block_hash is not None:
                if self._hash_index.get(blk.block_hash) == block_id:
                    removed.append(blk.block_hash)
                self._evict(blk, record=False)
                self.num_evictions -= 1
                self._free.move_to_end(block_id, last=False)
                dropped += 1
        if self.events is not None:
            # Nothing left in the index (the engine resets only when no block is in use): one
            # AllBlocksCleared says it, as vLLM; otherwise the removed hashes, so a view stays exact.
            if not self._hash_index:
                self.events.append(AllBlocksCleared())
            elif removed:
                self.events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        return dropped

    def indexed_blocks(self) -> list[tuple[int, TierBlock]]:
        """(block id, identity) of every block a prefix lookup can find now."""
        out = []
        for block_id in self._hash_index.values():
            b = self.blocks[block_id]
            out.append((block_id, TierBlock(b.block_hash, b.parent_hash, b.token_ids, b.salt)))
        return out

    def cached_hashes(self) -> set[int]:
        """Hashes a prefix lookup can find now (what a KV-event subscriber should hold)."""
        return set(self._hash_index)

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (used by tests and debug builds)."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free)
        cached = 0
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, blk
            assert (blk.ref_cnt == 0) == (blk.block_id in free_ids), blk
            if blk.ref_cnt == 0 and blk.block_hash is not None:
                cached += 1
        assert cached == self.num_cached_free, (cached, self.num_cached_free)
        for h, block_id in self._hash_index.items():
            assert self.blocks[block_id].block_hash == h
