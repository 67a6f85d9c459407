"""Contiguous-KV references for decode attention: what paging costs, measured on the same code.

The engine always reads KV through block tables (paged). To price that indirection
(benchmarks/seed_paging.py), each decode path has a twin that reads one contiguous run of KV
per request and is otherwise the same code:

- native: ``contig_decode`` calls ``kvl_contig_decode`` (csrc/contig_decode.c), which is
  csrc/paged_decode.c compiled again with the block address ``first + blk`` instead of
  ``block_tables[b, blk]``; every loop, prefetch and block-sized chunk is shared.
- torch: ``paged_decode_torch`` is the torch backend's decode read (``PagedKVCache.read``, an
  index_select gather of the blocks, then SDPA); ``contiguous_decode_torch`` hands SDPA a view
  of the contiguous buffer instead of the gathered copy. The SDPA calls are identical.

Only the references live here; the engine never calls them.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kvledger.kernels import native


class _ContigLibrary:
    """native.library() with kvl_paged_decode swapped for kvl_contig_decode (same signature, as
    the same source compiled twice), so that contig_decode goes through native.paged_decode's
    own argument marshalling and follows any change to it."""

    def __init__(self, lib) -> None:
        self._lib = lib
        fn = lib.kvl_contig_decode
        fn.argtypes = lib.kvl_paged_decode.argtypes
        fn.restype = lib.kvl_paged_decode.restype
        self.kvl_paged_decode = fn

    def __getattr__(self, name: str):
        return getattr(self._lib, name)


@functools.cache
def _contig_library() -> _ContigLibrary | None:
    lib = native.library()
    return None if lib is None else _ContigLibrary(lib)


def contig_available() -> bool:
    return _contig_library() is not None


def contiguous_runs(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> bool:
    """Whether every request's used blocks are consecutive (block_tables[b, j] = first + j)."""
    for b in range(block_tables.shape[0]):
        n = -(-int(seq_lens[b]) // block_size)
        row = block_tables[b, :n]
        if not torch.equal(row, row[0] + torch.arange(n, dtype=row.dtype)):
            return False
    return True


def contig_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    first_blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    check: bool = True,
) -> None:
    """native.paged_decode's contract where request b's context is the seq_lens[b] tokens that
    start at block first_blocks[b] and run on contiguously (no block table is read).

    first_blocks may be a [B] vector or a [B, n] table of which only column 0 is used. check=False
    skips the bounds check (timed callers whose runs are known, so that the Python overhead
    matches native.paged_decode's)."""
    lib = _contig_library()
    if lib is None:
        raise RuntimeError("native kernels are not available on this machine")
    if first_blocks.dim() == 1:
        first_blocks = first_blocks[:, None]
    first_blocks = first_blocks.to(torch.int64).contiguous()
    if check:
        num_blocks, block_size = k_cache.shape[:2]
        ends = first_blocks[:, 0] * block_size + seq_lens
        if bool((first_blocks[:, 0] < 0).any()) or int(ends.max()) > num_blocks * block_size:
            raise ValueError("contig_decode: a request's run of blocks passes the end of the cache")
    real = native.library
    native.library = lambda: lib
    try:
        _PAGED_DECODE(q, SimpleNamespace(k=k_cache, v=v_cache), first_blocks, seq_lens, rows, out, scale)
    finally:
        native.library = real


# Bound at import: callers may stand contig_decode in for native.paged_decode (seed_paging's
# end-to-end variant does), which must not make it call itself.
_PAGED_DECODE = native.paged_decode


def _sdpa_decode(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The torch backend's batched decode: q [B, H, D], kc/vc [B, S, K, D] -> [B, H * D]."""
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = kc.shape[2]
    mask = None
    if bsz > 1:
        valid = torch.arange(kc.shape[1])[None, :] < seq_lens[:, None]
        mask = torch.zeros(valid.shape, dtype=q.dtype).masked_fill_(~valid, float("-inf"))[
            :, None, None, :
        ]
    else:
        kc, vc = kc[:, : int(seq_lens[0])], vc[:, : int(seq_lens[0])]
    qd = q.view(bsz, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        qd, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return o.reshape(bsz, num_heads * head_dim)


def paged_decode_torch(
    q: torch.Tensor, layer_cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The torch path: gather each request's blocks (layer_cache.read), then SDPA."""
    kc, vc = layer_cache.read(block_tables)  # [B, nb, bs, K, D], a copy
    return _sdpa_decode(q, kc.flatten(1, 2), vc.flatten(1, 2), seq_lens, scale)


def contiguous_decode_torch(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same SDPA over per-request contiguous buffers k_buf/v_buf [B, S, K, D] (views, no gather)."""
    return _sdpa_decode(q, k_buf, v_buf, seq_lens, scale)
