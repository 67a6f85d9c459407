"""Row buckets of CPU GEMMs, and tensors allocated with room for them.

A GEMM of m rows runs padded to gemm_rows_bucket(m) rows (see there). Padding a tensor costs a copy
of every row: four a layer, 1.5-2 % of a full-budget prefill step of the 60M model
(docs/measurements/cpu_kernels.md, "GEMM inputs padded in place"). The kernels whose outputs feed a
GEMM (RMSNorm, SiLU-and-mul, attention) allocate them with empty_rows instead: the m rows are a view
of a buffer of the bucket's rows, so the GEMM reads the padded rows in place (rows_view). Products
that the native row-wise kernel takes whole pad nothing (row_wise, which Linear follows too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


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


@dataclass
class _RowInvariant:
    """bfloat16 batch invariance: the leading `rows` rows of the current forward pass (a step's
    single-token decodes, or every LM-head row) take the native row-wise GEMM whatever their
    number, so a decoding request's products never depend on how many others share its step.
    (oneDNN's bf16 kernels change with the row count and round differently from the native
    kernel; in float32 the difference stays below the last bits that decide a token, so
    float32 follows row_wise's other rules only.)"""

    rows: int = 0

    @contextlib.contextmanager
    def leading(self, rows: int):
        before, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = before


ROW_INVARIANT = _RowInvariant()


def row_wise(m: int, dtype: torch.dtype) -> bool:
    """Every row of an m-row product takes the native row-wise kernel (for a weight it has
    packed, see Linear._row_wise): few rows (native.small_gemm_max_rows()), bfloat16 rows within
    ROW_INVARIANT, or rows it computes faster than oneDNN computes their bucket
    (native.small_gemm_whole)."""
    return (
        m <= native.small_gemm_max_rows()
        or (dtype == torch.bfloat16 and ROW_INVARIANT.rows >= m)
        or native.small_gemm_whole(m, gemm_rows_bucket(m), dtype)
    )


def empty_rows(m: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised [m, n] tensor whose storage continues with zeroed rows up to
    gemm_rows_bucket(m) (CPU); a plain tensor where the product it feeds takes the row-wise
    kernel, which pads nothing (spare rows and their zeroing would cost ~0.2 ms of a 60-decode
    step, 33 allocations)."""
    if torch.device(device).type != "cpu" or row_wise(m, dtype):
        return torch.empty(m, n, dtype=dtype, device=device)
    mp = gemm_rows_bucket(m)
    buf = torch.empty(mp, n, dtype=dtype, device=device)
    if mp > m:
        buf[m:].zero_()
    return buf[:m]


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


# Last: native imports this module (empty_rows), and row_wise only reads native when called.
from kvledger.kernels import native  # noqa: E402
