"""Row buckets of CPU GEMMs, and tensors allocated with room for them.

A GEMM of m rows runs padded to gemm_rows_bucket(m) rows (see there). Padding a tensor costs a
copy of every row: four a layer, 1.5-2 % of a full-budget prefill step of the 60M model (issue 24,
docs/benchmarks.md). The kernels whose outputs feed a GEMM (RMSNorm, SiLU-and-mul, attention)
allocate them with empty_rows instead: the m rows are a view of a buffer of the bucket's rows,
so the GEMM reads the padded rows in place (rows_view).
"""

from __future__ import annotations

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


# Up to this many rows a plain tensor: decode steps' products go to the native row-wise kernel
# (native.small_gemm_max_rows(): 64 with AVX-512), which pads nothing; the spare rows and their
# zeroing would cost ~0.2 ms of a 60-decode step (33 allocations).
PLAIN_ROWS = 64


def empty_rows(m: int, n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised [m, n] tensor whose storage continues with zeroed rows up to
    gemm_rows_bucket(m) (CPU, more than PLAIN_ROWS rows; else a plain tensor)."""
    if m <= PLAIN_ROWS or torch.device(device).type != "cpu":
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
