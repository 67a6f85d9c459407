"""The tiered prefix cache under tensor parallelism: one agreed report from every rank's own.

Each rank keeps its own shard of every block (its KV heads) in its own host tier and in its own
``rank<r>/`` files, and reads and writes them on its own threads, so the ranks finish a load or
a disk write in different steps, and one may fail where another did not. The scheduler must
see one answer, the same for all: a request may run only once every rank has its prefix in
place, and a block is on disk only once every rank's file is. So the driver merges:

- a load is done when every rank has reported it, with the fewest intact leading blocks any
  rank reports (a block one rank could not read is recomputed on all of them);
- a disk write is confirmed when every rank has confirmed it, and fails if any rank's failed;
- a block a rank found unusable is a miss for every rank (the scheduler drops it from the
  index and deletes every rank's file);
- bytes moved add up over the ranks; seconds are the slowest rank's (they run side by side).

A load cancelled by an abort is forgotten once its id reaches the ranks (they drop it too).
"""

from __future__ import annotations

from collections import deque

from kvledger.cache.kv_tier_messages import TierReport


class RankTierReports:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.loads: dict[str, dict[int, int]] = {}  # request id -> rank -> intact blocks
        # block hash -> each rank's answers not yet matched (None: written, else why not)
        self.stores: dict[int, list[deque[str | None]]] = {}

    def merge(
        self, reports: list[TierReport | None], finished_req_ids: list[str] = ()
    ) -> TierReport | None:
        """This step's agreed report from the ranks' reports (rank order), or None if empty."""
        for rid in finished_req_ids:
            self.loads.pop(rid, None)
        out = TierReport()
        seen_errors: set[int] = set()
        slowest: dict[str, float] = {}
        for rank, rep in enumerate(reports):
            if rep is None:
                continue
            for rid, ok in rep.loads_done.items():
                self.loads.setdefault(rid, {})[rank] = ok
            for h in rep.stores_done:
                self._answer(h, rank, None)
            for h, why in rep.store_errors:
                self._answer(h, rank, f"{why} (rank {rank})")
            for h, why in rep.load_errors:
                if h not in seen_errors:
                    seen_errors.add(h)
                    out.load_errors.append((h, f"{why} (rank {rank})"))
            for key, (nbytes, secs) in rep.traffic.items():
                t = out.traffic.setdefault(key, [0, 0.0])
                t[0] += nbytes
                slowest[key] = max(slowest.get(key, 0.0), secs)
        for key, secs in slowest.items():
            out.traffic[key][1] = secs
        for rid, by_rank in list(self.loads.items()):
            if len(by_rank) == self.world_size:
                out.loads_done[rid] = min(by_rank.values())
                del self.loads[rid]
        for h, queues in list(self.stores.items()):
            while all(queues):
                answers = [q.popleft() for q in queues]
                why = next((a for a in answers if a is not None), None)
                if why is None:
                    out.stores_done.append(h)
                else:
                    out.store_errors.append((h, why))
            if not any(queues):
                del self.stores[h]
        return None if out.empty else out

    def _answer(self, h: int, rank: int, why: str | None) -> None:
        queues = self.stores.get(h)
        if queues is None:
            queues = self.stores[h] = [deque() for _ in range(self.world_size)]
        queues[rank].append(why)
