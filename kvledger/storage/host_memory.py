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
import threading

import numpy as np
import torch

from kvledger import envs

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are mapped on first write, on huge pages if it is large
    and the platform supports the advice (else calloc'd memory, equally lazy)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not _can_advise():
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    return _huge_mapping(nbytes).view(dtype).view(shape)


def _can_advise() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def _huge_mapping(nbytes: int) -> torch.Tensor:
    """nbytes of fresh zeroed uint8 memory, 2 MiB-aligned and advised MADV_HUGEPAGE."""
    # Private, not shared: shared anonymous memory is shmem and follows another THP setting.
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP disabled: ordinary pages
    buf = torch.frombuffer(m, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -buf.data_ptr() % HUGE_PAGE  # 2 MiB-aligned, so every page can be a huge one
    return buf[start : start + nbytes]


# Weights under 2 MiB share mappings of this size (see weight_zeros).
WEIGHT_CHUNK = 32 << 20
_ALIGN = 64  # a cache line: every carved weight starts on one (the kernels' vectors are 64 bytes)


class _WeightArena:
    """Bump allocation of small weights from huge-page chunks; a chunk's memory goes back when
    every tensor carved from it is gone (they are views of it). Never reused before: the memory
    handed out is always fresh zeros."""

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            if self.chunk is None or self.used + nbytes > self.chunk.numel():
                self.chunk, self.used = _huge_mapping(WEIGHT_CHUNK), 0
            out = self.chunk[self.used : self.used + nbytes]
            self.used += -(-nbytes // _ALIGN) * _ALIGN
            return out


_arena = _WeightArena()


def weight_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """zeros() for memory held as long as its model: a weight's packed copy, codes, scales.

    zeros() gives a tensor under 2 MiB ordinary 4 KiB pages; in a model whose projections are that
    small (a 4-bit 1,024 x 1,024 one is 512 KiB), a decode step streaming them then misses the TLB
    every 4 KiB and the hardware prefetcher stops at every page boundary: bench-230m's 4-bit
    weights, half of them under 2 MiB, streamed at 14-16 GB/s on one Zen 4 core, and the same bytes
    on huge pages at 17-18 (docs/measurements/quantised_weights.md, "Small weights on huge
    pages"). So those are carved, one after another, from shared 32 MiB huge-page mappings.
    Only for memory that lives as long as the model: a carved tensor keeps its whole chunk alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes >= HUGE_PAGE or nbytes == 0 or not _can_advise():
        return zeros(shape, dtype)
    return _arena.take(nbytes).view(dtype).view(shape)


def copy_of(t: torch.Tensor, alloc=zeros) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory from ``alloc(shape, dtype=)`` (zeros(), or
    weight_zeros() for a weight)."""
    out = alloc(tuple(t.shape), dtype=t.dtype)
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
    if not envs.KVLEDGER_MALLOPT:
        return False
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc, not musl
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim), once the model is
    loaded: loading holds the checkpoint's tensors, and quantising or packing makes float copies,
    all freed by then but, under keep_freed_memory (and glibc's own adaptive threshold), kept in
    the heap at the load's peak. Quantising bench-230m to int4 on the fly grew the process by
    0.9-1.4 GiB for 123 MiB of weights; trimmed, by 383 MiB (docs/measurements/serving_settings.md,
    "Freed load memory returned"). Returns whether it ran (glibc only)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim(0)
    return True
