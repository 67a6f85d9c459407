"""The price of indirection: paged vs contiguous decode attention on kvledger's own kernels.

Seed 2, section 四: "PagedAttention's block-table indirection makes attention 5-10% slower than
contiguous allocation, but the higher utilisation still wins in throughput", and "for
single-request low-latency serving, contiguous allocation + MQA may be the better choice".

For each decode path, three variants over the same K/V bytes (one layer, 8 query / 2 KV heads of
128, float32: a Llama-3-8B layer at tp 4), all with the same loops:

- paged: the engine's kernel over blocks scattered at random through the pool (a long-running
  server's free list), reading block_tables[b, blk] for every block;
- paged, contiguous layout: the same kernel and table, but each request's blocks consecutive
  (the table is the identity run); isolates the cost of scattered memory from that of the lookup;
- contiguous: the contiguous reference (kvledger/model/attention/contiguous.py), which reads no
  table: native = csrc/paged_decode.c compiled with the block address first + blk; torch = the
  same SDPA over a view of the buffer instead of PagedKVCache.read's gathered copy.

Block sizes 1, 16, 32, 128; contexts 256-8192; batch 1 and 64; variants interleaved, best of
--reps. Then end-to-end single-request decode latency through the real engine (a random-weight
Llama, 4 layers, head_dim 64, 1 thread): the engine's own allocation (a fresh pool hands a lone
request consecutive blocks), a scattered free list, and the contiguous kernel swapped in.

    python -m benchmarks.seed_paging --quick
    python -m benchmarks.seed_paging
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import print_header
from kvledger.kernels import native
from kvledger.model.attention import contiguous as C
from kvledger.model.attention.torch_backend import _MAX_GROUP_BYTES
from kvledger.storage import host_memory
from kvledger.storage.kv_cache import PagedKVCache

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
BLOCK_SIZES = (1, 16, 32, 128)
VARIANTS = ("paged", "paged_contig_layout", "contiguous")
STAT_P10 = "ms per decode step, 10th percentile over the interleaved rounds"
STAT_OLD = "ms per output token after the first, best of the interleaved rounds"
FLUSH_BYTES = 96 << 20  # written between timed calls: > this EPYC's 32 MiB L3 per CCD


def _timeit(fns: dict, reps: int, flush: torch.Tensor) -> dict[str, float]:
    """Best-of-reps seconds per call of each fn, interleaved round-robin (fair under load), each
    call after writing ``flush`` (larger than the last-level cache, untimed) so that no variant
    finds the K/V that the previous one left in cache: in a model, the other layers' KV and
    the weights pass through the cache between two decode calls of one layer."""
    best = {k: float("inf") for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(reps):
        for k, f in fns.items():
            flush.add_(1.0)
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _native_variants(q, kv, scattered, runs, lens, scale) -> dict:
    kc, vc = kv[0], kv[1]
    cache = PagedKVCache(kv)
    rows = torch.arange(q.shape[0], dtype=torch.int64)
    out = torch.empty(q.shape[0], HEADS * HEAD_DIM)
    return {
        "paged": lambda: native.paged_decode(q, cache, scattered, lens, rows, out, scale),
        "paged_contig_layout": lambda: native.paged_decode(q, cache, runs, lens, rows, out, scale),
        "contiguous": lambda: C.contig_decode(q, kc, vc, runs, lens, rows, out, scale, check=False),
    }


def _torch_variants(q, kv, scattered, runs, lens, scale) -> dict:
    batch, mb = runs.shape
    bs = kv.shape[2]
    cache = PagedKVCache(kv)
    kbuf = cache.k[: batch * mb].view(batch, mb * bs, KV_HEADS, HEAD_DIM)
    vbuf = cache.v[: batch * mb].view(batch, mb * bs, KV_HEADS, HEAD_DIM)
    # the backend's decode groups: as many requests as fit _MAX_GROUP_BYTES of gathered K + V
    per = max(1, min(batch, _MAX_GROUP_BYTES // (mb * bs * KV_HEADS * HEAD_DIM * 4 * 2)))
    groups = [slice(i, min(batch, i + per)) for i in range(0, batch, per)]

    def paged(tables):
        for s in groups:
            C.paged_decode_torch(q[s], cache, tables[s], lens[s], scale)

    def contig():
        for s in groups:
            C.contiguous_decode_torch(q[s], kbuf[s], vbuf[s], lens[s], scale)

    return {
        "paged": lambda: paged(scattered),
        "paged_contig_layout": lambda: paged(runs),
        "contiguous": contig,
    }


def kernel_sweep(
    contexts: list[int], batches: list[int], reps: int, paths: tuple[str, ...]
) -> list[dict]:
    """Paged / paged-contiguous-layout / contiguous times for every (path, batch, context, bs)."""
    max_tokens = max(b * c for b in batches for c in contexts)
    g = torch.Generator().manual_seed(0)
    # One pool's K and V, viewed as [2, blocks, bs, KV heads, head_dim] for each block size, in
    # memory from the engine's own pool allocator (2 MiB pages where the kernel allows: on 4 KiB
    # pages scattered blocks also pay a TLB miss each, which the engine's pool does not).
    kv_flat = host_memory.zeros((2, max_tokens * KV_HEADS * HEAD_DIM), torch.float32)
    kv_flat.normal_(generator=g)
    flush = torch.zeros(FLUSH_BYTES // 4)
    scale = HEAD_DIM**-0.5
    rng = random.Random(0)
    makers = {"native": _native_variants, "torch": _torch_variants}
    if native.library() is None:
        makers.pop("native")
    out_rows = []
    for batch in batches:
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
        lens = torch.full((batch,), 0, dtype=torch.int64)
        for ctx in contexts:
            lens.fill_(ctx)
            for bs in BLOCK_SIZES:
                nblocks = max_tokens // bs
                kv = kv_flat.view(2, nblocks, bs, KV_HEADS, HEAD_DIM)
                mb = -(-ctx // bs)
                picked = rng.sample(range(nblocks), batch * mb)
                scattered = torch.tensor(picked, dtype=torch.int64).view(batch, mb)
                runs = torch.arange(batch * mb, dtype=torch.int64).view(batch, mb)
                for path in paths:
                    if path not in makers:
                        continue
                    t = _timeit(makers[path](q, kv, scattered, runs, lens, scale), reps, flush)
                    r = {"path": path, "batch": batch, "context": ctx, "block_size": bs, **t}
                    r["ratio"] = r["paged"] / r["contiguous"]
                    r["ratio_layout"] = r["paged_contig_layout"] / r["contiguous"]
                    out_rows.append(r)
                    print(
                        f"  {path:<6} batch {batch:>2} ctx {ctx:>5} bs {bs:>3}: paged "
                        f"{r['paged'] * 1e3:8.3f} ms, identity table "
                        f"{r['paged_contig_layout'] * 1e3:8.3f} ms, contiguous "
                        f"{r['contiguous'] * 1e3:8.3f} ms -> paged/contiguous {r['ratio']:.3f}x "
                        f"(table alone {r['ratio_layout']:.3f}x)"
                    )
    return out_rows


# ----------------------------------------------------------------------------- end to end
def _set_free_list(llm, seed: int | None) -> None:
    """Order the block pool's free queue: sorted (a fresh pool: a lone request gets consecutive
    blocks) or shuffled with ``seed`` (as after long serving: its blocks land scattered)."""
    pool = llm.engine.kv.pool
    ids = sorted(pool._free)
    if seed is not None:
        random.Random(seed).shuffle(ids)
    pool._free.clear()
    for i in ids:
        pool._free[i] = None


class _ContigNative:
    """Stands in for native.paged_decode in the contiguous e2e variant. Checks that the tables
    are runs on every 64th call only, so that its Python overhead matches paged_decode's."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, layer_cache, block_tables, seq_lens, rows, out, scale, fp_spans=None, k=None, v=None):
        assert fp_spans is None, "the contiguous variant runs unquantised caches only"
        k_cache, v_cache = layer_cache.k, layer_cache.v
        if self.calls % 64 == 0 and not C.contiguous_runs(block_tables, seq_lens, k_cache.shape[1]):
            raise RuntimeError("contiguous variant given a non-contiguous block table")
        self.calls += 1
        C.contig_decode(q, k_cache, v_cache, block_tables, seq_lens, rows, out, scale, check=False)


