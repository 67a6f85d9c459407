"""Trace replay over the engine's own Scheduler and KVCacheManager, on a virtual clock.

Each step: requests whose arrival time has come are added, ``Scheduler.schedule()`` decides,
the clock advances by the step-time model, and the engine's post-step update runs
(``Scheduler.update_from_output``: computed tokens advance, full blocks are published to the
prefix cache, a due token is appended and the request finishes at its output length). Nothing about scheduling is reimplemented here: the
simulator only supplies time and placeholder token ids, so its decisions are the engine's.

Memory figures are sampled right after ``schedule()`` (the blocks held while the step runs) and
weighted by the step's duration:

- ``kv_utilization`` = integral of tokens stored / integral of token slots in used blocks
  (a shared block counts once; free-but-cached prefix blocks are not "used");
- ``naive_kv_utilization`` = integral of the same requests' tokens / integral of (requests
  resident x max_seq_len): what reserving max_seq_len contiguously per request would achieve
  for the same resident set.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvledger.cache.kv_block_file import OffloadSpec
from kvledger.cache.kv_tier_messages import TierReport
from kvledger.cache.kv_tiers import KVTiers
from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.core.preemption import PreemptionCostModel
from kvledger.core.request import Request
from kvledger.core.sched_output import SchedulerOutput
from kvledger.core.scheduler import Scheduler
from kvledger.errors import ConfigError
from kvledger.ledger.accounting import tier_capacity
from kvledger.sampling_params import SamplingParams
from kvledger.sim.cost_model import StepCostModel
from kvledger.sim.trace import TraceRequest

_GiB = 1 << 30


def sim_tiers(bytes_per_block: int, block_size: int, host_bytes: int, disk_bytes: int) -> KVTiers:
    """The tiered prefix cache's index as the engine sizes it (``tier_capacity``), no files."""
    cap = tier_capacity(bytes_per_block, block_size, host_bytes, disk_bytes)
    spec = OffloadSpec("simulated", cap["host"]["blocks"], cap["disk"]["blocks"], bytes_per_block)
    return KVTiers(spec, block_size)


class _TierLoads:
    """Tier loads in flight in the simulator: each is done ``tier_load_time`` after its step
    starts (the worker's loader overlaps the steps); disk writes are confirmed at once."""

    def __init__(self, cost: StepCostModel, bytes_per_block: int) -> None:
        self.cost, self.bytes_per_block = cost, bytes_per_block
        self.pending: list[tuple[float, str, int]] = []  # (done at, request id, blocks)
        self.stored: list[int] = []

    def start(self, so: SchedulerOutput, clock: float) -> None:
        for job in so.kv_loads:
            host = sum(1 for s in job.host_slots if s >= 0)
            t = self.cost.tier_load_time(host, len(job.host_slots) - host, self.bytes_per_block)
            self.pending.append((clock + t, job.req_id, len(job.block_ids)))
        self.stored += [s.block.block_hash for s in so.kv_stores if s.to_disk]

    def next_done(self) -> float:
        return min(t for t, _, _ in self.pending)

    def report(self, sched: Scheduler, clock: float) -> None:
        done = {rid: n for t, rid, n in self.pending if t <= clock}
        if done or self.stored:
            self.pending = [p for p in self.pending if p[1] not in done]
            sched.on_tier_report(TierReport(loads_done=done, stores_done=self.stored))
            self.stored = []


class SimulationStalled(RuntimeError):
    """The scheduler scheduled nothing although requests are unfinished (a scheduler bug)."""


# ---------------------------------------------------------------- shared with the engine
def build_scheduler(
    sc: SchedulerConfig,
    cc: CacheConfig,
    num_blocks: int,
    bytes_per_token: int,
    cost_model: PreemptionCostModel,
    windows: list[int | None] | None = None,
) -> Scheduler:
    """The cache manager and scheduler exactly as the engine builds them."""
    return Scheduler.build(sc, cc, num_blocks, bytes_per_token, cost_model, windows)


def apply_step_update(
    scheduler: Scheduler,
    so: SchedulerOutput,
    next_token: Callable[[Request], int],
    now: float,
) -> list[Request]:
    """The engine's post-step update (``Scheduler.update_from_output``) with a placeholder
    token for each due request; returns the requests it finished."""
    return [r for r in scheduler.update_from_output(so, next_token, now) if r.is_finished]


