"""The block pool as a map: every KV block's state, holders and prefix hash, as plain JSON.

The dashboard draws it and ``kvledger simulate --html`` records it. It is read from the same
``BlockPool`` / ``KVCacheManager`` state as ``KVCacheManager.ledger()`` (through the manager's
public ``pool``, ``host_pool``, ``block_size`` and ``tables()``: the ledger imports nothing of
``kvledger.cache``, which reports in the ledger's types), so its counts are the
ledger's counts: free + cached + used + shared = total blocks, used + shared = the ledger's
``used_blocks``, shared = ``shared_blocks``, cached = ``cached_blocks``, swapped-out = the
host pool's used blocks. Large pools are grouped (``group_size`` consecutive blocks per cell)
so the map stays a few thousand cells whatever the pool size.

Two halves: ``PoolState.capture`` copies the raw state (a few list copies, cheap enough for the
engine thread between steps); ``build_block_map`` turns it into cells anywhere else (the server
runs it in a worker thread, so a large pool does not hold up the engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvledger.ledger.snapshot import block_fill

# Device block states, in the order of each cell's counts. free: no holder, no content; cached:
# no holder but a reusable prefix (evicted last); used: one holder; shared: several holders (a
# prefix-cache hit or an n > 1 fork).
STATES = ("free", "cached", "used", "shared")
FREE, CACHED, USED, SHARED = range(4)
MAX_OWNERS_SHOWN = 4  # per cell; the cell also says how many holders it has in all


def _hash_hex(h: int | None) -> str | None:
    return None if h is None else f"{h & (2**64 - 1):016x}"


@dataclass
class PoolState:
    """The pool's raw state at one instant: plain lists, safe to read in any thread."""

    block_size: int
    ref_cnts: list[int]
    hashes: list[int | None]
    # (request id, tokens its table covers, device block table (-1: on the host), host blocks)
    tables: list[tuple[str, int, list[int], list[int]]]
    host_ref_cnts: list[int] | None  # None: no host swap pool

    @classmethod
    def capture(cls, kv: Any) -> PoolState:
        """The state of ``kv``, a ``kvledger.cache.kv_cache_manager.KVCacheManager``."""
        blocks = kv.pool.blocks
        host = kv.host_pool
        return cls(
            block_size=kv.block_size,
            ref_cnts=[b.ref_cnt for b in blocks],
            hashes=[b.block_hash for b in blocks],
            tables=[  # a hybrid model's request has a table in each KV cache group
                (rid, num_tokens, table[:], list(host_blocks.values()))
                for rid, num_tokens, table, host_blocks in kv.tables()
            ],
            host_ref_cnts=None if host is None else [b.ref_cnt for b in host.blocks],
        )


def block_map(kv: Any, max_cells: int = 2048) -> dict[str, Any]:
    """``build_block_map`` of the manager's state now."""
    return build_block_map(PoolState.capture(kv), max_cells)


def build_block_map(state: PoolState, max_cells: int = 2048) -> dict[str, Any]:
    """The device pool cell by cell, plus the host swap pool; JSON-serialisable as is.

    Each cell: ``c`` = counts per state (``STATES`` order), ``o`` = up to
    ``MAX_OWNERS_SHOWN`` holder request ids, ``n`` = holders in all, ``t`` = tokens stored,
    and for single-block cells ``h`` = the prefix hash (hex) and ``r`` = the reference count.
    """
    if max_cells < 1:
        raise ValueError(f"max_cells must be >= 1, got {max_cells}")
    bs, refs, hashes = state.block_size, state.ref_cnts, state.hashes
    n = len(refs)
    group = math.ceil(n / max_cells)
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    host_owner: dict[int, str] = {}
    for rid, num_tokens, table, host_blocks in state.tables:
        for i, b in enumerate(table):
            if b < 0:
                continue
            held = owners.get(b)
            f = block_fill(num_tokens, i, bs)
            if held is None:
                owners[b] = [rid]
                fill[b] = f
            else:
                held.append(rid)
                if f > fill[b]:
                    fill[b] = f
        for h in host_blocks:
            host_owner[h] = rid
    # One pass for the states, then C-speed counts per cell; holders only where there are any.
    codes = [
        (FREE if h is None else CACHED) if r == 0 else (USED if r == 1 else SHARED)
        for r, h in zip(refs, hashes)
    ]
    cells: list[dict[str, Any]] = []
    for start in range(0, n, group):
        seg = codes[start : start + group]
        cells.append(
            {"c": [seg.count(FREE), seg.count(CACHED), seg.count(USED), seg.count(SHARED)]}
        )
    for b in sorted(owners):
        cell = cells[b // group]
        held = owners[b]
        if "n" not in cell:
            cell.update(o=[], n=0, t=0)
        cell["n"] += len(held)
        cell["t"] += fill[b]
        who = cell["o"]
        for r in held:
            if len(who) >= MAX_OWNERS_SHOWN:
                break
            if r not in who:
                who.append(r)
    if group == 1:
        for b, cell in enumerate(cells):
            cell["h"] = _hash_hex(hashes[b])
            cell["r"] = refs[b]
    counts = [codes.count(s) for s in range(4)]
    host = state.host_ref_cnts
    host_cells = []
    hn = len(host) if host is not None else 0
    hgroup = math.ceil(hn / max_cells) if hn else 1
    for start in range(0, hn, hgroup):
        ids = range(start, min(start + hgroup, hn))
        used = [h for h in ids if host[h] > 0]
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
            "swapped_out": sum(1 for r in host if r > 0) if host is not None else 0,
        },
        "host": {"num_blocks": hn, "group_size": hgroup, "cells": host_cells},
    }
