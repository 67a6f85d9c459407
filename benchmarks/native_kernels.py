"""kvledger's native CPU kernels against the torch ops they replace, one shape at a time.

Shapes are bench-60m's (hidden 512, 8 q / 2 KV heads of 64, MLP 1792, vocab 32000, float32).
Each line prints both times and the ratio. Weights and KV contexts are cycled through more
copies than the L3 cache holds, as in a real decode step, where every weight comes from memory.

    python -m benchmarks.native_kernels [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.common import print_header
from kvledger.model import host_memory, native
from kvledger.model.layers import apply_rotary

L3_BYTES = 96 << 20  # cycle through at least this much data per measurement


def timeit(fn, reps: int) -> float:
    for i in range(3):
        fn(i)
    t = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - t) / reps * 1e3


def row(name: str, ours: float, peer: float, peer_name: str) -> None:
    print(f"{name:34s} native {ours:8.3f} ms   {peer_name} {peer:8.3f} ms   speed-up {peer / ours:5.2f}x")


def gemms() -> None:
    print("== few-row GEMM: native.small_gemm (huge-page weight) vs oneDNN packed (Linear.pack)")
    for n, k, name in [(768, 512, "qkv"), (512, 512, "o"), (3584, 512, "gate_up"), (512, 1792, "down"), (32000, 512, "lm_head")]:
        _gemm_case(n, k, name)


def _gemm_case(n: int, k: int, name: str) -> None:
    copies = max(2, L3_BYTES // (n * k * 4))
    plain = [torch.randn(n, k) for _ in range(copies)]
    huge = [host_memory.copy_of(w) for w in plain]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in plain]
    for m in (1, 6, 16):
        x = torch.randn(m, k)
        ours = timeit(lambda i, x=x: native.small_gemm(x, huge[i % copies], None), 40)
        peer = timeit(
            lambda i, x=x: torch.ops.mkldnn._linear_pointwise(x, packed[i % copies], None, "none", [], ""), 40
        )
        row(f"{name} [{n}x{k}] M={m}", ours, peer, "oneDNN")


def paged_decode() -> None:
    print("== decode attention: native.paged_decode (blocks in place) vs gather + SDPA (torch path)")
    for batch, lo, hi in [(6, 300, 768), (64, 40, 300)]:
        _decode_case(batch, lo, hi)


def _decode_case(batch: int, lo: int, hi: int) -> None:
    heads, kv_heads, d, bs = 8, 2, 64, 16
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(lo, hi, (batch,), generator=g)
    per_copy = int(lens.sum()) * kv_heads * d * 4 * 2
    copies = max(2, L3_BYTES // per_copy)
    nblocks = copies * int(sum(-(-n // bs) for n in lens.tolist())) + 8
    kv = host_memory.zeros((2, nblocks, bs, kv_heads, d), torch.float32)
    kv.normal_(generator=g)
    k, v = kv[0], kv[1]
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
    q = torch.randn(batch, heads, d, generator=g)
    rows = torch.arange(batch)
    out = torch.empty(batch, heads * d)
    valid = torch.arange(max_blocks * bs)[None, :] < lens[:, None]
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    scale = 1 / math.sqrt(d)

    def ours(i):
        native.paged_decode(q, k, v, tables[i % copies], lens, rows, out, scale)

    def peer(i):
        t = tables[i % copies].reshape(-1)
        kc = k.index_select(0, t).view(batch, -1, kv_heads, d).transpose(1, 2)
        vc = v.index_select(0, t).view(batch, -1, kv_heads, d).transpose(1, 2)
        qd = q.view(batch, kv_heads, heads // kv_heads, d)
        return F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale)

    row(f"{batch} requests, {lo}-{hi} tokens", timeit(ours, 30), timeit(peer, 30), "torch ")


def elementwise() -> None:
    print("== row-wise ops: native vs the torch expressions they replace")
    for m in (6, 2048):
        _elementwise_case(m)


def _elementwise_case(m: int) -> None:
    from kvledger.model.layers import RotaryEmbedding

    rot = RotaryEmbedding(64, 4096, 10000.0)
    w = torch.randn(512)
    x = torch.randn(m, 512)
    row(
        f"rms_norm [{m}x512]",
        timeit(lambda i: native.rms_norm(x, w, 1e-5), 200),
        timeit(lambda i: F.rms_norm(x, (512,), w, 1e-5), 200),
        "torch ",
    )
    gu = torch.randn(m, 2 * 1792)
    row(
        f"silu(gate)*up [{m}x1792]",
        timeit(lambda i: native.silu_mul(gu), 100),
        timeit(lambda i: F.silu(gu[:, :1792]) * gu[:, 1792:], 100),
        "torch ",
    )
    qkv = torch.randn(m, 12 * 64)
    pos = torch.randint(0, 4096, (m,))

    def peer(i):
        cos, sin = rot(pos, torch.float32)
        return apply_rotary(qkv[:, : 10 * 64].view(m, 10, 64), cos, sin)

    row(
        f"rope q+k [{m}x10x64]",
        timeit(lambda i: native.rope_(qkv, 10, 64, pos, rot.cos_cache, rot.sin_cache), 200),
        timeit(peer, 200),
        "torch ",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print_header("kvledger native kernels vs the torch ops they replace")
    if native.library() is None:
        raise SystemExit("native kernels unavailable here (no C compiler, no AVX2, or KVLEDGER_NATIVE=0)")
    with torch.inference_mode():
        gemms()
        paged_decode()
        elementwise()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
