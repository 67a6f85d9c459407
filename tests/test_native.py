"""The native CPU kernels (kvledger/kernels/csrc) against float64 references, plus the
properties the engine relies on: a row's result does not depend on the batch around it, and
everything falls back to torch when the kernels cannot be built.

Kernel tests run once per instruction set this CPU runs (the ``isa`` fixture forces each
through KVLEDGER_NATIVE_ISA): an AVX-512 machine tests its own path and the AVX2 one."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
import torch.nn.functional as F

from kvledger.errors import ConfigError
from kvledger.kernels import native, native_build
from kvledger.storage import kv_quant
from kvledger.storage.kv_cache import KVCachePool, PagedKVCache

needs_native = pytest.mark.skipif(
    native.library() is None, reason="native kernels unavailable here (no C compiler or no AVX2)"
)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (37, 64), (600, 24), (130, 1040)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_gemm_matches_float64(isa, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = native.small_gemm(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * math.sqrt(k), rtol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_rows_are_batch_invariant(isa, dtype):
    """Each output row is the same dot products in the same order whatever M is: a request's
    logits do not change with the number of requests decoding beside it (bf16 sends every
    decode row here, so far past a tile's 6 rows; N = 1000 ends in a partial tile)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 512, generator=g).to(dtype)
    w = native.pack_weight(torch.randn(1000, 512, generator=g).to(dtype))
    full = native.small_gemm(x, w, None)
    for m in (1, 5, 6, 7, 8, 11, 12, 13, 64):
        assert torch.equal(native.small_gemm(x[:m], w, None), full[:m])
    assert torch.equal(native.small_gemm(x[7:8], w, None), full[7:8])
    assert torch.equal(native.small_gemm(x[33:70], w, None), full[33:70])


@needs_native
def test_a_weight_packed_for_one_build_is_refused_by_another(monkeypatch):
    """The blocked layout's tile width follows the build's vector width: a weight packed under
    AVX-512 must not be read by the AVX2 kernels (wrong products, silently) but refused."""
    if not {"avx2", "avx512"} <= set(native_build.cpu_isas()):
        pytest.skip("needs a CPU with both instruction sets")
    w = torch.randn(100, 64)
    monkeypatch.setenv("KVLEDGER_NATIVE_ISA", "avx512")
    native.library.cache_clear()
    packed = native.pack_weight(w)
    monkeypatch.setenv("KVLEDGER_NATIVE_ISA", "avx2")
    native.library.cache_clear()
    try:
        with pytest.raises(ValueError, match="laid out in tiles of 64 outputs, the loaded build.s are 16"):
            native.small_gemm(torch.randn(3, 64), packed, None)
        x = torch.randn(3, 64)
        torch.testing.assert_close(native.small_gemm(x, native.pack_weight(w), None), x @ w.T, atol=1e-4, rtol=1e-4)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_native
def test_avx2_vnni_is_the_avx2_code_with_vnni_dot_products(monkeypatch):
    """avx2-vnni is the build an AVX2 CPU with avx_vnni runs (on an AVX-512 VNNI CPU, its
    stand-in: the same 8-lane code, the EVEX form of the same instructions): avx2's tiles, with
    vpdpbusd's unsigned activations for the int8 products; plain avx2 keeps its own sequences.
    Its kernels' results are checked bit for bit by the tests taking ``int_dot_isa``."""
    if "avx2-vnni" not in native_build.testable_isas():
        pytest.skip("needs a CPU with avx_vnni or avx512_vnni")
    flags = native_build.isa_flags("avx2-vnni")
    assert "-DKVL_AVXVNNI" in flags or {"-DKVL_VW8", "-mavx512vnni"} <= set(flags)
    builds = {}
    try:
        for isa in ["avx2", "avx2-vnni"]:
            monkeypatch.setenv("KVLEDGER_NATIVE_ISA", isa)
            native.library.cache_clear()
            lib = native.library()
            builds[lib.isa] = (lib.int8_vnni, lib.tile_width)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert builds == {"avx2": (False, 16), "avx2-vnni": (True, 16)}


@needs_native
def test_avx512_base_leaves_out_the_optional_instructions(monkeypatch):
    """avx512-base is the build an AVX-512 CPU without avx512_bf16 / avx512_vnni runs: no
    vdpbf16ps GEMM (bf16 weights stay row-major) and no vpdpwssd, whatever this CPU has, so those
    fallbacks run their tests here too (the isa fixture); avx512 has them where the CPU does."""
    isas = native_build.cpu_isas()
    if "avx512" not in isas:
        pytest.skip("needs an AVX-512 CPU")
    assert "avx512-base" in isas
    flags = native_build._cpu_flags().split()
    assert not {"-mavx512bf16", "-mavx512vnni"} & set(native_build.isa_flags("avx512-base"))
    assert ("-mavx512vnni" in native_build.isa_flags("avx512")) == ("avx512_vnni" in flags)
    try:
        for isa, packed in [("avx512-base", False), ("avx512", "avx512_bf16" in flags)]:
            monkeypatch.setenv("KVLEDGER_NATIVE_ISA", isa)
            native.library.cache_clear()
            assert native.library().isa == isa
            assert native.library().bf16_packed == packed
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_native
def test_small_gemm_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="unsupported shape"):
        native.small_gemm(torch.randn(2, 12), torch.randn(4, 12), None)


