"""Which rows of a CPU GEMM take which kernel, the row buckets oneDNN runs on, and tensors
allocated with room for them.

A product whose rows all take the native row-wise kernel (``row_wise``) pads nothing; any other
runs on oneDNN padded to gemm_rows_bucket(m) rows (see there). Padding a tensor costs a copy
of every row: four a layer, 1.5-2 % of a full-budget prefill step of the 60M model
(docs/measurements/cpu_kernels.md, "GEMM inputs padded in place"). The kernels whose outputs feed a
GEMM (RMSNorm, SiLU-and-mul, attention) allocate them with empty_rows instead: the m rows are a view
of a buffer of the bucket's rows, so the GEMM reads the padded rows in place (rows_view).

bfloat16 batch invariance: a forward pass's leading decode rows take the row-wise kernel whatever
their number. How many there are is per model and per step, a RowInvariance the model owns and
hands to its modules when they are built: never process-wide, so two models in one process (a
draft model beside its target) never see each other's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvledger.kernels.native_build import library

# Up to this many rows the native blocked-layout GEMM is at least as fast as oneDNN's packed one
# (AVX-512, bench-60m shapes, 8-64 rows: 1.0-1.6x, docs/measurements/cpu_kernels.md, "The few-row
# GEMM on its own weight layout"); the AVX2 build keeps the 16 rows measured for its row-major
# predecessor (not timed on an AVX2 CPU).
SMALL_GEMM_MAX_ROWS = 64
SMALL_GEMM_MAX_ROWS_AVX2 = 16


def small_gemm_max_rows() -> int:
    """Products of at most this many rows take small_gemm (0 where there is no library)."""
    lib = library()
    if lib is None:
        return 0
    return SMALL_GEMM_MAX_ROWS if lib.vector_width == 16 else SMALL_GEMM_MAX_ROWS_AVX2


# Past its few-row range the native kernel also takes a product whole where that beats oneDNN on the
# bucket's padded rows (gemm_rows.row_wise). Measured on Zen 4 (the AVX-512 build with vdpbf16ps,
# the 60M model's four layer weights, docs/measurements/cpu_kernels.md, "Past the few-row range"):
# per row it takes 0.87-0.99x oneDNN's time up to 1,024 rows in float32 and 1.02-1.05x above, in
# bf16 1.01-1.08x; a bf16 mixed step all through it also stops computing its decode rows twice.
# Whole steps of 263-1,300 rows took 0.88-0.93x the time in float32, 0.93-0.98x in bf16 (beside only
# seven decodes 0.90-1.02x). bf16 went from 512 to 1,024 rows with the native decoder layer
# (fused_layer), which takes a step only when all its products are row-wise: whole bf16 steps of
# 758-1,008 rows beside 8-58 decodes then took 0.88-0.94x the time, a lone 800-token prompt 0.96x
# (session 16). Other builds keep oneDNN past small_gemm_max_rows() (not measured).
WHOLE_ROWS = {torch.float32: 1024, torch.bfloat16: 1024}  # up to these rows, always
WHOLE_ROW_COST = 1.06  # past them, when rows x this is under the bucket's rows


def small_gemm_whole(m: int, padded: int, dtype: torch.dtype) -> bool:
    """A product of m rows (oneDNN would run ``padded``) is faster in the native kernel whole."""
    lib = library()
    if lib is None or lib.vector_width != 16 or dtype not in WHOLE_ROWS:
        return False
    if dtype == torch.bfloat16 and not lib.bf16_packed:
        return False
    return m <= WHOLE_ROWS[dtype] or m * WHOLE_ROW_COST < padded


def gemm_rows_bucket(m: int) -> int:
    """The row count a CPU GEMM of ``m`` rows is padded to.

    oneDNN (and ideep in front of it) build and cache a primitive per GEMM shape, ~250 KB each,
    in LRU caches of 1,024 entries: with every prefill length its own shape, a server's resident
    memory grew by hundreds of MiB over thousands of requests, and each new length paid for a
    primitive's creation (issue 23). Rounding up to a multiple of 16 below 256 rows (where a
    GEMM streams its weight, so extra rows are nearly free) and to 8 steps per power of two
    above (<= 12.5 % padding where it computes) leaves ~40 shapes per weight up to 2,048 rows.
    """
    if m <= 16:
        return m
    step = max(16, 1 << max(0, (m - 1).bit_length() - 4))
    return -(-m // step) * step


def row_wise(m: int, dtype: torch.dtype, invariant_rows: int = 0) -> bool:
    """Every row of an m-row product takes the native row-wise kernel (for a weight it has
    packed, see Linear._row_wise): few rows (small_gemm_max_rows()), bfloat16 rows within the
    step's ``invariant_rows`` (RowInvariance), or rows it computes faster than oneDNN computes
    their bucket (small_gemm_whole)."""
    return (
        m <= small_gemm_max_rows()
        or (dtype == torch.bfloat16 and invariant_rows >= m)
        or small_gemm_whole(m, gemm_rows_bucket(m), dtype)
    )


def empty_rows(
    m: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu", invariant_rows: int = 0
) -> torch.Tensor:
    """An uninitialised [m, n] tensor whose storage continues with zeroed rows up to
    gemm_rows_bucket(m) (CPU); a plain tensor where the product it feeds takes the row-wise
    kernel (row_wise with the step's ``invariant_rows``), which pads nothing (spare rows and their
    zeroing would cost ~0.2 ms of a 60-decode step, 33 allocations)."""
    if torch.device(device).type != "cpu" or row_wise(m, dtype, invariant_rows):
        return torch.empty(m, n, dtype=dtype, device=device)
    mp = gemm_rows_bucket(m)
    buf = torch.empty(mp, n, dtype=dtype, device=device)
    if mp > m:
        buf[m:].zero_()
    return buf[:m]


@dataclass
class RowInvariance:
    """One model's bfloat16 batch invariance: the leading ``rows`` rows of its current forward
    pass (a step's single-token decodes, or every LM-head row) take the native row-wise GEMM
    whatever their number, so a decoding request's products never depend on how many others share
    its step. (oneDNN's bf16 kernels change with the row count and round differently from the
    native kernel; in float32 the difference stays below the last bits that decide a token, so
    float32 follows row_wise's other rules only.)

    The model sets it around each forward (``leading``); its Linear, RMSNorm and MLP modules and
    its attention backend hold the same object and read it."""

    rows: int = 0

    @contextlib.contextmanager
    def leading(self, rows: int) -> Iterator[None]:
        before, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = before

    def row_wise(self, m: int, dtype: torch.dtype) -> bool:
        """row_wise for an m-row product of this model's current step."""
        return row_wise(m, dtype, self.rows)

    def empty_rows(
        self, m: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """empty_rows for the input of a product of this model's current step."""
        return empty_rows(m, n, dtype, device, self.rows)


def rows_view(x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """x [m, n] extended in place to ``rows`` rows, when x is contiguous and its storage holds
    them (what empty_rows leaves); else None. Rows past x are read, never written: whatever they
    hold, a GEMM's output row depends on its own input row only, and those outputs are dropped."""
    if x.dim() != 2 or not x.is_contiguous():
        return None
    n = x.shape[1]
    if x.untyped_storage().nbytes() < (x.storage_offset() + rows * n) * x.element_size():
        return None
    return x.as_strided((rows, n), (n, 1))