# ---------------------------------------------------------------- placeholder tokens
def placeholder_token(key: int, pos: int) -> int:
    """A deterministic token id for (sequence key, position): a 32-bit integer mix, so two
    different sequences never share a 16-token block by accident."""
    x = (key * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return 3 + x % (2**31 - 3)


def prompt_tokens(index: int, row: TraceRequest) -> list[int]:
    if row.prefix_id is None:
        return [placeholder_token(index, p) for p in range(row.prompt_len)]
    pkey = (1 << 40) + zlib.crc32(row.prefix_id.encode())
    return [
        placeholder_token(pkey if p < row.prefix_len else index, p) for p in range(row.prompt_len)
    ]


# ---------------------------------------------------------------- records
@dataclass
class StepRecord:
    step: int
    time: float  # clock at the start of the step
    duration: float
    num_batched_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    used_blocks: int
    shared_blocks: int  # used blocks with more than one holder
    cached_blocks: int  # free blocks still holding a reusable prefix
    tokens_stored: int  # unique tokens in used blocks
    shared_tokens: int  # of which in shared blocks
    naive_tokens: int  # tokens of resident requests, each counted per holder
    num_resident: int  # requests with blocks on the device
    max_sharers: int = 0  # most holders of any one block
    admitted: list[str] = field(default_factory=list)
    preempted: list[tuple[str, str]] = field(default_factory=list)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


@dataclass
class RequestRecord:
    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    num_output_tokens: int
    first_token_time: float | None
    finished_time: float | None
    finish_reason: str | None
    num_preemptions: int
    num_cached_tokens: int

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0-100); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class SimResult:
    steps: list[StepRecord]
    requests: list[RequestRecord]
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_seq_len: int
    num_preemptions: dict[str, int]
    cost_model: StepCostModel
    static_batch: int | None = None
    prefix_cache_hit_rate: float = 0.0

    @property
    def decisions(self) -> list[tuple[list[str], list[tuple[str, str]]]]:
        """Per step: (admitted ids, preempted (id, mode)) — the engine-comparable record."""
        return [(s.admitted, s.preempted) for s in self.steps]

    def summary(self) -> dict[str, Any]:
        steps, reqs = self.steps, self.requests
        done = [r for r in reqs if r.finished_time is not None]
        start = min(r.arrival_time for r in reqs)
        end = max((r.finished_time for r in done), default=start)
        duration = end - start
        out_tokens = sum(r.num_output_tokens for r in reqs)
        prompt_tokens = sum(r.prompt_len for r in done)
        bs = self.block_size
        w = [s.duration for s in steps]
        busy = sum(w)

        def integral(f: Callable[[StepRecord], float]) -> float:
            return sum(f(s) * s.duration for s in steps)

        slots = integral(lambda s: s.used_blocks * bs)
        naive_slots = integral(lambda s: s.num_resident * self.max_seq_len)
        lat = [r.latency for r in done]
        ttft = [r.ttft for r in reqs if r.ttft is not None]
        per = lambda xs, q: percentile(xs, q)  # noqa: E731
        return {
            "num_requests": len(reqs),
            "num_finished": len(done),
            "num_steps": len(steps),
            "duration_s": duration,
            "busy_s": busy,
            "output_tokens": out_tokens,
            "throughput_tokens_per_s": out_tokens / duration if duration > 0 else None,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / duration if duration > 0 else None,
            "requests_per_s": len(done) / duration if duration > 0 else None,
            "latency_p50_s": per(lat, 50),
            "latency_p99_s": per(lat, 99),
            "latency_mean_s": sum(lat) / len(lat) if lat else None,
            "ttft_p50_s": per(ttft, 50),
            "ttft_p99_s": per(ttft, 99),
            "kv_utilization": integral(lambda s: s.tokens_stored) / slots if slots else None,
            "naive_kv_utilization": integral(lambda s: s.naive_tokens) / naive_slots
            if naive_slots
            else None,
            "naive_max_seq_len": self.max_seq_len,
            "kv_usage_mean": integral(lambda s: s.used_blocks) / (self.num_blocks * busy)
            if busy
            else None,
            "peak_used_blocks": max((s.used_blocks for s in steps), default=0),
            "peak_shared_blocks": max((s.shared_blocks for s in steps), default=0),
            "peak_sharers": max((s.max_sharers for s in steps), default=0),
            "peak_running": max((s.num_running for s in steps), default=0),
            "num_preemptions": {
                **self.num_preemptions,
                "total": sum(self.num_preemptions.values()),
            },
            "swapped_out_blocks": sum(s.swapped_out_blocks for s in steps),
            "swapped_in_blocks": sum(s.swapped_in_blocks for s in steps),
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "num_kv_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_token": self.bytes_per_token,
            "kv_pool_bytes": self.num_blocks * self.block_size * self.bytes_per_token,
            "static_batch": self.static_batch,
            "cost_model": {k: v for k, v in asdict(self.cost_model).items() if k != "fit"},
        }


