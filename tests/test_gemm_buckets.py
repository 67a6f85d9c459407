"""CPU GEMMs run on row counts rounded to a few buckets, so oneDNN's per-shape primitive caches
stay small and a long-running server's memory plateaus (issue 23)."""

from __future__ import annotations

import pytest
import torch

from kvledger.kernels import gemm_rows, native
from kvledger.kernels.gemm_rows import RowInvariance, empty_rows, row_wise, rows_view
from kvledger.model.layers import (
    OVERWRITE_MAX_FRACTION,
    OVERWRITE_MIN_ROWS,
    Linear,
    _bucketed_rows,
    gemm_rows_bucket,
)


def _onednn_rows(dtype: torch.dtype, at_least: int) -> int:
    """The fewest rows, at least ``at_least``, of a product that oneDNN takes on padded rows here
    (the native kernel's share depends on the build: gemm_rows.small_gemm_whole)."""
    m = at_least
    while row_wise(m, dtype) or gemm_rows_bucket(m) == m:
        m += 1
    return m


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_allocated_with_room_are_padded_in_place(dtype):
    """A GEMM input from empty_rows is read padded where it lies (no copy), with the same bits
    as the copied padding, whatever the rows past it hold; nothing past it is written."""
    torch.manual_seed(2)
    lin = Linear(64, 48, bias=True)
    lin.weight.data = torch.randn(48, 64).to(dtype)
    lin.bias.data = torch.randn(48).to(dtype)
    lin.pack()
    for m in sorted({_onednn_rows(dtype, a) for a in (65, 257, 1025)}):
        mp = gemm_rows_bucket(m)
        x = empty_rows(m, 64, dtype)
        assert x.shape == (m, 64) and x.is_contiguous()
        tail = x.as_strided((mp - m, 64), (64, 1), m * 64)
        assert torch.equal(tail, torch.zeros_like(tail))  # a fresh buffer's padding is zero
        x.copy_(torch.randn(m, 64))
        seen = _bucketed_rows(x, lambda t: torch.tensor([[t.data_ptr(), t.shape[0]]] * t.shape[0]))
        assert seen[0].tolist() == [x.data_ptr(), mp], "padded in place, not copied"
        want = lin(x.clone())  # a plain tensor: the copy path
        assert rows_view(x.clone(), mp) is None
        tail.fill_(float("nan"))  # rows past x do not reach its rows
        got = lin(x)
        assert torch.equal(got, want) and got.shape == (m, 48)
        assert tail.isnan().all(), "the rows past x are only read"


def test_inputs_of_row_wise_products_are_plain_tensors():
    """No bucket rows (nor their zeroing) behind the input of a product the native row-wise
    kernel takes whole, which pads nothing: few rows, bfloat16 rows within the model's
    RowInvariance (a step's decodes), or rows it computes faster than oneDNN its bucket; every
    other CPU product's input gets them."""
    small = gemm_rows.small_gemm_max_rows()
    if small == 0:
        pytest.skip("no native library here")

    rows = RowInvariance()

    def roomy(m: int, dtype: torch.dtype) -> bool:
        x = rows.empty_rows(m, 64, dtype)
        return x.untyped_storage().nbytes() > x.nbytes

    for dtype in (torch.float32, torch.bfloat16):
        for m in range(1, 2100, 7):
            assert roomy(m, dtype) == (not row_wise(m, dtype) and gemm_rows_bucket(m) > m), (dtype, m)
    m = _onednn_rows(torch.bfloat16, small + 1)
    more = _onednn_rows(torch.bfloat16, m + 1)
    assert roomy(m, torch.bfloat16) and roomy(more, torch.bfloat16)
    with rows.leading(m):
        assert not roomy(m, torch.bfloat16)  # bf16 decodes: row-wise whatever their number
        assert roomy(more, torch.bfloat16)  # beside a prefill: oneDNN takes the rest
        f32 = _onednn_rows(torch.float32, m)
        assert roomy(f32, torch.float32)  # float32 keeps the row-count rule


