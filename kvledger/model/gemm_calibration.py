"""Time the native row-wise GEMM against oneDNN on a model's own layer weights, once per machine.

kernels/gemm_dispatch.py says why; this is the measuring half. Each kernel runs one decoder
layer's products (the fused qkv, o, gate_up and down weights as the model packed them, in its
dtype, with this process's threads) at the probe row counts, alternated round by round, the
fastest round kept. Probes go both ends first, then the middles of the widest gaps, within a
wall-clock budget, so a spent budget leaves gaps to interpolate rather than rows to extrapolate. The result is cached per CPU model and flags, native build,
threads, torch, dtype and shapes, so a later start reads it (logged either way).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kvledger import envs
from kvledger.kernels import native
from kvledger.kernels.gemm_dispatch import (
    PROBE_ROWS,
    TOLERANCE,
    GemmDispatch,
    dtype_name,
    machine_key,
    read_cached,
    write_cached,
)
from kvledger.model.layers import Linear

logger = logging.getLogger("kvledger")

BUDGET_S = 3.0  # issue 41: the calibration bounded, start-up kept within 5 s
NOISY_SHARE = 0.25


def layer_linears(model: torch.nn.Module) -> list[Linear]:
    """The first decoder layer's products that the native kernel can run (the library's side is
    Linear._big: oneDNN's packed weight, else torch's matmul)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return []
    return [m for m in layers[0].modules() if isinstance(m, Linear) and m.native_small]


def probe_rows(max_rows: int) -> tuple[int, ...]:
    """PROBE_ROWS below max_rows and the first at or above it."""
    return tuple(r for r in PROBE_ROWS if r < max_rows) + tuple(r for r in PROBE_ROWS if r >= max_rows)[:1]


def probe_order(rows: tuple[int, ...]) -> list[int]:
    """The order probes are timed in: both ends first, then the middle of the widest gap left,
    so a budget spent early leaves gaps to interpolate, never a range to extrapolate."""
    order = [rows[0], rows[-1]] if len(rows) > 1 else list(rows)
    left = [(0, len(rows) - 1)]
    while left:
        a, b = left.pop(0)
        if b - a < 2:
            continue
        mid = (a + b) // 2
        order.append(rows[mid])
        left += [(a, mid), (mid, b)]
    return order


def _inputs(linears: list[Linear], m: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    return [torch.randn(m, lin.small.k, generator=g).to(dtype) for lin in linears]


def time_layer(linears: list[Linear], xs: list[torch.Tensor], kernel: str) -> float:
    """Milliseconds for one layer's products of xs' rows through ``kernel`` ("native" or
    "onednn": Linear._big, on rows that are their own bucket)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for lin, x in zip(linears, xs, strict=True):
            if kernel == "native":
                native.small_gemm(x, lin.small, lin.bias)
            else:
                lin._big(x)
    return (time.perf_counter() - t0) * 1e3


def measure(
    linears: list[Linear], dtype: torch.dtype, max_rows: int, budget_s: float = BUDGET_S
) -> GemmDispatch:
    """Time both kernels at probe_rows(max_rows) in probe_order, within budget_s. A probe whose
    second-fastest rounds would pick the other kernel than its fastest rounds was timed while
    something else had the cores (or the two are too close to tell); past NOISY_SHARE of such
    probes the result says so (``noisy``): it is used for the run but not cached."""
    t0 = time.perf_counter()
    rows, nat, lib, noisy = [], [], [], 0
    for m in probe_order(probe_rows(max_rows)):
        rounds = 5 if m <= 256 else 3
        if rows:  # this probe's cost, scaled from the largest timed: never start one that overruns
            i = max(range(len(rows)), key=rows.__getitem__)
            guess = (nat[i] + lib[i]) * 1e-3 * max(1.0, m / rows[i]) * (rounds + 1)
            if time.perf_counter() - t0 + guess > budget_s:
                continue
        xs = _inputs(linears, m, dtype)
        times: dict[str, list[float]] = {"native": [], "onednn": []}
        for r in range(rounds + 1):  # the first round warms both (oneDNN makes its primitive)
            for kernel in ("native", "onednn") if r % 2 == 0 else ("onednn", "native"):
                ms = time_layer(linears, xs, kernel)
                if r > 0:
                    times[kernel].append(ms)
        fastest = {k: sorted(v) for k, v in times.items()}
        # unsteady where the second-fastest rounds would choose the other kernel
        noisy += (fastest["native"][0] <= TOLERANCE * fastest["onednn"][0]) != (
            fastest["native"][1] <= TOLERANCE * fastest["onednn"][1]
        )
        rows.append(m)
        nat.append(fastest["native"][0])
        lib.append(fastest["onednn"][0])
    order = sorted(range(len(rows)), key=rows.__getitem__)
    rows, nat, lib = ([v[i] for i in order] for v in (rows, nat, lib))
    return GemmDispatch(
        "calibrated", dtype_name(dtype), tuple(rows), tuple(nat), tuple(lib),
        seconds=time.perf_counter() - t0, source="measured", noisy=noisy > NOISY_SHARE * len(rows),
    )  # fmt: skip


def _cache_key(linears: list[Linear], max_rows: int) -> tuple[str, dict]:
    shapes = sorted({(lin.small.n, lin.small.k, lin.bias is not None) for lin in linears})
    return machine_key(
        {
            "dtype": dtype_name(linears[0].small.dtype),
            "shapes": [list(s) for s in shapes],
            "rows": list(probe_rows(max_rows)),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
    )


def remember(model: torch.nn.Module, max_rows: int, dispatch: GemmDispatch) -> Path | None:
    """Cache a calibration of this model's layer shapes here (what the next start reads)."""
    return write_cached(*_cache_key(layer_linears(model), max_rows), dispatch)


def model_dispatch(model: torch.nn.Module, max_rows: int, mode: str | None = None) -> GemmDispatch:
    """The GEMM dispatch for this model here: ``mode`` (default KVLEDGER_GEMM_DISPATCH); a
    calibrated one is read from the cache, else measured and cached."""
    mode = mode or envs.KVLEDGER_GEMM_DISPATCH
    if mode != "calibrated":
        return GemmDispatch(mode, source="KVLEDGER_GEMM_DISPATCH")
    linears = layer_linears(model)
    if not linears or native.library() is None:
        return GemmDispatch("builtin", source="nothing to calibrate: no weight packed for the native kernel")
    digest, key = _cache_key(linears, max_rows)
    cached = read_cached(digest, key)
    if cached is not None:
        return cached
    d = measure(linears, linears[0].small.dtype, max_rows, BUDGET_S)
    if d.noisy:
        logger.warning(
            "GEMM dispatch calibrated in %.2f s, but its timings were unsteady (the cores busy with "
            "other work?): used for this run, not cached; `kvledger doctor --recalibrate` on a "
            "quiet machine caches one", d.seconds,
        )  # fmt: skip
        return d
    path = write_cached(digest, key, d)
    logger.info(
        "GEMM dispatch calibrated in %.2f s on this CPU (%s, %d row counts)%s",
        d.seconds, d.dtype, len(d.rows), f"; cached in {path}" if path else "",
    )  # fmt: skip
    return d
