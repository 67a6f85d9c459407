"""The contiguous reference kernels (kvledger/model/attention/contiguous.py) compute exactly what
the paged ones do, so benchmarks/seed_paging.py compares the cost of the block table alone."""

from __future__ import annotations

import pytest
import torch

from kvledger.kernels import native
from kvledger.model.attention import contiguous as C
from kvledger.storage.kv_cache import PagedKVCache


def _case(
    seed: int, bs: int, lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int = 64
):
    """A pool with each request's blocks scattered at random, and the same K/V laid out
    contiguously (request b's run starting at block b * max_blocks)."""
    g = torch.Generator().manual_seed(seed)
    mb = max(-(-n // bs) for n in lens)
    nblocks = len(lens) * mb + 3
    kv = torch.randn(2, nblocks, bs, num_kv_heads, head_dim, generator=g)
    tables = torch.randperm(nblocks, generator=g)[: len(lens) * mb].view(len(lens), mb)
    contig = torch.zeros_like(kv)
    for b in range(len(lens)):
        contig[:, b * mb : (b + 1) * mb] = kv[:, tables[b]]
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    first = torch.arange(len(lens), dtype=torch.int64) * mb
    return kv, contig, tables, first, q, torch.tensor(lens, dtype=torch.int64), mb


@pytest.mark.skipif(not C.contig_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize(
    "bs,lens,heads",
    [(1, [1, 7, 40], (4, 4)), (16, [5, 16, 300, 33], (8, 2)), (128, [129, 1000], (16, 1))],
)
def test_native_contiguous_equals_paged_bit_for_bit(bs, lens, heads):
    kv, contig, tables, first, q, seq_lens, mb = _case(0, bs, lens, *heads)
    rows = torch.arange(len(lens), dtype=torch.int64)
    scale = 64**-0.5
    paged = torch.empty(len(lens), heads[0] * 64)
    native.paged_decode(q, PagedKVCache(kv), tables, seq_lens, rows, paged, scale)
    ref = torch.empty_like(paged)
    C.contig_decode(q, contig[0], contig[1], first, seq_lens, rows, ref, scale)
    assert torch.equal(paged, ref)
    # the paged kernel over the contiguous layout (identity table): same again
    ident = first[:, None] + torch.arange(mb)[None, :]
    same = torch.empty_like(paged)
    native.paged_decode(q, PagedKVCache(contig), ident, seq_lens, rows, same, scale)
    assert torch.equal(same, ref)
    # and both are attention: against a dense float64 softmax
    for b, n in enumerate(lens):
        k = kv[0][tables[b]].flatten(0, 1)[:n].double()
        v = kv[1][tables[b]].flatten(0, 1)[:n].double()
        G = heads[0] // heads[1]
        qb = q[b].double().view(heads[1], G, 64)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qb, k) * scale, -1)
        dense = torch.einsum("hgt,thd->hgd", p, v).reshape(-1)
        assert torch.allclose(ref[b].double(), dense, atol=1e-5)


@pytest.mark.skipif(not C.contig_available(), reason="native kernels unavailable here")
def test_contig_decode_rejects_a_run_past_the_cache():
    kv, contig, tables, first, q, seq_lens, mb = _case(1, 16, [40], 4, 2)
    out = torch.empty(1, 4 * 64)
    with pytest.raises(ValueError, match="passes the end"):
        C.contig_decode(
            q,
            contig[0],
            contig[1],
            first + contig.shape[1] - 1,
            seq_lens,
            torch.zeros(1, dtype=torch.int64),
            out,
            0.1,
        )


def test_torch_contiguous_equals_paged():
    for lens in ([300], [5, 16, 300, 33]):
        kv, contig, tables, first, q, seq_lens, mb = _case(2, 16, lens, 8, 2)
        scale = 64**-0.5
        paged = C.paged_decode_torch(q, PagedKVCache(kv), tables, seq_lens, scale)
        bufs = contig[:, : len(lens) * mb].reshape(2, len(lens), mb * 16, 2, 64)
        ref = C.contiguous_decode_torch(q, bufs[0], bufs[1], seq_lens, scale)
        assert torch.allclose(paged, ref, atol=1e-6, rtol=0)
        assert C.contiguous_runs(first[:, None] + torch.arange(mb)[None, :], seq_lens, 16)
        assert not C.contiguous_runs(tables, seq_lens, 16) or len(lens) == 1
