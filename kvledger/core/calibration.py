"""Start-up measurement for the preemption cost model: copy bandwidth and prefill time.

Swap cost is measured by swapping real blocks out to the host pool and back; recompute cost
by timing real prefills at a few lengths and fitting t(n) = c0 + c1 n + c2 n^2 (attention
makes it super-linear). The crossover where swapping becomes cheaper then *comes out of*
these numbers; nothing about "short vs long" is hard-coded.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from kvledger.core.request import Request
from kvledger.core.scheduler import ScheduledRequest, SchedulerOutput
from kvledger.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvledger.core.engine import LLMEngine

logger = logging.getLogger("kvledger")


def _timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_prefill(engine: LLMEngine, lengths: list[int], repeats: int = 2) -> list[float]:
    """Seconds for one prefill of each length, through the real runner and a real block table.

    Only the shortest length is warmed up (it pages the weights in); the long ones are timed
    once more than needed only when they are cheap, so start-up stays short on large models.
    """
    kv, runner = engine.kv, engine.runner
    out = []
    for i, n in enumerate(lengths):
        req = Request("__calibrate__", [1] * n, SamplingParams(max_tokens=1, temperature=0))
        if not kv.allocate_slots(req.request_id, n):
            break
        so = SchedulerOutput(step=0, scheduled=[ScheduledRequest(req, n)], table_deltas=kv.take_table_deltas())
        try:
            if i == 0:
                runner.execute(so)  # warm-up
            t = _timed(lambda so=so: runner.execute(so), 1)
            if t < 0.05 and repeats > 1:
                t = min(t, _timed(lambda so=so: runner.execute(so), repeats - 1))
            out.append(t)
        finally:
            kv.free(req.request_id)
    return out


def measure_swap_bandwidth(engine: LLMEngine, num_blocks: int = 32, repeats: int = 3) -> float | None:
    """Bytes per second of one batched block copy each way (device <-> host)."""
    host = engine.host_pool
    if host is None:
        return None
    n = min(num_blocks, host.num_blocks, engine.kv_pool.num_blocks)
    pairs = [(i, i) for i in range(n)]
    host.swap_out(pairs)  # warm-up
    t_out = _timed(lambda: host.swap_out(pairs), repeats)
    t_in = _timed(lambda: host.swap_in(pairs), repeats)
    t_fixed = _timed(lambda: (host.swap_out(pairs[:1]), host.swap_in(pairs[:1])), repeats)
    nbytes = n * engine.kv.bytes_per_block
    bw = 2 * nbytes / max(t_out + t_in - t_fixed, 1e-9)
    engine.cost_model.swap_fixed_s = t_fixed
    return bw


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


def calibrate_cost_model(engine: LLMEngine, max_len: int = 256) -> None:
    """Fill the engine's cost model from measurements (about a second on small models)."""
    t0 = time.perf_counter()
    cap = min(max_len, 256, engine.max_model_len - 1, engine.kv.pool.num_blocks * engine.kv.block_size)
    lengths = sorted({n for n in (16, 64) if n < cap} | {cap})
    seconds = measure_prefill(engine, lengths)
    cm = engine.cost_model
    if len(seconds) >= 2:
        cm.prefill_coeffs = fit_prefill(lengths, seconds)
    bw = measure_swap_bandwidth(engine)
    if bw:
        cm.swap_bandwidth = bw
    engine.calibration = {
        "prefill_lengths": lengths[: len(seconds)],
        "prefill_seconds": seconds,
        "swap_bandwidth_bytes_per_s": cm.swap_bandwidth,
        "swap_fixed_s": cm.swap_fixed_s,
        "crossover_tokens": cm.crossover_tokens(engine.bytes_per_token),
        "seconds": time.perf_counter() - t0,
    }
    logger.info("preemption cost model calibrated: %s", engine.calibration)
