"""The quantised-KV overlay under tensor parallelism: the driver keeps the bookkeeping, every
rank replays the pool operations on its own heads.

``OverlaySlots`` (kvledger.storage.kv_overlay) decides which slot each request owns and which
rows are valid, and calls a handful of pool operations: grow the overlay, copy a slot (n > 1
forks), read a request's sink rows into the sink cache, write cached sinks into a slot. In the
driver its pool is a ``RemoteOverlayPool``: each operation is recorded, and the list goes to
every rank in the next ``StepPlan`` (``overlay_ops``), applied before that step's block ops and
forward. Operations keep their order, and a rank's overlay changes only in a forward, so an
operation recorded after step k's forward (saving sinks) sees on the rank exactly what it would
have seen at once. Sink-cache entries live on the ranks, keyed by an id; the driver's entry is
a ``RemoteRows`` handle, and evicting it drops the ranks' copies.
"""

from __future__ import annotations

import itertools
from typing import Any


class RemoteRows:
    """The driver's handle to sink rows every rank keeps (``sink_cache`` values)."""

    def __init__(self, pool: RemoteOverlayPool, key: int, nbytes: int) -> None:
        self.pool, self.key, self.nbytes = pool, key, nbytes

    def clone(self) -> RemoteRows:
        return self  # the ranks' copies are already private

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1

    def release(self) -> None:
        self.pool.ops.append(("drop", self.key))


class RemoteOverlayPool:
    def __init__(self, sink_tokens: int, recent_tokens: int, overlay_slots: int, bytes_per_row: int) -> None:
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        self.overlay_slots = overlay_slots
        self.bytes_per_row = bytes_per_row  # one overlay row (a token's K and V, all layers) on one rank
        self.ops: list[tuple[Any, ...]] = []
        self._keys = itertools.count()

    @property
    def overlay_rows_per_slot(self) -> int:
        return self.sink_tokens + self.recent_tokens

    @property
    def overlay_bytes(self) -> int:
        return self.overlay_slots * self.overlay_rows_per_slot * self.bytes_per_row

    def grow_overlay(self, num_slots: int) -> None:
        self.ops.append(("grow", num_slots))
        self.overlay_slots = num_slots

    def copy_overlay_slot(self, src: int, dst: int) -> None:
        self.ops.append(("copy", src, dst))

    def read_overlay_rows(self, slot: int, lo: int, hi: int) -> RemoteRows:
        key = next(self._keys)
        self.ops.append(("save", key, slot, lo, hi))
        return RemoteRows(self, key, (hi - lo) * self.bytes_per_row)

    def write_overlay_rows(self, slot: int, lo: int, rows: RemoteRows) -> None:
        self.ops.append(("load", rows.key, slot, lo))

    def take_ops(self) -> list[tuple[Any, ...]]:
        ops, self.ops = self.ops, []
        return ops


def apply_overlay_ops(pool: Any, sinks: dict[int, Any], ops: list[tuple[Any, ...]]) -> None:
    """A rank replays the driver's overlay operations on its own pool (``sinks``: its copies)."""
    for op in ops:
        kind = op[0]
        if kind == "grow":
            pool.grow_overlay(op[1])
        elif kind == "copy":
            pool.copy_overlay_slot(op[1], op[2])
        elif kind == "save":
            _, key, slot, lo, hi = op
            sinks[key] = pool.read_overlay_rows(slot, lo, hi).clone()
        elif kind == "load":
            _, key, slot, lo = op
            pool.write_overlay_rows(slot, lo, sinks[key])
        elif kind == "drop":
            sinks.pop(op[1], None)
        else:
            raise ValueError(f"unknown overlay operation {kind!r}")
