"""Large CPU buffers on transparent huge pages.

Decode steps stream every weight and a request's whole KV context through the CPU; on 4 KiB pages
that is a TLB miss every 4 KiB and, for the lazily zeroed KV pool, a page fault every 4 KiB written.
Anonymous private memory advised with MADV_HUGEPAGE gets 2 MiB pages where the kernel allows it (THP
"madvise" or "always"): the native GEMM streamed weights 5-15 % faster in a microbenchmark
(docs/measurements/cpu_kernels.md, the issue-7 section). Pages are still only mapped when first
written, so a pool's resident size grows with its use, in 2 MiB steps.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import numpy as np
import torch

from kvledger import envs

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


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks of up to 32 MiB in the heap instead of unmapping them.

    A forward pass allocates and frees the same activation buffers every step; by default glibc
    serves each one above its (adaptive) mmap threshold with a fresh mapping and returns it on free,
    so every step page-faults its activations in again: a 2,044-token prefill of kvledger-tiny took
    101-110 ms that way and 84-92 ms with the buffers kept (docs/measurements/serving_settings.md,
    "freed heap blocks kept"). vLLM's CPU guide preloads tcmalloc for the same reason. The cost is
    that the heap stays at its peak (a step's activations, tens of MiB). Off with
    KVLEDGER_MALLOPT=0; returns whether it was applied (glibc only).
    """
    if not envs.KVLEDGER_MALLOPT or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc, not musl
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
