"""Large CPU buffers on transparent huge pages.

Decode steps stream every weight and a request's whole KV context through the CPU; on 4 KiB
pages that is a TLB miss every 4 KiB and, for the lazily zeroed KV pool, a page fault every
4 KiB written. Anonymous private memory advised with MADV_HUGEPAGE gets 2 MiB pages where the
kernel allows it (THP "madvise" or "always"): the native GEMM streamed weights 5-15 % faster
in a microbenchmark (docs/benchmarks.md, issue 7). Pages are still only mapped when first
written, so a pool's resident size grows with its use, in 2 MiB steps.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are mapped on first write, on huge pages if it is large
    and the platform supports the advice (else calloc'd memory, equally lazy)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    # Private, not shared: shared anonymous memory is shmem and follows another THP setting.
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP disabled: ordinary pages
    buf = torch.frombuffer(m, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -buf.data_ptr() % HUGE_PAGE  # 2 MiB-aligned, so every page can be a huge one
    return buf[start : start + nbytes].view(dtype).view(shape)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory from zeros()."""
    out = zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