def _paged(num_blocks, block_size, num_kv_heads, head_dim, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return PagedKVCache(kv), g


def _quantised(fmt, num_blocks, block_size, num_kv_heads, head_dim, seed, dtype=torch.float32):
    """A quantised layer cache filled with random K/V (outlier rows included) through write()."""
    pool = KVCachePool(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype=fmt)
    layer = pool.layers[0]
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    k = torch.randn(n, num_kv_heads, head_dim, generator=g) * torch.rand(n, num_kv_heads, 1, generator=g) * 8
    v = torch.randn(n, num_kv_heads, head_dim, generator=g)
    layer.write(k.to(dtype), v.to(dtype), torch.arange(n))
    return pool, layer, g


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


def _dense(layer):
    """The cache's K and V as float64 [num_blocks, block_size, Hkv, D] (dequantised)."""
    if getattr(layer, "quantized", False):
        all_blocks = torch.arange(layer.k_codes.shape[0])
        k, v = layer.read(all_blocks)  # kv_quant.dequantize, in the model dtype
        k = kv_quant.dequantize(layer.k_codes, layer.k_scales, layer.k_fmt)
        v = kv_quant.dequantize(layer.v_codes, layer.v_scales, layer.v_fmt)
        return k.double(), v.double()
    return layer.k.double(), layer.v.double()


def _reference(q, k, v, tables, lens, rows, scale, subst=None):
    """Float64 attention; subst(b, kc, vc) may replace context rows (the overlay's rule)."""
    num_kv_heads, head_dim = k.shape[2], k.shape[3]
    out = []
    for b, n in enumerate(lens):
        kc = k[tables[b]].flatten(0, 1)[:n].clone()  # [n, K, D]
        vc = v[tables[b]].flatten(0, 1)[:n].clone()
        if subst is not None:
            subst(b, kc, vc)
        qb = q[rows[b]].double().view(num_kv_heads, -1, head_dim)  # [K, G, D]
        p = torch.softmax(qb @ kc.permute(1, 2, 0) * scale, dim=-1)
        out.append((p @ vc.transpose(0, 1)).reshape(-1))
    return torch.stack(out)


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (8, 2, 64, 16),  # specialised G=4, D=64
        (8, 2, 32, 32),  # specialised D=32 (kvledger-tiny's shape), G=4
        (6, 3, 32, 16),  # specialised D=32, G=2
        (4, 4, 128, 4),  # G=1, D=128
        (16, 2, 64, 1),  # G=8, one token per block
        (6, 2, 48, 16),  # generic D=48, G=3 (passes of 2 + 1 heads)
        (6, 2, 24, 4),  # D=24: a partial (masked) vector with AVX-512
        (4, 2, 8, 4),  # D=8, as the tiny HF-oracle models
        (4, 1, 16, 5),  # generic, block size not a power of two
    ],
)
def test_paged_decode_matches_float64_softmax(isa, heads, kv_heads, head_dim, block_size):
    cache, g = _paged(64, block_size, kv_heads, head_dim, seed=heads + head_dim)
    k, v = cache.k, cache.v
    lens = [1, block_size, block_size + 1, 3 * block_size, 57, 9]
    lens = [min(n, 64 * block_size // len(lens)) for n in lens]
    tables = _tables(lens, block_size, 64, g)
    num_tokens = len(lens) + 3  # decode rows scattered among other rows of the step
    rows = torch.tensor([8, 0, 3, 1, 5, 4][: len(lens)], dtype=torch.int64)
    q = torch.randn(num_tokens, heads, head_dim, generator=g)
    out = torch.full((num_tokens, heads * head_dim), float("nan"))
    scale = 1 / math.sqrt(head_dim)
    native.paged_decode(q, cache, tables, torch.tensor(lens), rows, out, scale)
    ref = _reference(q, k.double(), v.double(), tables, lens, rows, scale)
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
@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "fp8_int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_paged_decode_reads_bf16_and_quantised_caches_in_place(int_dot_isa, fmt, dtype, head_dim):
    """bf16 caches and int8/fp8 codes with per-token-head scales: the kernel's output is the
    attention over the dequantised cache (float64 reference), read without a dequantised copy."""
    heads, kv_heads, bs = 8, 2, 16
    if fmt == "bf16":
        if dtype != torch.bfloat16:
            pytest.skip("an unquantised cache is in the model dtype")
        cache, g = _paged(48, bs, kv_heads, head_dim, seed=7, dtype=dtype)
    else:
        _, cache, g = _quantised(fmt, 48, bs, kv_heads, head_dim, seed=7, dtype=dtype)
    assert native.can_paged_decode(cache, heads, dtype)
    k, v = _dense(cache)
    lens = [1, 17, 300, 64, 5]
    tables = _tables(lens, bs, 48, g)
    rows = torch.tensor([2, 0, 4, 1, 3])
    q = (torch.randn(5, heads, head_dim, generator=g) * 2).to(dtype)
    out = torch.zeros(5, heads * head_dim, dtype=dtype)
    native.paged_decode(q, cache, tables, torch.tensor(lens), rows, out, 0.125)
    ref = _reference(q, k, v, tables, lens, rows, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
    torch.testing.assert_close(out[rows].double(), ref, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "fp8_int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 2, 64), (6, 2, 32), (3, 3, 64)])
def test_quantised_v_scales_serve_every_head_group(isa, fmt, heads, kv_heads, head_dim):
    """The V scales are read once per item, by the first score pass, for every head group's V
    pass: query heads per KV head 8 (two passes of 4), 3 (2 + 1) and 1, contexts ending inside a
    block and past the four-token groups."""
    bs = 16
    _, cache, g = _quantised(fmt, 40, bs, kv_heads, head_dim, seed=heads, dtype=torch.bfloat16)
    k, v = _dense(cache)
    lens = [3, 150, 61, 18]
    tables = _tables(lens, bs, 40, g)
    rows = torch.tensor([1, 3, 0, 2])
    q = (torch.randn(4, heads, head_dim, generator=g) * 2).to(torch.bfloat16)
    out = torch.zeros(4, heads * head_dim, dtype=torch.bfloat16)
    native.paged_decode(q, cache, tables, torch.tensor(lens), rows, out, 0.125)
    ref = _reference(q, k, v, tables, lens, rows, 0.125)
    torch.testing.assert_close(out[rows].double(), ref, atol=8e-3, rtol=8e-3)


@needs_native
def test_int8_keys_with_bf16_queries_of_any_magnitude(int_dot_isa):
    """int8 keys against a bf16 query take integer scores (the query rounded per head to int16 with
    a power-of-two step): zero, huge and tiny heads, and token counts that are not a multiple of
    the four tokens scored together, still give the attention over the dequantised cache."""
    heads, kv_heads, d, bs = 8, 2, 64, 16
    _, cache, g = _quantised("int8", 40, bs, kv_heads, d, seed=3, dtype=torch.bfloat16)
    k, v = _dense(cache)
    lens = [7, 33, 130, 1]
    tables = _tables(lens, bs, 40, g)
    rows = torch.arange(4)
    q = torch.randn(4, heads, d, generator=g)
    q[0, 0] = 0.0  # a zero head: uniform attention
    q[0, 1] *= 1e30  # one-hot attention, no overflow
    q[1, 2] *= 1e-30  # scores ~1e-30: uniform
    q[2, 5] *= 1e3
    q = q.to(torch.bfloat16)
    out = torch.zeros(4, heads * d, dtype=torch.bfloat16)
    native.paged_decode(q, cache, tables, torch.tensor(lens), rows, out, 0.125)
    ref = _reference(q, k, v, tables, lens, rows, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=8e-3, rtol=8e-3)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_one_token_context_gives_the_dequantised_value_exactly(isa, fmt):
    """softmax over one key is 1, so the output is that token's V exactly as kv_quant
    dequantises it: every int8 / e4m3 code (e4m3 subnormals included) converts exactly."""
    d = 256
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if fmt == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn has no inf; 0x7f / 0xff are NaN
    else:
        codes = codes.view(torch.int8)[codes.view(torch.int8) != -128]  # int8 codes are +-127
    codes = codes.repeat(3)[: 2 * d].view(2, 1, 1, d)  # every code, in two tokens
    pool = KVCachePool(1, 2, 1, 1, d, torch.float32, kv_cache_dtype=fmt)
    layer = pool.layers[0]
    layer.v_codes.copy_(codes.view(layer.v_codes.dtype))
    layer.v_scales.copy_(torch.tensor([0.5, 3e-3], dtype=torch.float16).view(2, 1, 1))
    layer.k_scales.fill_(1.0)
    out = torch.empty(2, d)
    q = torch.randn(2, 1, d)
    native.paged_decode(q, layer, torch.tensor([[0], [1]]), torch.tensor([1, 1]), torch.arange(2), out, 1.0)
    expected = kv_quant.dequantize(layer.v_codes, layer.v_scales, fmt).view(2, d)
    assert torch.equal(out, expected)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_substitutes_the_full_precision_overlay(isa, dtype):
    """fp_spans: sink positions from the overlay slot, window positions from its ring, the
    query's own position from this step's k/v; everything else from the codes."""
    S, R, bs, kv_heads, head_dim = 2, 4, 8, 2, 64
    pool, layer, g = _quantised("int8", 32, bs, kv_heads, head_dim, seed=11, dtype=dtype)
    pool.sink_tokens, pool.recent_tokens = S, R
    layer.sink_tokens, layer.recent_tokens = S, R
    pool.grow_overlay(3)
    layer.overlay_k.copy_(torch.randn(layer.overlay_k.shape, generator=g).to(dtype))
    layer.overlay_v.copy_(torch.randn(layer.overlay_v.shape, generator=g).to(dtype))
    k, v = _dense(layer)
    lens = [40, 3, 9]
    tables = _tables(lens, bs, 32, g)
    # (slot, sink_lo, sink_hi, win_lo, self): a long context; one still inside its sinks
    # (R = 0 style: own token from k); one whose window starts later (resumed request).
    spans = torch.tensor([[0, 0, 2, 36, 1], [6, 0, 2, 2, 1], [12, 1, 2, 7, 1]])
    k_new = torch.randn(3, kv_heads, head_dim, generator=g).to(dtype)
    v_new = torch.randn(3, kv_heads, head_dim, generator=g).to(dtype)

    def subst(b, kc, vc):
        base, lo, hi, w_lo, own = spans[b].tolist()
        p0 = lens[b] - 1
        for p in range(lo, min(hi, p0)):
            kc[p], vc[p] = layer.overlay_k[base + p].double(), layer.overlay_v[base + p].double()
        for p in range(max(w_lo, hi), p0):
            r = base + S + p % R
            kc[p], vc[p] = layer.overlay_k[r].double(), layer.overlay_v[r].double()
        if own:
            kc[p0], vc[p0] = k_new[b].double(), v_new[b].double()

    q = torch.randn(3, 8, head_dim, generator=g).to(dtype)
    out = torch.zeros(3, 8 * head_dim, dtype=dtype)
    rows = torch.arange(3)
    native.paged_decode(q, layer, tables, torch.tensor(lens), rows, out, 0.125, spans, k_new, v_new)
    ref = _reference(q, k, v, tables, lens, rows, 0.125, subst)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@needs_native
def test_a_large_decode_takes_the_split_threads_with_the_same_result(isa, monkeypatch):
    """An engine core computing with one torch thread still splits a decode attention that reads
    DECODE_SPLIT_BYTES or more over set_split_threads' count, bit for bit the same; a small one
    (or a caller that does not say how many tokens) keeps torch's count."""
    cache, g = _paged(512, 16, 2, 64, seed=5)
    lens = [1000, 1500, 777, 1900]
    tables = _tables(lens, 16, 512, g)
    q = torch.randn(len(lens), 8, 64, generator=g)
    rows, seq_lens = torch.arange(len(lens)), torch.tensor(lens)
    big = sum(lens)
    assert big * 2 * 64 * 2 * 4 >= native.DECODE_SPLIT_BYTES
    lib = native.library()
    seen = []

    class Spy:  # the real kernel, with the thread count it was given recorded
        def __getattr__(self, name):
            fn = getattr(lib, name)
            if name != "kvl_paged_decode":
                return fn
            return lambda *a: seen.append(a[-1]) or fn(*a)

    monkeypatch.setattr(native, "library", lambda: Spy())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = []
        for n, kv_tokens in ((0, big), (3, big), (3, 10), (3, 0)):
            native.set_split_threads(n)
            out = torch.empty(len(lens), 512)
            native.paged_decode(q, cache, tables, seq_lens, rows, out, 0.125, kv_tokens=kv_tokens)
            outs.append(out)
    finally:
        native.set_split_threads(0)
        torch.set_num_threads(threads)
    assert seen == [1, 3, 1, 1]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def _prefill_case(dtype, chunks, heads, kv_heads, head_dim, block_size, seed, num_blocks=96):
    """A cache, block tables and queries for prefill chunks (seq_len, rows): chunk c's rows follow
    one spare row, then each other; returns the paged_prefill arguments and the number of rows."""
    cache, g = _paged(num_blocks, block_size, kv_heads, head_dim, seed=seed, dtype=dtype)
    lens = [seq_len for seq_len, _ in chunks]
    tables = _tables(lens, block_size, num_blocks, g)
    row0 = [1 + sum(n for _, n in chunks[:c]) for c in range(len(chunks))]
    num_tokens = 2 + sum(n for _, n in chunks)
    q = (torch.randn(num_tokens, heads, head_dim, generator=g) * 2).to(dtype)
    args = (q, cache, tables, torch.tensor(lens), torch.tensor(row0), torch.tensor([n for _, n in chunks]))
    return args, num_tokens


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(8, 2, 64, 16), (4, 4, 32, 8), (16, 2, 128, 16), (6, 2, 40, 8), (3, 1, 24, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_matches_float64_causal_attention(isa, heads, kv_heads, head_dim, block_size, dtype):
    """Each row of a chunk attends causally to its context up to its own position, read in place
    from scattered blocks: fresh prompts, chunks after cached context, one-row chunks; query
    heads per KV head 4, 1, 8 (a row wider than AVX2's 8-lane tile), 3 (rows straddling tiles);
    head_dim 40 and 24 leave a partial vector. Rows of other requests are not written."""
    chunks = [(37, 37), (70, 9), (5, 2), (21, 21), (64, 1)]
    (q, cache, tables, seq_lens, row0, nrows), num_tokens = _prefill_case(
        dtype, chunks, heads, kv_heads, head_dim, block_size, seed=heads + head_dim
    )
    out = torch.full((num_tokens, heads * head_dim), float("nan"), dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    native.paged_prefill(q, cache, tables, seq_lens, row0, nrows, out, scale)
    k, v = cache.k.double(), cache.v.double()
    rows, lens, row_tables = [], [], []
    for c, (seq_len, n) in enumerate(chunks):
        for r in range(n):
            rows.append(int(row0[c]) + r)
            lens.append(seq_len - n + r + 1)
            row_tables.append(tables[c])
    ref = _reference(q, k, v, row_tables, lens, rows, scale)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
    torch.testing.assert_close(out[rows].double(), ref, atol=tol, rtol=tol)
    assert out[[0, num_tokens - 1]].isnan().all(), "rows of other requests must not be written"


@needs_native
def test_paged_prefill_reads_a_long_bf16_context_without_its_converted_copy(isa):
    """Past 2^20 floats of converted V rows per thread (9,000 tokens at head_dim 128) the kernel
    converts bf16 V rows per lane group instead of once per tile: same attention."""
    chunks = [(9000, 2), (40, 40)]
    (q, cache, tables, seq_lens, row0, nrows), num_tokens = _prefill_case(
        torch.bfloat16, chunks, 8, 2, 128, 16, seed=4, num_blocks=600
    )
    out = torch.zeros(num_tokens, 8 * 128, dtype=torch.bfloat16)
    native.paged_prefill(q, cache, tables, seq_lens, row0, nrows, out, 0.1)
    rows = [1, 2, *range(3, 43)]
    lens = [8999, 9000, *range(1, 41)]
    row_tables = [tables[0], tables[0], *[tables[1]] * 40]
    ref = _reference(q, cache.k.double(), cache.v.double(), row_tables, lens, rows, 0.1)
    torch.testing.assert_close(out[rows].double(), ref, atol=8e-3, rtol=8e-3)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_rows_do_not_depend_on_their_neighbours(isa, dtype):
    """A row's bits depend on its query and context only: the same prompt prefilled in one
    chunk, in two chunks (its rows fall into other tiles), or beside another request's chunk."""
    heads, kv_heads, head_dim, bs = 6, 2, 64, 8  # 3 heads per KV head: tiles cut rows apart
    (q, cache, tables, _, _, _), num_tokens = _prefill_case(dtype, [(90, 90), (40, 40)], heads, kv_heads, head_dim, bs, 9)
    scale = 0.125

    def run(chunks):  # (first row, rows, seq_len, table)
        out = torch.zeros(num_tokens, heads * head_dim, dtype=dtype)
        native.paged_prefill(
            q, cache, torch.stack([t for *_, t in chunks]), torch.tensor([s for _, _, s, _ in chunks]),
            torch.tensor([r for r, *_ in chunks]), torch.tensor([n for _, n, *_ in chunks]), out, scale,
        )
        return out

    whole = run([(1, 90, 90, tables[0])])
    split = run([(1, 33, 33, tables[0]), (34, 57, 90, tables[0])])
    beside = run([(91, 40, 40, tables[1]), (1, 90, 90, tables[0])])
    assert torch.equal(whole[1:91], split[1:91])
    assert torch.equal(whole[1:91], beside[1:91])


@needs_native
def test_paged_prefill_refuses_what_it_does_not_take():
    (q, cache, tables, seq_lens, row0, nrows), num_tokens = _prefill_case(torch.float32, [(10, 10)], 4, 2, 32, 8, 1)
    out = torch.zeros(num_tokens, 4 * 32)
    with pytest.raises(ValueError, match="paged_prefill"):  # more rows than context
        native.paged_prefill(q, cache, tables, torch.tensor([9]), row0, nrows, out, 0.1)
    with pytest.raises(ValueError, match="paged_prefill"):  # queries in another dtype than the cache
        native.paged_prefill(q.bfloat16(), cache, tables, seq_lens, row0, nrows, out.bfloat16(), 0.1)


@needs_native
@pytest.mark.parametrize("fmt", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_is_batch_invariant(isa, fmt, dtype):
    """A request's attention output is bit-identical alone or among others."""
    if fmt == "auto":
        cache, g = _paged(128, 16, 2, 64, seed=3, dtype=dtype)
    else:
        _, cache, g = _quantised(fmt, 128, 16, 2, 64, seed=3, dtype=dtype)
    lens = [700, 33, 250, 1, 96]
    tables = _tables(lens, 16, 128, g)
    q = torch.randn(len(lens), 8, 64, generator=g).to(dtype)
    rows = torch.arange(len(lens))
    out = torch.empty(len(lens), 512, dtype=dtype)
    native.paged_decode(q, cache, tables, torch.tensor(lens), rows, out, 0.125)
    for b in range(len(lens)):
        one = torch.empty(1, 512, dtype=dtype)
        native.paged_decode(
            q[b : b + 1], cache, tables[b : b + 1].contiguous(), torch.tensor([lens[b]]),
            torch.tensor([0]), one, 0.125,
        )
        assert torch.equal(one[0], out[b])


def test_can_paged_decode_only_for_supported_caches():
    cache = PagedKVCache(torch.zeros(2, 4, 16, 2, 64))
    if native.library() is None:
        assert not native.can_paged_decode(cache, 8, torch.float32)
        return
    assert native.can_paged_decode(cache, 8, torch.float32)
    assert not native.can_paged_decode(cache, 8, torch.bfloat16)  # queries in another dtype
    assert native.can_paged_decode(PagedKVCache(torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)), 8, torch.bfloat16)
    assert not native.can_paged_decode(PagedKVCache(torch.zeros(2, 4, 16, 2, 64, dtype=torch.float16)), 8, torch.float16)
    assert not native.can_paged_decode(PagedKVCache(torch.zeros(2, 4, 16, 2, 12)), 8, torch.float32)  # head_dim
    assert not native.can_paged_decode(cache, 7, torch.float32)  # heads not a multiple of kv heads
    assert not native.can_paged_decode(cache, 64, torch.float32)  # 32 query heads per KV head
    _, quantised, _ = _quantised("fp8_int8", 4, 16, 2, 64, seed=0)
    assert native.can_paged_decode(quantised, 8, torch.float32)


@needs_native
def test_isa_is_chosen_from_the_cpu_and_can_be_forced(monkeypatch, caplog):
    isas = native_build.cpu_isas()
    try:
        monkeypatch.delenv("KVLEDGER_NATIVE_ISA", raising=False)
        assert native_build.selected_isa() == isas[0]  # the best this CPU runs
        monkeypatch.setenv("KVLEDGER_NATIVE_ISA", "torch")
        native.library.cache_clear()
        assert native.library() is None
        monkeypatch.setenv("KVLEDGER_NATIVE_ISA", "avx9000")
        with pytest.raises(ConfigError, match="KVLEDGER_NATIVE_ISA='avx9000'"):
            native_build.selected_isa()
        if "avx512" not in isas:  # an AVX2-only machine asked for AVX-512: its best, and a warning
            monkeypatch.setenv("KVLEDGER_NATIVE_ISA", "avx512")
            with caplog.at_level("WARNING", logger="kvledger"):
                assert native_build.selected_isa() == isas[0]
            assert "lacks it" in caplog.text
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_build_failures_fall_back_to_torch(tmp_path, monkeypatch, caplog):
    with pytest.raises(OSError, match="no C compiler"):
        native_build.build(cc="no-such-compiler-kvledger", out_dir=tmp_path)
    with pytest.raises(subprocess.CalledProcessError):
        native_build.build(cc="false", out_dir=tmp_path)  # a compiler that fails
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind
    try:
        # A failing compiler: a warning, and None (every caller then uses torch's kernels).
        monkeypatch.delenv("KVLEDGER_NATIVE", raising=False)
        monkeypatch.setenv("CC", "false")
        monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path))
        native.library.cache_clear()
        with caplog.at_level("WARNING", logger="kvledger"):
            assert native.library() is None
        if native_build._supported_cpu():  # elsewhere library() gives up before compiling
            assert "native kernels unavailable" in caplog.text
        # Switched off by the user.
        monkeypatch.delenv("CC")
        monkeypatch.setenv("KVLEDGER_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


# A build into an empty cache, reused by the next start and leaving no temporary files, is
# tests/test_first_hour.py's test_the_first_start_says_it_compiles_and_how_long_it_took (one
# compile for both: a compile is the suite's costliest step).


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_in_place_is_bit_identical_to_the_torch_path(isa, rows):
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
def test_rms_norm_matches_hf_composite(isa, shape):
    g = torch.Generator().manual_seed(shape[0])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    got = native.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-6), atol=1e-6, rtol=1e-6)


@needs_native
@pytest.mark.parametrize("rows", [1, 6, 2048])
def test_silu_mul_matches_torch(isa, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96, generator=g) * 6
    gate_up[0, :3] = torch.tensor([-120.0, 0.0, 95.0])  # exp under/overflow of the other sign
    gate, up = gate_up.split(96, dim=-1)
    got = native.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=2e-6)
    ref = (gate.double() / (1 + torch.exp(-gate.double()))) * up.double()
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=2e-6)


@needs_native
@pytest.mark.parametrize("m", [1, 3, 8, 13])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (600, 24), (130, 1040)])
def test_small_gemm_bf16_accumulates_in_float32(isa, m, n, k):
    """bf16 x and W, float32 accumulation, one rounding to bf16 at the end (+ bias in float32)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    got = native.small_gemm(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # one bf16 rounding (2^-9 relative) over a float32 sum
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * math.sqrt(k), rtol=2.0**-8)
    rows = native.small_gemm(x[m - 1 :], w, b)  # a row alone: the same bits
    assert torch.equal(rows[0], got[m - 1])
    # float_out (the LM head's logits): the same bf16 values, written as float32
    as_float = native.small_gemm(x, w, b, float_out=True)
    assert as_float.dtype == torch.float32 and as_float.shape == (m, n)
    assert torch.equal(as_float, got.float())


@needs_native
@pytest.mark.parametrize("rows", [1, 300])
def test_bf16_rope_and_silu_are_bit_identical_to_the_torch_bf16_path(isa, rows):
    """The torch bf16 path rounds each product and sum to bf16; so do the native twins."""
    from kvledger.model.layers import RotaryEmbedding, apply_rotary

    rot = RotaryEmbedding(64, 4096, 10000.0)
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 12 * 64, generator=g).bfloat16()
    positions = torch.randint(0, 4096, (rows,), generator=g)
    cos, sin = rot(positions, torch.bfloat16)
    qk = qkv[:, : 10 * 64].view(rows, 10, 64)
    expected = apply_rotary(qk, cos, sin)
    native.rope_(qkv, 10, 64, positions, rot.cos_cache, rot.sin_cache)
    assert torch.equal(qk, expected)

    gate_up = (torch.randn(rows, 2 * 96, generator=g) * 4).bfloat16()
    gate, up = gate_up.split(96, dim=-1)
    got = native.silu_mul(gate_up)
    ref = F.silu(gate) * up
    # exp is a ~1-ulp polynomial (torch: Sleef): silu may land one bf16 step away, rarely
    close = (got.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7
    assert close.all() and (got == ref).float().mean() > 0.99


@needs_native
@pytest.mark.parametrize("shape", [(1, 64), (600, 256)])
def test_bf16_rms_norm_matches_hf_composite(isa, shape):
    from kvledger.model.layers import RMSNorm

    g = torch.Generator().manual_seed(shape[0])
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=g).bfloat16()
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    xf = x.float()
    hf = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    got = native.rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), hf.float(), atol=0, rtol=2.0**-7)  # last-bit of the sum
    assert (got == hf).float().mean() > 0.98


@needs_native
def test_bf16_request_alone_is_bit_identical_to_the_same_request_in_a_full_batch(isa, stories_path, monkeypatch):
    """bfloat16 end to end (native GEMM, RMSNorm, RoPE, SiLU and paged decode in bf16) with batch
    invariance on (KVLEDGER_BATCH_INVARIANT): every request's tokens and log-probabilities are the
    same bits alone as among 24 (decode steps of more than 16 rows, mixed prefill + decode steps),
    in every build this CPU runs: without it a prompt's prefill rows go where the GEMM dispatch
    sends them (oneDNN, whose bf16 bits change with the row count, on the builds without
    vdpbf16ps). The prefix cache is off: a hit changes how a prompt is chunked (cached context +
    the rest vs one causal chunk), which moves bf16 bits (not float32 tokens) whatever the batch."""
    from test_engine_batching import mixed_workload

    from kvledger import LLM, SamplingParams

    monkeypatch.setenv("KVLEDGER_BATCH_INVARIANT", "1")

    prompts, params = mixed_workload(24, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=sp.max_tokens + 16, ignore_eos=True, logprobs=0) for sp in params]
    llm = LLM(str(stories_path), dtype="bfloat16", calibrate_preemption=False, enable_prefix_caching=False)
    assert llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj.native_small
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    batch = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert [o.cumulative_logprob for o in batch] == [o.cumulative_logprob for o in alone]
    assert llm.ledger().used_blocks == 0


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_copies_rows_to_their_slots_as_index_copy(isa, dtype, monkeypatch):
    """PagedKVCache.write through the native copy: the rows of a fused qkv output (strided views)
    land where index_copy_ puts them; a slot outside the cache raises and writes nothing."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 12, 4, 2, 32, generator=g).to(dtype)
    want, got = PagedKVCache(kv.clone()), PagedKVCache(kv.clone())
    qkv = torch.randn(7, (8 + 2 + 2) * 32, generator=g).to(dtype)
    k = qkv[:, 256:320].view(7, 2, 32)
    v = qkv[:, 320:].view(7, 2, 32)
    slots = torch.tensor([5, 0, 47, 13, 14, 15, 30])
    want._k_slots.index_copy_(0, slots, k)
    want._v_slots.index_copy_(0, slots, v)
    calls = []
    monkeypatch.setattr(native, "write_kv", lambda *a, _f=native.write_kv: calls.append(1) or _f(*a))
    got.write(k, v, slots)
    assert calls and torch.equal(got.kv, want.kv)
    before = got.kv.clone()
    with pytest.raises(ValueError, match="slot outside"):
        got.write(k, v, torch.tensor([1, 2, 3, 4, 5, 6, 48]))
    assert torch.equal(got.kv, before), "nothing written"


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_write_is_bit_identical_to_kv_quant(isa, fmt, dtype):
    """The native write stores exactly kv_quant.quantize's codes and scales (rounding ties,
    e4m3 subnormals, zero rows and outliers included), at the given slots only."""
    g = torch.Generator().manual_seed(len(fmt))
    t, hkv, d = 37, 2, 64
    k = torch.randn(t, hkv, d, generator=g) * torch.logspace(-6, 3, t)[:, None, None]
    k[3] = 0.0  # absmax 0: the smallest scale, codes 0
    k[4, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, 1e-9, -3e-3, 448.0, 127.0])
    v = torch.randn(t, hkv, d, generator=g) * 3
    qkv = torch.cat([k, v], dim=1).to(dtype)  # strided views, as inside a fused qkv output
    k, v = qkv[:, :hkv], qkv[:, hkv:]
    pool = KVCachePool(1, 8, 8, hkv, d, dtype, kv_cache_dtype=fmt)
    layer = pool.layers[0]
    slots = torch.randperm(64, generator=g)[:t]
    native.quantize_write(layer, k, v, slots)
    k_fmt, v_fmt = kv_quant.KV_FORMATS[fmt]
    for x, f, codes, scales in ((k, k_fmt, layer.k_codes, layer.k_scales), (v, v_fmt, layer.v_codes, layer.v_scales)):
        c, s = kv_quant.quantize(x, f)
        assert torch.equal(codes.view(64, hkv, d)[slots], c)
        assert torch.equal(scales.view(64, hkv)[slots], s)
        others = torch.ones(64, dtype=torch.bool)
        others[slots] = False
        assert not codes.view(64, hkv, d)[others].any(), "other slots untouched"


