"""The native CPU kernels (kvledger/model/csrc) against float64 references, plus the
properties the engine relies on: a row's result does not depend on the batch around it, and
everything falls back to torch when the kernels cannot be built."""

from __future__ import annotations

import math
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from kvledger.model import native

needs_native = pytest.mark.skipif(
    native.library() is None, reason="native kernels unavailable here (no C compiler or no AVX2)"
)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (37, 64), (600, 24), (130, 1040)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_gemm_matches_float64(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = native.small_gemm(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * math.sqrt(k), rtol=1e-5)


@needs_native
def test_small_gemm_rows_are_batch_invariant():
    """Each output row is the same dot products in the same order whatever M is: a request's
    logits do not change with the number of requests decoding beside it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 512, generator=g), torch.randn(1000, 512, generator=g)
    full = native.small_gemm(x, w, None)
    for m in (1, 5, 8, 11):
        assert torch.equal(native.small_gemm(x[:m], w, None), full[:m])
    assert torch.equal(native.small_gemm(x[7:8], w, None), full[7:8])


@needs_native
def test_small_gemm_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="unsupported shape"):
        native.small_gemm(torch.randn(2, 12), torch.randn(4, 12), None)


def _paged(num_blocks, block_size, num_kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    return kv[0], kv[1], g


def _tables(lens, block_size, num_blocks, g):
    """Block tables drawn from a shuffled pool (non-contiguous), padded with 0."""
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int64)
    pos = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[pos : pos + nb]
        pos += nb
    return tables


def _reference(q, k, v, tables, lens, rows, scale):
    num_kv_heads, head_dim = k.shape[2], k.shape[3]
    out = []
    for b, n in enumerate(lens):
        kc = k[tables[b]].flatten(0, 1)[:n].transpose(0, 1).double()  # [K, n, D]
        vc = v[tables[b]].flatten(0, 1)[:n].transpose(0, 1).double()
        qb = q[rows[b]].double().view(num_kv_heads, -1, head_dim)  # [K, G, D]
        p = torch.softmax(qb @ kc.transpose(1, 2) * scale, dim=-1)
        out.append((p @ vc).reshape(-1))
    return torch.stack(out)


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (8, 2, 64, 16),  # specialised G=4, D=64
        (4, 4, 128, 4),  # G=1, D=128
        (16, 2, 64, 1),  # G=8, one token per block
        (6, 2, 24, 16),  # generic G=3, D=24
        (4, 1, 16, 5),  # generic, block size not a power of two
    ],
)
def test_paged_decode_matches_float64_softmax(heads, kv_heads, head_dim, block_size):
    k, v, g = _paged(64, block_size, kv_heads, head_dim, seed=heads + head_dim)
    lens = [1, block_size, block_size + 1, 3 * block_size, 57, 9]
    lens = [min(n, 64 * block_size // len(lens)) for n in lens]
    tables = _tables(lens, block_size, 64, g)
    num_tokens = len(lens) + 3  # decode rows scattered among other rows of the step
    rows = torch.tensor([8, 0, 3, 1, 5, 4][: len(lens)], dtype=torch.int64)
    q = torch.randn(num_tokens, heads, head_dim, generator=g)
    out = torch.full((num_tokens, heads * head_dim), float("nan"))
    scale = 1 / math.sqrt(head_dim)
    native.paged_decode(q, k, v, tables, torch.tensor(lens), rows, out, scale)
    ref = _reference(q, k, v, tables, lens, rows, scale)
    torch.testing.assert_close(out[rows].double(), ref, atol=2e-6, rtol=1e-5)
    untouched = sorted(set(range(num_tokens)) - set(rows.tolist()))
    assert out[untouched].isnan().all(), "rows of other requests must not be written"
    # Against torch's own SDPA as well (what the fallback path computes).
    for b, n in enumerate(lens):
        kc = k[tables[b]].flatten(0, 1)[:n].transpose(0, 1)[None]
        vc = v[tables[b]].flatten(0, 1)[:n].transpose(0, 1)[None]
        qb = q[rows[b]].view(1, kv_heads, -1, head_dim)
        sdpa = F.scaled_dot_product_attention(qb, kc, vc, scale=scale).reshape(-1)
        torch.testing.assert_close(out[rows[b]], sdpa, atol=2e-6, rtol=1e-5)


@needs_native
def test_paged_decode_is_batch_invariant():
    """A request's attention output is bit-identical alone or among others."""
    k, v, g = _paged(128, 16, 2, 64, seed=3)
    lens = [700, 33, 250, 1, 96]
    tables = _tables(lens, 16, 128, g)
    q = torch.randn(len(lens), 8, 64, generator=g)
    rows = torch.arange(len(lens))
    out = torch.empty(len(lens), 512)
    native.paged_decode(q, k, v, tables, torch.tensor(lens), rows, out, 0.125)
    for b in range(len(lens)):
        one = torch.empty(1, 512)
        native.paged_decode(
            q[b : b + 1], k, v, tables[b : b + 1].contiguous(), torch.tensor([lens[b]]),
            torch.tensor([0]), one, 0.125,
        )
        assert torch.equal(one[0], out[b])


def test_can_paged_decode_only_for_supported_caches():
    k = torch.zeros(4, 16, 2, 64)
    if native.library() is None:
        assert not native.can_paged_decode(k, 8)
        return
    assert native.can_paged_decode(k, 8)
    assert not native.can_paged_decode(k.to(torch.bfloat16), 8)
    assert not native.can_paged_decode(torch.zeros(4, 16, 2, 12), 8)  # head_dim % 8
    assert not native.can_paged_decode(k, 7)  # heads not a multiple of kv heads
    assert not native.can_paged_decode(k, 64)  # 32 query heads per KV head


def test_build_failures_fall_back_to_torch(tmp_path, monkeypatch, caplog):
    with pytest.raises(OSError, match="no C compiler"):
        native.build(cc="no-such-compiler-kvledger", out_dir=tmp_path)
    with pytest.raises(subprocess.CalledProcessError):
        native.build(cc="false", out_dir=tmp_path)  # a compiler that fails
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind
    try:
        # A failing compiler: a warning, and None (every caller then uses torch's kernels).
        monkeypatch.delenv("KVLEDGER_NATIVE", raising=False)
        monkeypatch.setenv("CC", "false")
        monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path))
        native.library.cache_clear()
        with caplog.at_level("WARNING", logger="kvledger"):
            assert native.library() is None
        if native._supported_cpu():  # elsewhere library() gives up before compiling
            assert "native kernels unavailable" in caplog.text
        # Switched off by the user.
        monkeypatch.delenv("CC")
        monkeypatch.setenv("KVLEDGER_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_native
def test_build_is_cached_per_source(tmp_path):
    first = native.build(out_dir=tmp_path)
    mtime = os.stat(first).st_mtime_ns
    assert native.build(out_dir=tmp_path) == first and os.stat(first).st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_in_place_is_bit_identical_to_the_torch_path(rows):
    """In place inside a fused qkv row (strided), q and k heads rotated, v untouched."""
    from kvledger.model.layers import RotaryEmbedding, apply_rotary

    rot = RotaryEmbedding(64, 4096, 10000.0)
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads = 8, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * 64, generator=g)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    cos, sin = rot(positions, torch.float32)
    qk = qkv[:, : (heads + kv_heads) * 64].view(rows, heads + kv_heads, 64)
    expected = apply_rotary(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * 64 :].clone()
    native.rope_(qkv, heads + kv_heads, 64, positions, rot.cos_cache, rot.sin_cache)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64 :], v_before)


@needs_native
@pytest.mark.parametrize("shape", [(1, 64), (7, 512), (3, 4, 16), (600, 256)])
def test_rms_norm_matches_hf_composite(shape):
    g = torch.Generator().manual_seed(shape[0])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    got = native.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-6), atol=1e-6, rtol=1e-6)


@needs_native
@pytest.mark.parametrize("rows", [1, 6, 2048])
def test_silu_mul_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96, generator=g) * 6
    gate_up[0, :3] = torch.tensor([-120.0, 0.0, 95.0])  # exp under/overflow of the other sign
    gate, up = gate_up.split(96, dim=-1)
    got = native.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=2e-6)
    ref = (gate.double() / (1 + torch.exp(-gate.double()))) * up.double()
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=2e-6)
