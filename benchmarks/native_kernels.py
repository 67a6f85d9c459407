"""kvledger's native CPU kernels against the torch ops they replace, one shape at a time.

Shapes are bench-60m's (hidden 512, 8 q / 2 KV heads of 64, MLP 1792, vocab 32000), in the
model dtype --dtype. Each line prints both times and the ratio. Weights and KV contexts are
cycled through more copies than the L3 cache holds, as in a real decode step, where every
weight comes from memory. The last section compares the native decode over each KV format
(bf16 cache vs int8 / fp8 codes with per-token scales) at 1,000-token contexts, in one run, the
formats' calls interleaved for their ratios.
The instruction set is the best this CPU runs, or KVLEDGER_NATIVE_ISA (avx512 / avx512-base / avx2).

    python -m benchmarks.native_kernels [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_ms, print_header
from kvledger.kernels import native
from kvledger.model.layers import apply_rotary
from kvledger.storage import host_memory
from kvledger.storage.kv_cache import KVCachePool, PagedKVCache

L3_BYTES = 96 << 20  # cycle through at least this much data per measurement


def timeit(fn, reps: int) -> float:
    """Median milliseconds per call of fn(i) (common.interleaved_ms)."""
    return interleaved_ms({"": fn}, reps)[""]


def row(name: str, ours: float, peer: float, peer_name: str) -> None:
    print(f"{name:34s} native {ours:8.3f} ms   {peer_name} {peer:8.3f} ms   speed-up {peer / ours:5.2f}x")


def gemms(dtype: torch.dtype) -> None:
    print(f"== few-row GEMM ({dtype}): native.small_gemm (its layout, huge pages) vs oneDNN packed (Linear.pack)")
    for n, k, name in [(768, 512, "qkv"), (512, 512, "o"), (3584, 512, "gate_up"), (512, 1792, "down"), (32000, 512, "lm_head")]:
        _gemm_case(n, k, name, dtype)


def _gemm_case(n: int, k: int, name: str, dtype: torch.dtype) -> None:
    copies = max(2, L3_BYTES // (n * k * dtype.itemsize))
    plain = [torch.randn(n, k).to(dtype) for _ in range(copies)]
    huge = [native.pack_weight(w, alloc=host_memory.zeros) for w in plain]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in plain]
    for m in (1, 6, 8, 16, 32, 64):
        x = torch.randn(m, k).to(dtype)
        ours = timeit(lambda i, x=x: native.small_gemm(x, huge[i % copies], None), 40)
        peer = timeit(
            lambda i, x=x: torch.ops.mkldnn._linear_pointwise(x, packed[i % copies], None, "none", [], ""), 40
        )
        row(f"{name} [{n}x{k}] M={m}", ours, peer, "oneDNN")


def paged_decode(dtype: torch.dtype) -> None:
    fmt = "auto"
    print(f"== decode attention ({dtype} cache): native.paged_decode (blocks in place) vs gather + SDPA (torch path)")
    for batch, lo, hi in [(6, 300, 768), (64, 40, 300)]:
        _decode_case(batch, lo, hi, dtype, fmt)
    print(f"== decode attention by KV format ({dtype} queries), 1,000-token contexts")
    fmts = ("auto", "int8", "fp8", "fp8_int8")
    for batch in (16, 64):
        calls = {fmt: _decode_case(batch, 1000, 1001, dtype, fmt) for fmt in fmts}
        # The formats' ratios from calls interleaved one by one, so that a slower spell of this
        # shared host falls on every format alike (the medians above are timed one case after
        # another, minutes apart by the last format).
        times = interleaved_ms(calls, 60)
        for fmt in fmts[1:]:
            print(
                f"{fmt} vs {dtype} KV, {batch} x 1,000 tokens (interleaved): native {times[fmt]:.3f} vs "
                f"{times['auto']:.3f} ms = {times['auto'] / times[fmt]:.2f}x faster"
            )


def _layer_cache(fmt: str, nblocks: int, bs: int, kv_heads: int, d: int, dtype: torch.dtype, g):
    if fmt == "auto":
        kv = host_memory.zeros((2, nblocks, bs, kv_heads, d), dtype)
        kv.copy_(torch.randn(kv.shape, generator=g))
        return PagedKVCache(kv)
    layer = KVCachePool(1, nblocks, bs, kv_heads, d, dtype, kv_cache_dtype=fmt).layers[0]
    for s0 in range(0, nblocks * bs, 1 << 16):
        n = min(1 << 16, nblocks * bs - s0)
        k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        layer.write(k, torch.randn(n, kv_heads, d, generator=g).to(dtype), torch.arange(s0, s0 + n))
    return layer


def _decode_case(batch: int, lo: int, hi: int, dtype: torch.dtype, fmt: str):
    """Time the native decode and the torch path on one case; return the native call."""
    heads, kv_heads, d, bs = 8, 2, 64, 16
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(lo, hi, (batch,), generator=g)
    per_copy = int(lens.sum()) * kv_heads * d * 2 * (dtype.itemsize if fmt == "auto" else 1)
    copies = max(2, L3_BYTES // per_copy)
    nblocks = copies * int(sum(-(-n // bs) for n in lens.tolist())) + 8
    cache = _layer_cache(fmt, nblocks, bs, kv_heads, d, dtype, g)
    max_blocks = -(-int(lens.max()) // bs)
    perm = torch.randperm(nblocks, generator=g)
    tables = []
    for c in range(copies):
        t = torch.zeros(batch, max_blocks, dtype=torch.int64)
        pos = c * (nblocks // copies)
        for b, n in enumerate(lens.tolist()):
            nb = -(-n // bs)
            t[b, :nb] = perm[pos : pos + nb]
            pos += nb
        tables.append(t)
    q = torch.randn(batch, heads, d, generator=g).to(dtype)
    rows = torch.arange(batch)
    out = torch.empty(batch, heads * d, dtype=dtype)
    valid = torch.arange(max_blocks * bs)[None, :] < lens[:, None]
    mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    scale = 1 / math.sqrt(d)

    def ours(i):
        native.paged_decode(q, cache, tables[i % copies], lens, rows, out, scale)

    def peer(i):
        kc, vc = cache.read(tables[i % copies])  # dequantised copies for int8 / fp8
        kc = kc.flatten(1, 2).transpose(1, 2)
        vc = vc.flatten(1, 2).transpose(1, 2)
        qd = q.view(batch, kv_heads, heads // kv_heads, d)
        return F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale)

    t_ours = timeit(ours, 30)
    kind = "" if fmt == "auto" else f" {fmt} KV,"
    row(f"{batch} requests,{kind} {lo}-{hi} tokens", t_ours, timeit(peer, 10), "torch ")
    return ours


def elementwise(dtype: torch.dtype) -> None:
    print(f"== row-wise ops ({dtype}): native vs the torch expressions they replace")
    for m in (6, 2048):
        _elementwise_case(m, dtype)


def _elementwise_case(m: int, dtype: torch.dtype) -> None:
    from kvledger.model.layers import RMSNorm, RotaryEmbedding

    rot = RotaryEmbedding(64, 4096, 10000.0)
    norm = RMSNorm(512, 1e-5)
    norm.weight.data = torch.randn(512).to(dtype)
    w = norm.weight
    x = torch.randn(m, 512).to(dtype)

    def torch_norm(i):
        if dtype == torch.float32:
            return F.rms_norm(x, (512,), w, 1e-5)
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    row(
        f"rms_norm [{m}x512]",
        timeit(lambda i: native.rms_norm(x, w, 1e-5), 200),
        timeit(torch_norm, 200),
        "torch ",
    )
    gu = torch.randn(m, 2 * 1792).to(dtype)
    row(
        f"silu(gate)*up [{m}x1792]",
        timeit(lambda i: native.silu_mul(gu), 100),
        timeit(lambda i: F.silu(gu[:, :1792]) * gu[:, 1792:], 100),
        "torch ",
    )
    qkv = torch.randn(m, 12 * 64).to(dtype)
    pos = torch.randint(0, 4096, (m,))

    def peer(i):
        cos, sin = rot(pos, dtype)
        return apply_rotary(qkv[:, : 10 * 64].view(m, 10, 64), cos, sin)

    row(
        f"rope q+k [{m}x10x64]",
        timeit(lambda i: native.rope_(qkv, 10, 64, pos, rot.cos_cache, rot.sin_cache), 200),
        timeit(peer, 200),
        "torch ",
    )
    rows = min(m, 64)  # greedy sampling: one float32 logits row per decoding request
    logits = torch.randn(rows, 32000)
    row(
        f"argmax [{rows}x32000]",
        timeit(lambda i: native.argmax_rows(logits), 200),
        timeit(lambda i: logits.argmax(dim=-1), 200),
        "torch ",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--only", choices=["gemm", "decode", "elementwise"], help="one section")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    print_header("kvledger native kernels vs the torch ops they replace")
    if native.library() is None:
        raise SystemExit("native kernels unavailable here (no C compiler, no AVX2, or KVLEDGER_NATIVE=0)")
    print(f"native  : {native.library().isa} ({native.library().vector_width} float lanes), {a.dtype}")
    with torch.inference_mode():
        if a.only in (None, "gemm"):
            gemms(dtype)
        if a.only in (None, "decode"):
            paged_decode(dtype)
        if a.only in (None, "elementwise"):
            elementwise(dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
