"""KV cache groups: which layers share a block table, and which pool tensor each layer uses.

A hybrid model (Gemma 2/3: full-attention layers interleaved with sliding-window ones) cannot
free its local layers' old KV when one block holds every layer's K/V. As in vLLM v1's hybrid
KV cache manager, layers of one attention type are split into groups of equal size
``group_size``; each group has its own block table per request, and all groups draw blocks
from one shared pool. A pool block is ``group_size`` layers' K/V for ``block_size`` tokens,
whichever group holds it, so the page size is uniform: layer ``j`` of every group lives in
pool tensor ``j``. A sliding group then frees its blocks that fall wholly outside the window
while the full-attention groups keep every block.

The alternative, SGLang's SWA pool (two pools with a fixed size ratio and a full-to-SWA slot
map), needs the split between the pools fixed up front; one shared pool lets the mix of long
and short requests decide it, and keeps one free-block count for the scheduler.

The layout is planning, so it lives with the ledger: the capacity formulas size the pool from it,
the engine, simulator and runner map layers through it, and the block manager
(``kvledger.cache``) is handed only each group's window.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layers: tuple[int, ...]  # model layer indices, in order; layer j uses pool tensor j
    sliding_window: int | None  # None: full attention


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroupSpec, ...]
    group_size: int  # layers per group = tensors in the pool (the last group may have fewer)
    layer_group: tuple[int, ...]  # model layer -> its group
    layer_slot: tuple[int, ...]  # model layer -> its pool tensor

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]


def kv_cache_layout(layer_windows: list[int | None]) -> KVCacheLayout:
    """Groups for a model whose layer i attends to a window of layer_windows[i] (None: full).

    One attention type: one group of every layer (the pool holds one tensor per layer). Mixed:
    group_size = the smallest type's layer count (Gemma 3's 1 global per 6 layers gives groups
    of the global layers' count); each type's layers are cut into groups of that size, full
    attention first. A last, smaller group leaves some of its blocks' tensors unused (padding,
    as in vLLM), which the ledger counts as held.
    """
    n = len(layer_windows)
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    if len(by_window) == 1:
        (w,) = by_window
        return KVCacheLayout((KVCacheGroupSpec(tuple(range(n)), w),), n, (0,) * n, tuple(range(n)))
    size = min(len(v) for v in by_window.values())
    # Full attention first (group 0 holds every token: the request's reference table).
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    groups: list[KVCacheGroupSpec] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for w in order:
        layers = by_window[w]
        for start in range(0, len(layers), size):
            chunk = tuple(layers[start : start + size])
            for j, layer in enumerate(chunk):
                layer_group[layer] = len(groups)
                layer_slot[layer] = j
            groups.append(KVCacheGroupSpec(chunk, w))
    return KVCacheLayout(tuple(groups), size, tuple(layer_group), tuple(layer_slot))
