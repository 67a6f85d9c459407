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
from dataclasses import dataclass, field

import torch

from kvledger.kernels.gemm_dispatch import (  # noqa: F401 (the builtin rules, named here too)
    BUILTIN,
    SMALL_GEMM_MAX_ROWS,
    SMALL_GEMM_MAX_ROWS_AVX2,
    WHOLE_ROW_COST,
    WHOLE_ROWS,
    GemmDispatch,
    builtin_row_wise,
    gemm_rows_bucket,
    small_gemm_max_rows,
    small_gemm_whole,
)


def row_wise(
    m: int, dtype: torch.dtype, invariant_rows: int = 0, dispatch: GemmDispatch | None = None
) -> bool:
    """Every row of an m-row product takes the native row-wise kernel (for a weight it has
    packed, see Linear._row_wise): bfloat16 rows within the step's ``invariant_rows``
    (RowInvariance), or where the model's ``dispatch`` (calibrated on this machine; the builtin
    rules where None) gives the product to the native kernel."""
    if dtype == torch.bfloat16 and invariant_rows >= m:
        return True
    return (dispatch or BUILTIN).native_takes(m, dtype)


def empty_rows(
    m: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu", invariant_rows: int = 0,
    rows: RowInvariance | None = None,
) -> torch.Tensor:
    """An uninitialised [m, n] tensor whose storage continues with zeroed rows up to
    gemm_rows_bucket(m) (CPU); a plain tensor where the product it feeds takes the row-wise
    kernel (the model's ``rows``.row_wise, else row_wise with the step's ``invariant_rows``), which
    pads nothing (spare rows and their zeroing would cost ~0.2 ms of a 60-decode step, 33
    allocations)."""
    native_rows = rows.row_wise(m, dtype) if rows is not None else row_wise(m, dtype, invariant_rows)
    if torch.device(device).type != "cpu" or native_rows:
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
    its attention backend hold the same object and read it. It also holds the model's GEMM
    ``dispatch`` (calibrated on this machine for its weights, kernels/gemm_dispatch.py), and
    ``batch_invariant`` (KVLEDGER_BATCH_INVARIANT, vLLM's VLLM_BATCH_INVARIANT): every product the
    native kernel can take takes it, prefill rows included, so a request's outputs are the same
    bits alone and in any batch, in every build, whatever the dispatch measured."""

    rows: int = 0
    dispatch: GemmDispatch = field(default_factory=GemmDispatch)
    batch_invariant: bool = False

    @contextlib.contextmanager
    def leading(self, rows: int) -> Iterator[None]:
        before, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = before

    def row_wise(self, m: int, dtype: torch.dtype) -> bool:
        """row_wise for an m-row product of this model's current step."""
        return self.batch_invariant or row_wise(m, dtype, self.rows, self.dispatch)

    def empty_rows(
        self, m: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """empty_rows for the input of a product of this model's current step."""
        return empty_rows(m, n, dtype, device, rows=self)


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
