"""What the tiered prefix cache's two sides tell each other: plain data in the step messages.

The scheduler side (``kvledger.cache.kv_tiers``) decides which evicted device blocks are kept in
host memory and on disk, and which tier blocks are loaded into which fresh pool blocks; it puts
those decisions in ``SchedulerOutput`` as ``TierStore`` / ``TierLoad`` lists (like the swap maps).
The worker side (``kvledger.storage.kv_tiers``), which owns the tensors, moves the bytes and
answers with a ``TierReport`` in ``ModelRunnerOutput`` (vLLM's KV connector splits the same way:
scheduler-side metadata, worker-side transfers, finished ids reported back).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TierBlock:
    """A full block's identity: its chained hash and exactly what the hash stands for (verified
    token for token on every hit, in every tier, as the device prefix cache does)."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    salt: str | None = None


@dataclass(slots=True)
class TierStore:
    """Copy device block ``block_id`` out before this step overwrites it: into host slot
    ``host_slot`` (-1: not kept in host memory) and, if ``to_disk``, into its file."""

    block_id: int
    host_slot: int
    to_disk: bool
    block: TierBlock


@dataclass(slots=True)
class TierLoad:
    """Fill a waiting request's fresh blocks ``block_ids`` from the tiers: each block's source is
    a host slot, or -1 (its file). The request runs once the worker reports it done."""

    req_id: str
    block_ids: list[int]
    host_slots: list[int]
    blocks: list[TierBlock]


@dataclass
class TierReport:
    """A step's answer from the worker: loads finished (request id -> leading blocks loaded
    intact; the rest are recomputed), disk writes confirmed or failed, and the bytes moved."""

    loads_done: dict[str, int] = field(default_factory=dict)
    load_errors: list[tuple[int, str]] = field(default_factory=list)  # (block hash, why)
    stores_done: list[int] = field(default_factory=list)  # hashes now on disk
    store_errors: list[tuple[int, str]] = field(default_factory=list)
    # (tier, direction) -> [bytes, seconds]: "host"/"disk", "store"/"load".
    traffic: dict[str, list[float]] = field(default_factory=dict)

    def add_traffic(self, key: str, nbytes: int, seconds: float) -> None:
        t = self.traffic.setdefault(key, [0, 0.0])
        t[0] += nbytes
        t[1] += seconds

    @property
    def empty(self) -> bool:
        return not (
            self.loads_done or self.load_errors or self.stores_done or self.store_errors or self.traffic
        )
