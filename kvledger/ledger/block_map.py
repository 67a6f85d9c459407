"""The block pool as a map: every KV block's state, holders and prefix hash, as plain JSON.

The dashboard draws it and ``kvledger simulate --html`` records it. It is read from the same
``BlockPool`` / ``KVCacheManager`` state as ``KVCacheManager.ledger()``, so its counts are the
ledger's counts: free + cached + used + shared = total blocks, used + shared = the ledger's
``used_blocks``, shared = ``shared_blocks``, cached = ``cached_blocks``, swapped-out = the
host pool's used blocks. Large pools are grouped (``group_size`` consecutive blocks per cell)
so the map stays a few thousand cells whatever the pool size.
"""

from __future__ import annotations

from typing import Any

from kvledger.cache.kv_cache_manager import KVCacheManager, cdiv

# Device block states, in the order of each cell's counts. free: no holder, no content; cached:
# no holder but a reusable prefix (evicted last); used: one holder; shared: several holders (a
# prefix-cache hit or an n > 1 fork).
STATES = ("free", "cached", "used", "shared")
FREE, CACHED, USED, SHARED = range(4)
MAX_OWNERS_SHOWN = 4  # per cell; the cell also says how many holders it has in all


def _hash_hex(h: int | None) -> str | None:
    return None if h is None else f"{h & (2**64 - 1):016x}"


def block_map(kv: KVCacheManager, max_cells: int = 2048) -> dict[str, Any]:
    """The device pool cell by cell, plus the host swap pool; JSON-serialisable as is.

    Each cell: ``c`` = counts per state (``STATES`` order), ``o`` = up to
    ``MAX_OWNERS_SHOWN`` holder request ids, ``n`` = holders in all, ``t`` = tokens stored,
    and for single-block cells ``h`` = the prefix hash (hex) and ``r`` = the reference count.
    """
    if max_cells < 1:
        raise ValueError(f"max_cells must be >= 1, got {max_cells}")
    pool, bs = kv.pool, kv.block_size
    n = pool.num_blocks
    group = cdiv(n, max_cells)
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    host_owner: dict[int, str] = {}
    for rid, req in kv.requests.items():
        num_tokens, full = req.num_tokens, req.num_tokens // bs
        for i, b in enumerate(req.block_table):
            if b < 0:
                continue
            held = owners.get(b)
            f = bs if i < full else num_tokens - i * bs
            if held is None:
                owners[b] = [rid]
                fill[b] = f
            else:
                held.append(rid)
                if f > fill[b]:
                    fill[b] = f
        for h in req.host_blocks.values():
            host_owner[h] = rid
    blocks = pool.blocks
    cells: list[dict[str, Any]] = []
    counts = [0, 0, 0, 0]
    for start in range(0, n, group):
        c = [0, 0, 0, 0]
        who: list[str] = []
        holders = tokens = 0
        for b in range(start, min(start + group, n)):
            blk = blocks[b]
            ref = blk.ref_cnt
            if ref == 0:
                c[FREE if blk.block_hash is None else CACHED] += 1
                continue
            c[USED if ref == 1 else SHARED] += 1
            held = owners[b]
            holders += len(held)
            tokens += fill[b]
            if len(who) < MAX_OWNERS_SHOWN:
                for r in held:
                    if len(who) < MAX_OWNERS_SHOWN and r not in who:
                        who.append(r)
        for s in range(4):
            counts[s] += c[s]
        cell: dict[str, Any] = {"c": c}
        if holders:
            cell.update(o=who, n=holders, t=tokens)
        if group == 1:
            blk = blocks[start]
            cell["h"] = _hash_hex(blk.block_hash)
            cell["r"] = blk.ref_cnt
        cells.append(cell)
    host = kv.host_pool
    host_cells = []
    if host is not None:
        hgroup = cdiv(host.num_blocks, max_cells)
        for start in range(0, host.num_blocks, hgroup):
            ids = range(start, min(start + hgroup, host.num_blocks))
            used = [h for h in ids if host.blocks[h].ref_cnt > 0]
            who = list(dict.fromkeys(host_owner[h] for h in used if h in host_owner))
            host_cells.append({"c": [len(ids) - len(used), len(used)], "o": who[:MAX_OWNERS_SHOWN]})
    return {
        "states": list(STATES),
        "num_blocks": n,
        "block_size": bs,
        "group_size": group,
        "cells": cells,
        "counts": {
            **dict(zip(STATES, counts)),
            "swapped_out": host.num_used_blocks if host is not None else 0,
        },
        "host": {
            "num_blocks": host.num_blocks if host is not None else 0,
            "group_size": cdiv(host.num_blocks, max_cells) if host is not None else 1,
            "cells": host_cells,
        },
    }
