"""Requests waiting for their prefix to be loaded from the lower tiers (vLLM's
WAITING_FOR_REMOTE_KVS), kept apart from the scheduler's queues.

At admission a request whose prefix continues in the host or disk tier past its device hit
takes its device hit and fresh blocks for the tier blocks, and waits here while the worker's
loader fills them; other requests keep stepping. When the worker reports the load, the request
runs with those tokens computed (blocks that failed to load, and all after them, are trimmed and
recomputed). A request aborted while loading gives its blocks back at once: its id goes to the
worker with the finished ids, which drops the load before it touches the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.cache.kv_tier_messages import TierReport
from kvledger.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvledger.core.scheduler import Scheduler


class TierLoading:
    def __init__(self) -> None:
        # request id -> (request, device-hit tokens, tier blocks being loaded)
        self.requests: dict[str, tuple[Request, int, int]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def try_start(
        self, sched: Scheduler, req: Request, computed: list[list[int]], num_cached: int,
        salt: str | None, reserve: int,
    ) -> bool:  # fmt: skip
        """Start loading the request's tier hit if its blocks fit; True: it left the queue."""
        kv = sched.kv
        hits = kv.tier_hits(req.all_token_ids, salt, num_cached)
        if not hits:
            return False
        n = len(hits) * kv.block_size
        if kv.blocks_needed(req.request_id, n, computed) + reserve > kv.num_free_blocks:
            return False  # it is admitted as it is (or waits) instead
        ok = kv.allocate_slots(req.request_id, n, computed, salt)
        assert ok
        first = num_cached // kv.block_size
        block_ids = kv.block_table(req.request_id)[first : first + len(hits)]
        kv.tiers.start_load(req.request_id, block_ids, hits)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.requests[req.request_id] = (req, num_cached, len(hits))
        return True

    def finish(self, sched: Scheduler, rep: TierReport) -> None:
        """The worker's answer: each finished request runs from its loaded prefix."""
        kv = sched.kv
        kv.tiers.on_report(rep)
        for rid, ok in rep.loads_done.items():
            entry = self.requests.pop(rid, None)
            kv.tiers.end_load(rid)
            if entry is None:
                continue  # cancelled
            req, num_cached, k = entry
            cached = num_cached + min(ok, k) * kv.block_size
            if ok < k:
                kv.trim(rid, cached)
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
                kv.record_prefix_lookup(req.num_prompt_tokens, cached)
                kv.tiers.hit_tokens += cached - num_cached
                kv.tiers.query_tokens += cached - num_cached  # asked past the device hit
            sched._start_running(req)

    def cancel(self, sched: Scheduler, req: Request) -> None:
        """An abort while loading: the blocks go back now, the worker drops the load."""
        self.requests.pop(req.request_id, None)
        sched.kv.tiers.end_load(req.request_id)
        sched.kv.free(req.request_id)
        sched.finished_req_ids.append(req.request_id)
