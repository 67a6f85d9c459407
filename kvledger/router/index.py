"""A replica's prefix cache as its KV events describe it: the exact set of cached block hashes.

``BlockStored`` adds hashes, ``BlockRemoved`` drops them, ``AllBlocksCleared`` empties the set,
applied in sequence order; the engine publishes from the same place its pool changes, so the
set equals the pool's prefix index (tests/test_kv_events.py) up to the batches still in flight.
A sequence gap (a PUB socket dropped at its high-water mark) is reported, so the owner can ask
the replay socket for the missing batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvledger.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass
class KVIndex:
    hashes: set[int] = field(default_factory=set)
    last_seq: int = -1
    gaps: int = 0  # batches known lost (sequence numbers skipped)

    def apply_payload(self, seq: int, payload: bytes) -> None:
        """One ZMQ message: its 8-byte sequence number (decoded) and msgpack payload."""
        self.apply(seq, _decoder.decode(payload))

    def apply(self, seq: int, batch: KVEventBatch | Any) -> None:
        if seq <= self.last_seq:
            return  # a replayed batch already seen
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            self.gaps += seq - self.last_seq - 1
        self.last_seq = seq
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.hashes.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.hashes.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.hashes.clear()

    def clear(self) -> None:
        self.hashes.clear()

    def prefix_blocks(self, block_hashes: list[int]) -> int:
        """How many leading blocks of a request the replica holds: a prefix hit stops at the
        first miss, since each hash chains over all blocks before it."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n
