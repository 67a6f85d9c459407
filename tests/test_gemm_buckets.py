"""CPU GEMMs run on row counts rounded to a few buckets, so oneDNN's per-shape primitive caches
stay small and a long-running server's memory plateaus (issue 23)."""

from __future__ import annotations

import pytest
import torch

from kvledger.model import native
from kvledger.model.layers import (
    OVERWRITE_MAX_FRACTION,
    OVERWRITE_MIN_ROWS,
    ROW_INVARIANT,
    Linear,
    gemm_rows_bucket,
)


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


def _bf16_linear(k: int, n: int) -> Linear:
    torch.manual_seed(1)
    lin = Linear(k, n, bias=True)
    lin.weight.data = torch.randn(n, k).bfloat16()
    lin.bias.data = torch.randn(n).bfloat16()
    ref_w, ref_b = lin.weight.data.double(), lin.bias.data.double()
    lin.pack()
    if lin.packed is None or lin.small is None:
        pytest.skip("bf16 here lacks oneDNN's native kernels or the native library")
    lin.ref = (ref_w, ref_b)
    return lin


@pytest.mark.parametrize(("m", "n"), [(70, 7), (300, 7), (1100, 7), (1100, 100), (2048, 7)])
def test_bf16_leading_rows_are_row_wise_on_both_split_paths(m, n, monkeypatch):
    """A bf16 product whose leading `n` rows are decodes (ROW_INVARIANT): those rows come from
    the native row-wise kernel whatever the rest (batch invariance), the rest from oneDNN, on
    the concatenating path and the in-place overwrite path (m >= 1,024, n <= m / 16) alike."""
    lin = _bf16_linear(512, 48)
    x = torch.randn(m, 512).bfloat16()
    ref_w, ref_b = lin.ref
    with ROW_INVARIANT.leading(n):
        got = lin(x)
    assert got.shape == (m, 48) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got[:n], native.small_gemm(x[:n], lin.small, lin.bias))
    assert torch.equal(got[3:4], native.small_gemm(x[3:4], lin.small, lin.bias))  # a row alone
    want = x.double() @ ref_w.T + ref_b
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.25)
    # Which kernel made which rows: oneDNN's results marked (+ 1024) must survive exactly in the
    # prefill rows and nowhere in the decode rows (here the two kernels agree to the bit).
    overwrite = m >= OVERWRITE_MIN_ROWS and n * OVERWRITE_MAX_FRACTION <= m
    assert overwrite == (m >= 1100 and n == 7)
    seen = []
    monkeypatch.setattr(lin, "_big", lambda t: seen.append(t.shape[0]) or Linear._big(lin, t) + 1024)
    with ROW_INVARIANT.leading(n):
        marked = lin(x)
    assert seen == [m if overwrite else m - n]
    assert torch.equal(marked[:n], got[:n])
    assert torch.equal(marked[n:], got[n:] + 1024)