def _contig_read(self, block_ids):
    """PagedKVCache.read returning a view (no gather) for a run of consecutive blocks (checked
    by its ends; the variants' identical tokens confirm it)."""
    if block_ids.dim() == 1:
        first, last = int(block_ids[0]), int(block_ids[-1])
        if last - first + 1 == block_ids.numel():
            return self.k[first : last + 1], self.v[first : last + 1]
    return _ORIG_READ(self, block_ids)


_ORIG_READ = PagedKVCache.read


def _decode_steps(llm, prompt: list[int], sp) -> tuple[list[float], list[int]]:
    """Run one request step by step: the wall time of every decode step (the steps after the
    one that prefilled the prompt and sampled the first token), and the output tokens."""
    eng = llm.engine
    rid = eng.add_request(list(prompt), sp)
    times, out = [], None
    while out is None:
        t0 = time.perf_counter()
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o
        times.append(time.perf_counter() - t0)
    return times[1:], list(out.outputs[0].token_ids)


def e2e_latency(
    model: Path,
    prompt_len: int,
    new_tokens: int,
    block_size: int,
    rounds: int,
    paths: tuple[str, ...],
) -> list[dict]:
    """Single-request decode latency through the real engine (10th percentile of the decode-step
    times of interleaved rounds: robust to other jobs' bursts on a shared machine), for the
    engine's own allocation (fresh pool), a scattered free list, and the contiguous reference
    (native kernel swapped in / torch read without the gather)."""
    from kvledger import LLM, SamplingParams

    rng = random.Random(1)
    prompt = [rng.randrange(3, 1024) for _ in range(prompt_len)]
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results = []
    for path in paths:
        if path == "native" and native.library() is None:
            continue
        llm = LLM(
            str(model),
            block_size=block_size,
            enable_prefix_caching=False,
            calibrate_preemption=False,
            max_num_batched_tokens=max(2048, prompt_len),
        )
        times: dict[str, list[float]] = {v: [] for v in ("engine", "scattered", "contiguous")}
        tokens = {}
        orig_native, orig_can = native.paged_decode, native.can_paged_decode
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate([prompt], warm, use_tqdm=False)  # warm-up: first-call costs are not paging
        for rnd in range(rounds):
            for variant in times:
                _set_free_list(llm, rnd if variant == "scattered" else None)
                try:
                    if path == "torch":
                        native.can_paged_decode = lambda *a, **k: False
                    if variant == "contiguous":
                        if path == "native":
                            native.paged_decode = _ContigNative()
                        else:
                            PagedKVCache.read = _contig_read
                    step_s, token_ids = _decode_steps(llm, prompt, sp)
                finally:
                    native.paged_decode, native.can_paged_decode = orig_native, orig_can
                    PagedKVCache.read = _ORIG_READ
                times[variant] += step_s
                tokens[variant] = token_ids
        same = tokens["engine"] == tokens["scattered"] == tokens["contiguous"]
        # 10th percentile of all decode steps of all rounds: on a shared machine most of the
        # spread is other jobs taking the core, which only ever adds time.
        med = {k: statistics.quantiles(v, n=10)[0] for k, v in times.items()}
        row = {
            "path": path,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "block_size": block_size,
            "rounds": rounds,
            "ms_per_token": {k: v * 1e3 for k, v in med.items()},
            "engine_over_contiguous": med["engine"] / med["contiguous"],
            "scattered_over_contiguous": med["scattered"] / med["contiguous"],
            "identical_tokens": same,
            "statistic": STAT_P10,
        }
        results.append(row)
        print(
            f"  e2e {path:<6} prompt {prompt_len} + {new_tokens} tokens, bs {block_size}: ms/token "
            f"engine {med['engine'] * 1e3:.3f}, scattered {med['scattered'] * 1e3:.3f}, contiguous "
            f"{med['contiguous'] * 1e3:.3f} -> {row['engine_over_contiguous']:.3f}x / "
            f"{row['scattered_over_contiguous']:.3f}x; tokens identical: {same}"
        )
        del llm
    return results


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted({r["path"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(
        len(paths), len(batches), figsize=(6 * len(batches), 3.6 * len(paths)), squeeze=False
    )
    for i, p in enumerate(paths):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            for bs in BLOCK_SIZES:
                sel = sorted(
                    (
                        r
                        for r in rows
                        if r["path"] == p and r["batch"] == b and r["block_size"] == bs
                    ),
                    key=lambda r: r["context"],
                )
                if sel:
                    ax.plot(
                        [r["context"] for r in sel],
                        [r["ratio"] for r in sel],
                        marker="o",
                        label=f"bs {bs}",
                    )
            ax.axhspan(1.05, 1.10, color="orange", alpha=0.2, label="seed: +5-10%")
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{p} decode, batch {b}: paged (scattered) / contiguous", fontsize=9)
            ax.set_xlabel("context tokens")
            ax.set_ylabel("time ratio")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    quick: bool = False, paths: tuple[str, ...] = ("native", "torch"), e2e: bool = True
) -> dict:
    contexts = [256, 1024, 4096] if quick else [256, 1024, 2048, 4096, 8192]
    reps = 3 if quick else 7
    t0 = time.perf_counter()
    rows = kernel_sweep(contexts, [1, 64], reps, paths)
    e2e_rows = []
    if e2e:
        from benchmarks.seed_drift import build_long_model

        with tempfile.TemporaryDirectory(prefix="kvledger-paging-") as tmp:
            model = build_long_model(Path(tmp) / "llama-long", max_positions=8192)
            for prompt_len in (1024,) if quick else (1024, 4096):
                e2e_rows += e2e_latency(
                    model, prompt_len, 64 if quick else 128, 16, 2 if quick else 5, paths
                )
    return {
        "kernel": rows,
        "e2e": e2e_rows,
        "quick": quick,
        "seconds": time.perf_counter() - t0,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_header("seed claim: the price of paging")
    res = run(args.quick, e2e=not args.no_e2e)
    if args.plot:
        plot(res["kernel"], args.plot)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()


# ----------------------------------------------------------------------------- report rows
def _spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.2f}-{xs[-1]:.2f}x (median {statistics.median(xs):.2f}x)"


def claim_rows(res: dict) -> list[tuple[str, str, str, str]]:
    """(claim, seed, kvledger, note) rows for benchmarks/seed_claims.py."""
    out = []
    kernel = res["kernel"]
    for path in ("native", "torch"):
        for batch in sorted({r["batch"] for r in kernel}):
            sel = [r for r in kernel if r["path"] == path and r["batch"] == batch]
            if not sel:
                continue
            inside = sum(1.05 <= r["ratio"] <= 1.10 for r in sel)
            below = sum(r["ratio"] < 1.05 for r in sel)
            by_bs = ", ".join(
                f"bs {bs}: {statistics.median([r['ratio'] for r in sel if r['block_size'] == bs]):.2f}x"
                for bs in BLOCK_SIZES
            )
            big = [r for r in sel if r["context"] == max(x["context"] for x in sel)]
            out.append(
                (
                    f"6. decode attention paged / contiguous, {path}, batch {batch}",
                    "paged +5-10%",
                    _spread([r["ratio"] for r in sel]),
                    f"{len(sel)} configs (contexts {min(r['context'] for r in sel)}-"
                    f"{max(r['context'] for r in sel)}, block sizes 1/16/32/128): {below} under +5%, "
                    f"{inside} within +5-10%, {len(sel) - below - inside} above. Median by block size: "
                    f"{by_bs}. The table alone (identity table over the contiguous layout): "
                    f"{_spread([r['ratio_layout'] for r in sel])}. At {big[0]['context']} tokens: "
                    + ", ".join(
                        f"bs {r['block_size']} {r['paged'] * 1e3:.2f} vs {r['contiguous'] * 1e3:.2f} ms"
                        for r in big
                    ),
                )
            )
    for path in ("native", "torch"):
        sel = [r for r in res["e2e"] if r["path"] == path]
        if not sel:
            continue
        out.append(
            (
                f"6. single-request decode latency, paged / contiguous (real engine, {path})",
                "paged may lose for single-request low latency",
                "; ".join(
                    f"prompt {r['prompt_len']}: {r['engine_over_contiguous']:.3f}x "
                    f"(scattered {r['scattered_over_contiguous']:.3f}x)"
                    for r in sel
                ),
                f"{sel[0].get('statistic', STAT_OLD)} ({sel[0]['rounds']} runs of "
                f"{sel[0]['new_tokens']} tokens), block size "
                f"{sel[0]['block_size']}: "
                + "; ".join(
                    f"prompt {r['prompt_len']}: engine {r['ms_per_token']['engine']:.3f}, scattered "
                    f"{r['ms_per_token']['scattered']:.3f}, contiguous {r['ms_per_token']['contiguous']:.3f}"
                    for r in sel
                )
                + f"; tokens identical in all variants: {all(r['identical_tokens'] for r in sel)}",
            )
        )
    out.append(("6. Triton path", "-", triton_status(), "issue 19's Triton backend"))
    return out


TRITON_PART = (
    "`python benchmarks/gpu_check.py` part 4 measures it: the Triton paged decode kernel over "
    "each request's blocks scattered through the pool vs the same kernel over an identity table "
    "on consecutive blocks holding the same K/V (outputs checked equal), and SDPA over a "
    "contiguous buffer; block sizes 1/16/32/128, contexts 256-8192, batch 1 and 64, bf16"
)


def triton_status() -> str:
    try:
        import importlib

        importlib.import_module("kvledger.model.attention.triton_kernels")
    except ImportError:
        return "not measured: no Triton backend on main at run time (issue 19 not landed)"
    return (
        "not measured: the Triton kernels run only on a CUDA GPU (the interpreter's timings say "
        f"nothing about GPU speed), so this script leaves them out; {TRITON_PART}"
    )
