"""Requests waiting for their prefix to be loaded from the lower tiers (vLLM's
WAITING_FOR_REMOTE_KVS), kept apart from the scheduler's queues.

At admission a request whose prefix continues in the host or disk tier past its device hit
takes its device hit and fresh blocks for the tier blocks, and waits here while the worker's
loader fills them; other requests keep stepping. When the worker reports the load, the request
runs with those tokens computed. A block that failed to load is recomputed with all after it:
the hit is cut to the longest length every KV cache group still serves (a sliding group may
need blocks it released; then the request starts over, its blocks given back). A request
aborted while loading gives its blocks back at once: its id goes to the worker with the
finished ids, which drops the load before it touches the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.cache.kv_tier_messages import TierReport
from kvledger.cache.tier_hit import TierHit, longest_after_failure
from kvledger.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvledger.core.scheduler import Scheduler


class TierLoading:
    def __init__(self) -> None:
        # request id -> (request, device-hit tokens, the hit being loaded)
        self.requests: dict[str, tuple[Request, int, TierHit]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def try_start(self, sched: Scheduler, req: Request, num_cached: int, salt: str | None, reserve: int) -> bool:
        """Start loading the request's tier hit if its blocks fit; True: it left the queue."""
        kv = sched.kv
        hit = kv.tier_hit(req.all_token_ids, salt, num_cached)
        if hit is None:
            return False
        if hit.revived(kv.pool) + len(hit.loads) + reserve > kv.num_free_blocks:
            return False  # it is admitted as it is (or waits) instead
        block_ids = kv.allocate_tier_hit(req.request_id, hit, salt)
        assert block_ids is not None
        kv.tiers.start_load(req.request_id, block_ids, [src for _, _, src in hit.loads])
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.requests[req.request_id] = (req, num_cached, hit)
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
            req, num_cached, hit = entry
            n = hit.num_blocks
            if ok < len(hit.loads):  # a load failed: its block and all after it are recomputed
                cut = longest_after_failure(kv.groups, kv.block_tables(rid), hit.loads[ok][1])
                if cut is None:  # a window needs blocks given back already: start over
                    kv.free(rid)
                    req.status = RequestStatus.WAITING
                    sched.waiting.appendleft(req)
                    continue
                n = cut
                kv.trim(rid, n * kv.block_size)
            cached = n * kv.block_size
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
                kv.record_prefix_lookup(req.num_prompt_tokens, cached)
                kv.tiers.hit_tokens += max(0, cached - num_cached)
                kv.tiers.query_tokens += max(0, cached - num_cached)  # asked past the device hit
            sched._start_running(req)

    def cancel(self, sched: Scheduler, req: Request) -> None:
        """An abort while loading: the blocks go back now, the worker drops the load."""
        self.requests.pop(req.request_id, None)
        sched.kv.tiers.end_load(req.request_id)
        sched.kv.free(req.request_id)
        sched.finished_req_ids.append(req.request_id)
