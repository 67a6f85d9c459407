"""A prefix hit served by the device pool and the lower tiers together, for every KV cache group.

A plain model has one group and its hit is prefix-closed: the device's leading blocks, then the
tiers' blocks that continue the chain. A hybrid or sliding-window model (Gemma 2/3, gpt-oss,
Mistral v0.1) has groups whose hits are not: a sliding group needs only the blocks its window
covers before the hit point. As in vLLM's hybrid prefix caching, a hit length counts only if
every group can serve it: full-attention groups every block before it, sliding groups the
blocks of the window before it (``first_live_block``); the longest such length wins.

Each group's blocks are found under that group's own hash chain (each group chains from its own
root, so a block stored from one group's table is never found for another's), block by block
in whichever place holds it: the device pool first (no copy), else the host or disk tier. Every
block is verified token for token, with its salt, and its parent's chained hash against the one
this prompt computes, wherever it sits. Device blocks are taken by reference; a tier block gets a
fresh pool block and a ``TierLoad``. No torch here: the worker moves the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.cache.attention_policy import RELEASED
from kvledger.cache.block_pool import BlockPool
from kvledger.cache.kv_cache_group import KVCacheGroup
from kvledger.cache.kv_tier_messages import TierBlock
from kvledger.cache.kv_tiers import KVTiers

LOAD = -3  # a table entry a tier load fills: a fresh block once the hit is allocated

# Where one block of a group's prompt is: a device block id, a tier entry (host slot or -1 for
# its file, and its identity), or nowhere (None).
Source = int | tuple[int, TierBlock] | None


@dataclass
class TierHit:
    """The agreed hit: ``num_blocks`` leading blocks, each group's table for them (device block
    ids, ``RELEASED`` before a window, ``LOAD`` where a tier block goes), and the loads as
    (group, block index, (host slot or -1, identity)), ordered by index then group, so a load
    that fails cuts the hit at the earliest block it touches."""

    num_blocks: int
    tables: list[list[int]]
    loads: list[tuple[int, int, tuple[int, TierBlock]]] = field(default_factory=list)

    def revived(self, pool: BlockPool) -> int:
        """Device blocks of the hit that sit in the free queue (taking them uses free blocks)."""
        return len({b for t in self.tables for b in t if b >= 0 and pool.blocks[b].ref_cnt == 0})


def group_sources(
    group: KVCacheGroup, tiers: KVTiers, token_ids: list[int], salt: str | None, num_blocks: int
) -> list[Source]:
    """Where each of the prompt's first ``num_blocks`` blocks is, for this group, verified. A
    full-attention group stops at its first miss (no longer hit can use what follows)."""
    pool = group.pool
    out: list[Source] = []
    parent = group.hash_root
    closed = group.policy.prefix_closed
    for h, tokens, block_salt in group.chain(token_ids, salt, 0, num_blocks, group.hash_root):
        b = pool.lookup(h, tokens, None, block_salt, check_parent=False)
        if b is not None and pool.blocks[b].parent_hash == parent:
            out.append(b)
        else:
            src = tiers.find(h, parent, tokens, block_salt)
            if src is None and closed:
                break
            out.append(src)
        parent = h
    return out


def _servable(group: KVCacheGroup, sources: list[Source], n: int) -> bool:
    first = group.policy.first_live_block(n * group.block_size)
    return all(s is not None for s in sources[first:n])


def find_tier_hit(
    groups: list[KVCacheGroup], tiers: KVTiers, token_ids: list[int], salt: str | None,
    device_blocks: int, max_blocks: int,
) -> TierHit | None:  # fmt: skip
    """The longest hit over ``device_blocks`` (what the device alone serves) that every group
    can serve with the tiers' help, or None when the tiers add nothing."""
    sources: list[list[Source]] = []
    for g in groups:  # full-attention groups first (the layout's order): they bound the rest
        if max_blocks <= device_blocks:
            return None
        src = group_sources(g, tiers, token_ids, salt, max_blocks)
        if g.policy.prefix_closed:
            max_blocks = len(src)
        sources.append(src)
    for n in range(max_blocks, device_blocks, -1):
        if all(_servable(g, s, n) for g, s in zip(groups, sources)):
            break
    else:
        return None
    tables: list[list[int]] = []
    loads: list[tuple[int, int, tuple[int, TierBlock]]] = []
    for gi, (g, src) in enumerate(zip(groups, sources)):
        first = g.policy.first_live_block(n * g.block_size)
        table = [RELEASED] * first
        for i in range(first, n):
            s = src[i]
            if isinstance(s, int):
                table.append(s)
            else:
                table.append(LOAD)
                loads.append((gi, i, s))
        tables.append(table)
    if not loads:
        return None  # the device serves it all (the device lookup's rule found less: keep that)
    loads.sort(key=lambda x: (x[1], x[0]))
    return TierHit(n, tables, loads)


def longest_after_failure(
    groups: list[KVCacheGroup], tables: list[list[int]], cut: int
) -> int | None:
    """A load failed at block ``cut`` (it and everything after it is recomputed): the longest
    hit ``n <= cut`` the request's tables still serve in every group without blocks they
    released, or None (even an empty hit would need released blocks back)."""
    for n in range(cut, -1, -1):
        ok = True
        for g, t in zip(groups, tables):
            first = g.policy.first_live_block(n * g.block_size)
            if any(b < 0 for b in t[first:n]) or sum(1 for b in t if b == RELEASED) > first:
                ok = False
                break
        if ok:
            return n
    return None
