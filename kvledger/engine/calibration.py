"""Start-up measurement for the preemption cost model: copy bandwidth and prefill time.

Swap cost is measured by swapping real blocks out to the host pool and back; recompute cost
by timing real prefills at a few lengths through the executor, and fitting
t(n) = c0 + c1 n + c2 n^2 (attention makes it super-linear). The crossover where swapping
becomes cheaper then *comes out of* these numbers; nothing about "short vs long" is
hard-coded. The functions return numbers; the builder puts them into the cost model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.core.sched_output import NewRequestData, SchedulerOutput
from kvledger.executor.base import Executor, best_time
from kvledger.sampling_params import SamplingParams

logger = logging.getLogger("kvledger")

CALIBRATION_REQUEST = "__calibrate__"


@dataclass
class Calibration:
    prefill_coeffs: tuple[float, float, float] | None = None  # c0 + c1 n + c2 n^2 seconds
    swap_bandwidth: float | None = None  # bytes/s each way
    swap_fixed_s: float | None = None  # one swap-out + swap-in of one block
    info: dict = field(default_factory=dict)  # what was measured (the engine reports it)


def _prefill_step(kv: KVCacheManager, n: int) -> SchedulerOutput:
    """A step that prefills ``n`` tokens of a request the runner has never seen."""
    params = SamplingParams(max_tokens=1, temperature=0)
    return SchedulerOutput(
        step=0,
        req_ids=[CALIBRATION_REQUEST],
        num_scheduled_tokens=[n],
        num_computed_tokens=[0],
        new_reqs=[NewRequestData(CALIBRATION_REQUEST, [1] * n, params)],
        table_deltas=kv.take_table_deltas(),
    )


def _forget(executor: Executor, kv: KVCacheManager) -> None:
    """Free the calibration request's blocks and have the runner drop it."""
    kv.free(CALIBRATION_REQUEST)
    executor.execute_model(
        SchedulerOutput(step=0, finished_req_ids=[CALIBRATION_REQUEST], table_deltas=kv.take_table_deltas())
    )


def measure_prefill(
    executor: Executor, kv: KVCacheManager, lengths: list[int], repeats: int = 2
) -> list[float]:
    """Seconds for one prefill of each length, through the real runner and a real block table.

    Only the shortest length is warmed up (it pages the weights in); the long ones are timed
    once more than needed only when they are cheap, so start-up stays short on large models.
    """
    out = []
    for i, n in enumerate(lengths):
        if not kv.allocate_slots(CALIBRATION_REQUEST, n):
            break
        so = _prefill_step(kv, n)
        rerun = SchedulerOutput(
            step=0, req_ids=so.req_ids, num_scheduled_tokens=[n], num_computed_tokens=[0]
        )  # the same prefill again: the runner knows the request and its table now
        try:
            if i == 0:
                executor.execute_model(so)  # warm-up
                so = rerun
            t = best_time(lambda so=so: executor.execute_model(so), 1)
            if t < 0.05 and repeats > 1:
                t = min(t, best_time(lambda rerun=rerun: executor.execute_model(rerun), repeats - 1))
            out.append(t)
        finally:
            _forget(executor, kv)
    return out


def fit_prefill(lengths: list[int], seconds: list[float]) -> tuple[float, float, float]:
    """Least-squares fit of c0 + c1 n + c2 n^2 with non-negative coefficients."""
    x = np.asarray(lengths[: len(seconds)], dtype=float)
    y = np.asarray(seconds, dtype=float)
    a = np.stack([np.ones_like(x), x, x * x], axis=1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if (coef < 0).any():  # refit without the offending terms
        keep = coef >= 0
        sub, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        coef = np.zeros(3)
        coef[keep] = np.clip(sub, 0, None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def calibrate(executor: Executor, kv: KVCacheManager, max_model_len: int, max_len: int = 256) -> Calibration:
    """Measure prefill times and the swap bandwidth (about a second on small models)."""
    t0 = time.perf_counter()
    cap = min(max_len, 256, max_model_len - 1, kv.pool.num_blocks * kv.block_size)
    lengths = sorted({n for n in (16, 64) if n < cap} | {cap})
    seconds = measure_prefill(executor, kv, lengths)
    cal = Calibration()
    if len(seconds) >= 2:
        cal.prefill_coeffs = fit_prefill(lengths, seconds)
    swap = executor.time_swap(32, 3)
    if swap is not None:
        n, t_out, t_in, t_fixed = swap
        cal.swap_bandwidth = 2 * n * kv.bytes_per_block / max(t_out + t_in - t_fixed, 1e-9)
        cal.swap_fixed_s = t_fixed
    cal.info = {
        "prefill_lengths": lengths[: len(seconds)],
        "prefill_seconds": seconds,
        "seconds": time.perf_counter() - t0,
    }
    return cal