def test_the_native_kernel_takes_products_whole_where_that_beats_the_padding():
    """Past its few-row range the native kernel takes a product whole on the build where that was
    measured faster (AVX-512, bf16 with vdpbf16ps): always up to WHOLE_ROWS, above only when the
    bucket's padding costs more than its slower rows. Elsewhere oneDNN keeps every such product."""
    lib = native.library()
    if lib is None:
        pytest.skip("no native library here")
    for dtype in (torch.float32, torch.bfloat16):
        on = lib.vector_width == 16 and (dtype == torch.float32 or lib.bf16_packed)
        top = gemm_rows.WHOLE_ROWS[dtype]
        assert gemm_rows.small_gemm_whole(top, top, dtype) == on  # unpadded, still native
        assert gemm_rows.small_gemm_whole(1025, gemm_rows_bucket(1025), dtype) == on  # 12 % padding
        assert not gemm_rows.small_gemm_whole(2040, gemm_rows_bucket(2040), dtype)  # 0.4 %
        assert not gemm_rows.small_gemm_whole(2048, 2048, dtype)
        assert row_wise(top, dtype) == (on or top <= gemm_rows.small_gemm_max_rows())
    assert not gemm_rows.small_gemm_whole(1025, gemm_rows_bucket(1025), torch.float16)  # not its dtype


def test_rows_view_declines_what_it_cannot_extend():
    x = torch.randn(40, 8)
    assert rows_view(x[:30], 40) is not None  # a slice of a larger tensor holds the rows
    assert rows_view(x[:30], 41) is None  # past the storage
    assert rows_view(x[10:35], 40) is None  # from its offset, 30 rows remain
    assert rows_view(x[:30, :4], 40) is None  # not contiguous
    assert rows_view(x.view(5, 8, 8), 10) is None  # not 2-D


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_feeding_a_gemm_leave_room_for_its_padding(dtype):
    """RMSNorm and SiLU-and-mul outputs carry their bucket's rows, so the projections after them
    copy nothing."""
    m = _onednn_rows(dtype, 257)
    mp = gemm_rows_bucket(m)
    x = torch.randn(m, 64).to(dtype)
    y = native.rms_norm(x, torch.ones(64, dtype=dtype), 1e-5)
    assert rows_view(y, mp) is not None
    z = native.silu_mul(torch.randn(m, 128).to(dtype))
    assert rows_view(z, mp) is not None


def _bf16_linear(k: int, n: int) -> Linear:
    torch.manual_seed(1)
    lin = Linear(k, n, bias=True, row_invariance=RowInvariance())
    lin.weight.data = torch.randn(n, k).bfloat16()
    lin.bias.data = torch.randn(n).bfloat16()
    ref_w, ref_b = lin.weight.data.double(), lin.bias.data.double()
    lin.pack()
    if lin.packed is None or lin.small is None:
        pytest.skip("bf16 here lacks oneDNN's native kernels or the native library")
    lin.ref = (ref_w, ref_b)
    return lin


@pytest.mark.parametrize(("m", "n"), [(70, 7), (300, 7), (620, 7), (1100, 7), (1100, 100), (2048, 7)])
def test_bf16_leading_rows_are_row_wise_on_both_split_paths(m, n, monkeypatch):
    """A bf16 product whose leading `n` rows are decodes (its RowInvariance): those rows come from
    the native row-wise kernel whatever the rest (batch invariance), the rest from oneDNN, on
    the concatenating path and the in-place overwrite path (m >= 1,024, n <= m / 16) alike."""
    lin = _bf16_linear(512, 48)
    x = torch.randn(m, 512).bfloat16()
    ref_w, ref_b = lin.ref
    with lin.row_invariance.leading(n):
        got = lin(x)
    assert got.shape == (m, 48) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got[:n], native.small_gemm(x[:n], lin.small, lin.bias))
    assert torch.equal(got[3:4], native.small_gemm(x[3:4], lin.small, lin.bias))  # a row alone
    want = x.double() @ ref_w.T + ref_b
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.25)
    # Which kernel made which rows: oneDNN's results marked (+ 1024) must survive exactly in the
    # prefill rows and nowhere in the decode rows (here the two kernels agree to the bit). Where
    # the native kernel takes the whole product (gemm_rows.small_gemm_whole), oneDNN makes none.
    whole = row_wise(m, torch.bfloat16)
    overwrite = not whole and m >= OVERWRITE_MIN_ROWS and n * OVERWRITE_MAX_FRACTION <= m
    assert overwrite == (not whole and m >= 1100 and n == 7)
    seen = []
    monkeypatch.setattr(lin, "_big", lambda t: seen.append(t.shape[0]) or Linear._big(lin, t) + 1024)
    with lin.row_invariance.leading(n):
        marked = lin(x)
    assert torch.equal(marked[:n], got[:n])
    if whole:
        assert seen == [] and torch.equal(marked, native.small_gemm(x, lin.small, lin.bias))
        return
    assert seen == [m if overwrite else m - n]
    assert torch.equal(marked[n:], got[n:] + 1024)
