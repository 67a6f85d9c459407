"""N data-parallel replicas on one virtual clock: each runs the engine's own Scheduler and
KVCacheManager (as ``Simulator`` does for one), a router places every arrival.

Discrete events: an arrival is dispatched at its time; a replica's step starts when the replica
is idle and has work, and its update (computed tokens, cached blocks, first tokens, finishes)
lands when the step's modelled time has passed. The replica's block pool records KV events, as
the engine's does, and they reach the router's index at the end of the step that caused them,
as the engine publishes them. So ``cache_aware`` sees exactly what ``kvledger router`` sees.

Policies: the three of ``kvledger.router.policy`` and ``sglang_model``, a model of sglang-router's
``cache_aware`` from its documented algorithm (not its code): when in-flight request counts are
imbalanced (max - min > 64 and max > 1.5 x min), the least loaded; otherwise the replica whose
"tree" of past requests matches the longest prefix, if the match exceeds 30 % of the prompt,
else the replica with the smallest tree. Its tree is here a set of block hashes of the requests
routed to that replica, never evicted (the router's default limit is 64 M characters): it
records what was sent, not what the replica still caches.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from kvledger.cache.kv_events import KVEventBatch
from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.core.request import Request
from kvledger.core.sched_output import SchedulerOutput
from kvledger.core.scheduler import Scheduler
from kvledger.errors import ConfigError
from kvledger.router.policy import ROUTING_POLICIES, Decision, Router
from kvledger.sampling_params import SamplingParams
from kvledger.sim.cost_model import StepCostModel
from kvledger.sim.simulator import (
    SimulationStalled,
    apply_step_update,
    build_scheduler,
    percentile,
    placeholder_token,
    prompt_tokens,
)
from kvledger.sim.trace import TraceRequest

DP_SIM_POLICIES = (*ROUTING_POLICIES, "sglang_model")


@dataclass
class _SglangModel:
    """sglang-router's cache_aware, approximately (see the module docstring)."""

    n: int
    cache_threshold: float = 0.3
    abs_threshold: int = 64
    rel_threshold: float = 1.5
    trees: list[set[int]] = field(default_factory=list)
    load: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.trees = [set() for _ in range(self.n)]
        self.load = [0] * self.n

    def choose(self, hashes: list[int], num_tokens: int, bs: int) -> int:
        lo, hi = min(self.load), max(self.load)
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            rank = self.load.index(lo)
        else:
            best, best_len = 0, -1
            for r, tree in enumerate(self.trees):
                n = 0
                for h in hashes:
                    if h not in tree:
                        break
                    n += 1
                if n > best_len:
                    best, best_len = r, n
            if num_tokens and best_len * bs / num_tokens > self.cache_threshold:
                rank = best
            else:
                rank = min(range(self.n), key=lambda r: len(self.trees[r]))
        self.trees[rank].update(hashes)
        return rank


@dataclass
class _Replica:
    sched: Scheduler
    busy_until: float = 0.0
    step: SchedulerOutput | None = None
    seq: int = 0
    steps: int = 0
    busy_s: float = 0.0