# ---------------------------------------------------------------- the simulator
class Simulator:
    """Replays ``trace`` through a fresh Scheduler + KVCacheManager built like the engine's.

    ``static_batch`` = N turns on the static-batching baseline as a policy around the same
    scheduler: arrivals are held back and released N at a time, only once every request of the
    previous batch has finished.
    """

    def __init__(
        self,
        trace: list[TraceRequest],
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        bytes_per_token: int,
        cost_model: StepCostModel,
        static_batch: int | None = None,
        naive_max_seq_len: int | None = None,
        windows: list[int | None] | None = None,
        tier_bytes: tuple[int, int] = (0, 0),
    ) -> None:
        """``windows``: each KV cache group's sliding window, as the engine's layout has them
        (``[w]``: every layer attends to w tokens; several: a hybrid model's groups, and
        ``bytes_per_token`` is one pool slot); blocks outside a window are released as in the
        engine. None: one full-attention group."""
        scheduler_config.validate()
        cache_config.validate()
        if num_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if static_batch is not None and static_batch < 1:
            raise ConfigError(f"--static-batch must be >= 1, got {static_batch}")
        self.sc, self.cc = scheduler_config, cache_config
        self.cost_model = cost_model
        self.static_batch = static_batch
        self.bytes_per_token = bytes_per_token
        self.bytes_per_block = bytes_per_token * cache_config.block_size
        self.scheduler = build_scheduler(
            scheduler_config,
            cache_config,
            num_blocks,
            bytes_per_token,
            cost_model.preemption_cost_model(
                scheduler_config.preemption_mode,
                recompute_threshold=scheduler_config.recompute_threshold,
            ),
            windows,
        )
        self.kv = self.scheduler.kv
        if any(tier_bytes):  # host and disk tiers of the prefix cache, an index without files
            self.kv.attach_tiers(sim_tiers(self.bytes_per_block, cache_config.block_size, *tier_bytes))
        self.max_seq_len = naive_max_seq_len or scheduler_config.max_model_len
        self.trace = sorted(trace, key=lambda r: r.arrival_time)
        self._validate()

    def _validate(self) -> None:
        """The engine's prompt checks (``Scheduler.check_prompt``), per trace request."""
        for i, r in enumerate(self.trace):
            why = self.scheduler.check_prompt(r.prompt_len)
            if why is not None:
                where = f"trace line {r.line}" if r.line else f"request {i}"
                raise ConfigError(f"{where}: {why}")

    def _new_request(self, index: int, row: TraceRequest, key_time: float) -> Request:
        return Request(
            request_id=str(index),
            prompt_token_ids=prompt_tokens(index, row),
            sampling_params=SamplingParams(
                max_tokens=row.output_len, ignore_eos=True, temperature=0.0
            ),
            arrival_time=key_time,
            max_total_tokens=self.sc.max_model_len,
        )

    def run(
        self, on_step: Callable[[SchedulerOutput, float, list[Request]], None] | None = None
    ) -> SimResult:
        """Replay the trace. ``on_step(so, clock, finished)``, if given, sees each step that ran
        right after its update (``simulate --html`` records its frames there)."""
        sched, kv, cost = self.scheduler, self.kv, self.cost_model
        bs = self.cc.block_size
        pending = deque(enumerate(self.trace))
        held: deque[Request] = deque()
        by_id: dict[str, tuple[Request, TraceRequest]] = {}
        steps: list[StepRecord] = []
        clock = self.trace[0].arrival_time
        last_key = -math.inf
        empty_steps = 0
        loads = _TierLoads(cost, self.bytes_per_block)

        def token(req: Request) -> int:
            return placeholder_token(int(req.request_id), req.num_tokens)

        def record_finish(req: Request, now: float) -> None:
            if req.finished_time is None:
                req.finished_time = now

        while pending or held or sched.has_unfinished():
            while pending and pending[0][1].arrival_time <= clock:
                i, row = pending.popleft()
                # Scheduler order keys strictly increase in arrival order, as the engine's
                # time.monotonic() stamps do, so ties are broken the same way.
                last_key = max(row.arrival_time, math.nextafter(last_key, math.inf))
                req = self._new_request(i, row, last_key)
                by_id[req.request_id] = (req, row)
                if self.static_batch:
                    held.append(req)
                else:
                    sched.add_request(req)
            if self.static_batch and not sched.has_unfinished():
                for _ in range(min(self.static_batch, len(held))):
                    sched.add_request(held.popleft())
            if not sched.has_unfinished():
                clock = max(clock, pending[0][1].arrival_time)
                continue

            so = sched.schedule()
            rec = self._probe(so, clock)
            dt = cost.step_time(so, self.bytes_per_block)
            rec.duration = dt
            steps.append(rec)
            loads.start(so, clock)
            if not (so.req_ids or so.blocks_to_swap_out or so.blocks_to_swap_in):
                if loads.pending:  # only tier loads in flight: time passes until one is done
                    clock = max(clock, loads.next_done())
                    loads.report(sched, clock)
                    continue
                for rid in so.ended:
                    record_finish(by_id[rid][0], clock)
                empty_steps = 0 if (so.ended or so.preempted) else empty_steps + 1
                if empty_steps > 2:
                    raise SimulationStalled(self._stall_report(so))
                continue
            empty_steps = 0
            clock += dt
            for rid in so.ended:
                record_finish(by_id[rid][0], clock)
            finished = apply_step_update(sched, so, token, clock)
            loads.report(sched, clock)
            if on_step is not None:
                on_step(so, clock, finished)

        requests = [
            RequestRecord(
                request_id=req.request_id,
                arrival_time=row.arrival_time,
                prompt_len=row.prompt_len,
                output_len=row.output_len,
                num_output_tokens=req.num_output_tokens,
                first_token_time=req.first_token_time,
                finished_time=req.finished_time,
                finish_reason=req.finish_reason,
                num_preemptions=req.num_preemptions,
                num_cached_tokens=max(req.num_cached_tokens, 0),
            )
            for req, row in by_id.values()
        ]
        q = kv.prefix_cache_queries
        return SimResult(
            steps=steps,
            requests=requests,
            num_blocks=kv.pool.num_blocks,
            block_size=bs,
            bytes_per_token=self.bytes_per_token,
            max_seq_len=self.max_seq_len,
            num_preemptions=dict(sched.num_preemptions),
            cost_model=cost,
            static_batch=self.static_batch,
            prefix_cache_hit_rate=kv.prefix_cache_hits / q if q else 0.0,
        )

    def _probe(self, so: SchedulerOutput, clock: float) -> StepRecord:
        """The pool as this step holds it: the arithmetic of ``KVCacheManager.ledger()`` (a shared
        block counts once, at its fullest holder's fill), without per-request objects."""
        kv, sched = self.kv, self.scheduler
        stored, shared = kv.pool_fill()
        resident, naive_tokens = kv.resident_tokens()
        return StepRecord(
            step=so.step,
            time=clock,
            duration=0.0,
            num_batched_tokens=so.total_num_scheduled_tokens,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            used_blocks=kv.pool.num_used_blocks,
            shared_blocks=len(shared),
            cached_blocks=kv.pool.num_cached_free,
            tokens_stored=stored,
            shared_tokens=sum(shared.values()),
            naive_tokens=naive_tokens,
            num_resident=resident,
            max_sharers=max((kv.pool.blocks[b].ref_cnt for b in shared), default=0),
            admitted=list(so.admitted),
            preempted=list(so.preempted),
            swapped_out_blocks=len(so.blocks_to_swap_out),
            swapped_in_blocks=len(so.blocks_to_swap_in),
        )

    def _stall_report(self, so: SchedulerOutput) -> str:
        s = self.scheduler
        head = s.waiting[0] if s.waiting else (s.swapped[0] if s.swapped else None)
        detail = ""
        if head is not None:
            detail = (
                f"; head request {head.request_id}: {head.num_tokens} tokens, "
                f"{head.num_computed_tokens} computed, status {head.status.value}"
            )
        return (
            f"step {so.step}: nothing scheduled with {len(s.waiting)} waiting, "
            f"{len(s.running)} running, {len(s.swapped)} swapped, "
            f"{self.kv.num_free_blocks} free blocks of {self.kv.pool.num_blocks}{detail}"
        )