@needs_native
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (1, 15), (3, 17), (7, 1000), (56, 32000), (2, 151_936)])
def test_argmax_rows_equals_torch_argmax(isa, rows, n):
    """Greedy sampling's argmax: the same index as torch on random rows, on rows of ties (the
    first wins), of -inf only, of +-0.0, with NaN (torch's first NaN) and +inf, at every width
    (vector body and tail), on a row-strided view and over one and two threads."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, n, generator=g)
    special = torch.randint(0, 4, (rows, n), generator=g).float()  # small integers: many ties
    signed_zeros = torch.where(special > 1, torch.tensor(0.0), torch.tensor(-0.0))  # equal: the first wins
    cases = [x, special, torch.full((rows, n), float("-inf")), signed_zeros, torch.zeros(rows, n)]
    nan, inf = special.clone(), special.clone()
    for r in range(rows):
        j = int(torch.randint(0, n, (1,), generator=g))
        nan[r, j], inf[r, n - 1 - j] = float("nan"), float("inf")
        if n > 2:
            nan[r, (j * 5 + 1) % n] = float("inf")
    cases += [nan, inf, torch.cat([x, x], dim=1)[:, :n]]  # the last: rows strided by 2n
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for c in cases:
                assert c.stride(1) == 1
                assert torch.equal(native.argmax_rows(c), c.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_argmax_rows_declines_what_it_does_not_take():
    """The sampler falls back to torch for these: no kernel call on them."""
    assert native.argmax_rows(torch.randn(3, 8, dtype=torch.float64)) is None
    assert native.argmax_rows(torch.randn(8, 3).T) is None  # columns not contiguous
    assert native.argmax_rows(torch.randn(8)) is None
    assert native.argmax_rows(torch.randn(1, 8).expand(3, 8)) is None  # rows overlap


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_writes_into_rows_of_a_given_output(isa, dtype):
    """out=: the product lands in the given rows of a larger tensor, the other rows untouched,
    with the same bits as a fresh result; a wrong shape, dtype or layout is refused."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 64).to(dtype), torch.randn(24, 64).to(dtype)
    packed = native.pack_weight(w)
    big = torch.full((9, 24), 7.0, dtype=dtype)
    got = native.small_gemm(x, packed, None, out=big[2:7])
    assert got.data_ptr() == big[2:7].data_ptr()
    assert torch.equal(big[2:7], native.small_gemm(x, packed, None))
    assert bool((big[:2] == 7).all()) and bool((big[7:] == 7).all())
    for bad in (torch.empty(5, 23, dtype=dtype), torch.empty(24, 5, dtype=dtype).T,
                torch.empty(5, 24, dtype=torch.float16)):
        with pytest.raises(ValueError, match="out"):
            native.small_gemm(x, packed, None, out=bad)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_has_the_same_bits_on_every_lane_count(dtype, monkeypatch):
    """silu_mul runs 16 lanes at a time on AVX-512 and finishes a row 8 at a time; the AVX2
    build runs 8 throughout. Widths with and without an 8-lane tail give identical bits on every
    instruction set this CPU runs, and match torch."""
    results = {}
    for isa in native_build.cpu_isas():
        monkeypatch.setenv("KVLEDGER_NATIVE_ISA", isa)
        native.library.cache_clear()
        for inter in (8, 96, 104, 1800):
            gate_up = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 5).to(dtype)
            got = native.silu_mul(gate_up)
            results.setdefault(inter, []).append(got)
            gate, up = gate_up.float().split(inter, dim=-1)
            torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=1e-2, rtol=2.0**-7)
    monkeypatch.undo()
    native.library.cache_clear()
    for inter, outs in results.items():
        for other in outs[1:]:
            assert torch.equal(other, outs[0]), inter