def simulate_data_parallel(
    trace: list[TraceRequest],
    num_replicas: int,
    policy: str,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_blocks: int,
    bytes_per_token: int,
    cost_model: StepCostModel,
    overlap_weight: float = 0.25,
    router_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` over ``num_replicas`` replicas; returns the summary figures."""
    if policy not in DP_SIM_POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(DP_SIM_POLICIES)}, got {policy!r}")
    scheduler_config.validate()
    cache_config.validate()
    bs = cache_config.block_size
    bytes_per_block = bytes_per_token * bs
    router = Router(num_replicas, policy if policy in ROUTING_POLICIES else "round_robin", bs,
                    cache_config.prefix_caching_hash_algo, overlap_weight, **(router_options or {}))
    sgl = _SglangModel(num_replicas) if policy == "sglang_model" else None
    reps: list[_Replica] = []
    for _ in range(num_replicas):
        s = build_scheduler(
            scheduler_config, cache_config, num_blocks, bytes_per_token,
            cost_model.preemption_cost_model(scheduler_config.preemption_mode,
                                             recompute_threshold=scheduler_config.recompute_threshold),
        )
        s.kv.pool.enable_events()
        reps.append(_Replica(s))
    rows = sorted(enumerate(trace), key=lambda x: x[1].arrival_time)
    where: dict[str, int] = {}
    reqs: dict[str, Request] = {}
    ends: list[tuple[float, int]] = []  # (step end time, replica) heap
    k = 0
    clock = rows[0][1].arrival_time if rows else 0.0
    last_key = -math.inf
    stalls = 0

    def token(req: Request) -> int:
        return placeholder_token(int(req.request_id), req.num_tokens)

    def start(r: int) -> None:
        nonlocal stalls
        rep = reps[r]
        if rep.step is not None or not rep.sched.has_unfinished():
            return
        so = rep.sched.schedule()
        if not (so.req_ids or so.blocks_to_swap_out or so.blocks_to_swap_in):
            for rid in so.ended:
                req = reqs[rid]
                req.finished_time = req.finished_time or clock
                _done(req)
            stalls = 0 if (so.ended or so.preempted) else stalls + 1
            if stalls > 2 * num_replicas + 2:
                raise SimulationStalled(f"replica {r}: nothing scheduled with work left")
            if so.ended or so.preempted:
                start(r)
            return
        stalls = 0
        dt = cost_model.step_time(so, bytes_per_block)
        rep.step, rep.busy_until = so, clock + dt
        rep.steps += 1
        rep.busy_s += dt
        heapq.heappush(ends, (rep.busy_until, r))

    def _done(req: Request) -> None:
        router.finished(req.request_id)
        if sgl is not None:
            sgl.load[where[req.request_id]] -= 1

    def finish_step(r: int) -> None:
        rep = reps[r]
        so, rep.step = rep.step, None
        for rid in so.ended:
            req = reqs[rid]
            req.finished_time = req.finished_time or clock
            _done(req)
        fresh = [req for rid in so.req_ids if (req := reqs[rid]).first_token_time is None]
        finished = apply_step_update(rep.sched, so, token, clock)
        for req in fresh:
            if req.first_token_time is not None:
                router.prefilled(req.request_id)
        for req in finished:
            _done(req)
        events = rep.sched.kv.pool.take_events()
        if events:
            router.replicas[r].index.apply(rep.seq, KVEventBatch(ts=clock, events=events))
            rep.seq += 1

    while k < len(rows) or ends or any(rep.sched.has_unfinished() for rep in reps):
        t_arr = rows[k][1].arrival_time if k < len(rows) else math.inf
        t_end = ends[0][0] if ends else math.inf
        if t_arr == math.inf and t_end == math.inf:
            raise SimulationStalled("requests left but no replica can step")
        if t_arr <= t_end:
            clock = t_arr
            i, row = rows[k]
            k += 1
            last_key = max(row.arrival_time, math.nextafter(last_key, math.inf))
            toks = prompt_tokens(i, row)
            rid = str(i)
            hashes = router.block_hashes(toks)
            if sgl is not None:
                d = Decision(sgl.choose(hashes, len(toks), bs), 0, 0.0)
                d.overlap_blocks = router.replicas[d.rank].overlap(hashes)
                sgl.load[d.rank] += 1
            else:
                d = router.choose(toks, hashes=hashes)
            router.dispatched(rid, d, toks, row.output_len, hashes)
            req = Request(
                request_id=rid, prompt_token_ids=toks,
                sampling_params=SamplingParams(max_tokens=row.output_len, ignore_eos=True, temperature=0.0),
                arrival_time=last_key, max_total_tokens=scheduler_config.max_model_len,
            )
            reqs[rid], where[rid] = req, d.rank
            reps[d.rank].sched.add_request(req)
            start(d.rank)
        else:
            clock, r = heapq.heappop(ends)
            finish_step(r)
            start(r)

    arrivals = {str(i): row.arrival_time for i, row in enumerate(trace)}
    done = [q for q in reqs.values() if q.finished_time is not None]
    t0 = min(arrivals.values())
    makespan = max(q.finished_time for q in done) - t0
    out_tokens = sum(q.num_output_tokens for q in reqs.values())
    ttft = [q.first_token_time - arrivals[q.request_id] for q in reqs.values() if q.first_token_time is not None]
    hits = sum(rep.sched.kv.prefix_cache_hits for rep in reps)
    queries = sum(rep.sched.kv.prefix_cache_queries for rep in reps)
    per_rep = [sum(1 for v in where.values() if v == r) for r in range(num_replicas)]
    return {
        "policy": policy,
        "num_replicas": num_replicas,
        "num_requests": len(reqs),
        "num_finished": len(done),
        "duration_s": makespan,
        "throughput_tokens_per_s": out_tokens / makespan if makespan > 0 else None,
        "requests_per_s": len(done) / makespan if makespan > 0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "requests_per_replica_min": min(per_rep),
        "requests_per_replica_max": max(per_rep),
        # The router's event-fed view of each replica equals its pool's prefix index.
        "index_exact": all(
            router.replicas[r].index.hashes == reps[r].sched.kv.pool.cached_hashes() for r in range(num_replicas)
        ),
        "busy_fraction": sum(rep.busy_s for rep in reps) / (num_replicas * makespan) if makespan > 0 else None,
    }

