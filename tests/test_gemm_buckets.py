"""CPU GEMMs run on row counts rounded to a few buckets, so oneDNN's per-shape primitive caches
stay small and a long-running server's memory plateaus (issue 23)."""

from __future__ import annotations

import torch

from kvledger.model.layers import Linear, gemm_rows_bucket


def test_buckets_cover_every_row_count_with_bounded_padding_and_few_shapes():
    buckets = set()
    for m in range(1, 8193):
        b = gemm_rows_bucket(m)
        assert b >= m
        if m <= 16:
            assert b == m  # decode steps: the native kernel's rows, never padded
        elif m > 256:
            assert b <= m * 1.125, (m, b)
        buckets.add(b)
    assert len({gemm_rows_bucket(m) for m in range(1, 2049)}) <= 64
    assert len(buckets) <= 96


def test_padded_rows_do_not_change_the_real_rows():
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    for m in (17, 100, 257, 700):
        x = torch.randn(m, 64)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        got = lin(x)
        assert got.shape == (m, 48)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
