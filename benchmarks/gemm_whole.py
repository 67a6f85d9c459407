"""When the native row-wise GEMM takes a product whole instead of oneDNN (gemm_dispatch.small_gemm_whole).

oneDNN runs a product on its row bucket (gemm_rows.gemm_rows_bucket: up to 12.5 % padding rows
above 256 rows); the native kernel runs the rows exactly. Two parts, each printing both figures
and their ratio:

1. Kernels: the 60M model's four layer weights summed (hot weights, calls alternated), the
   native kernel on m rows against oneDNN on the same rows padded to their bucket.
2. Steps: the 60M model in-process, one mixed or prefill step at a time, the rule on and off
   alternated step by step in one process (off: gemm_dispatch.small_gemm_whole answers False).

    python -m benchmarks.gemm_whole [--dtype float32|bfloat16] [--rows 288,1300,2048] [--steps]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import ensure_model, interleaved_ms, print_header
from kvledger.kernels import gemm_dispatch, native
from kvledger.kernels.gemm_rows import gemm_rows_bucket
from kvledger.storage import host_memory

SHAPES = {"qkv": (768, 512), "o": (512, 512), "gate_up": (3584, 512), "down": (512, 1792)}
# (running decodes, prompt lengths) of the steps timed: the serving loads' common mixed steps,
# fresh prompt bursts, and a full 2,048-row budget.
STEPS = [(7, [256]), (62, [300]), (60, [1000]), (0, [130] * 10), (0, [160] * 8), (56, [142] * 14)]


def kernels(dtype: torch.dtype, rows: list[int]) -> None:
    print(f"== one layer's products ({dtype}): native on m rows vs oneDNN on the bucket's rows")
    weights = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).to(dtype)
        weights[name] = (native.pack_weight(w, alloc=host_memory.zeros), torch.ops.mkldnn._reorder_linear_weight(w))
    for m in rows:
        mp = gemm_rows_bucket(m)
        total = {"native": 0.0, "oneDNN": 0.0}
        for name, (_, k) in SHAPES.items():
            xp = torch.randn(mp, k).to(dtype)
            gw, pw = weights[name]
            t = interleaved_ms(
                {
                    "native": lambda i, x=xp[:m], gw=gw: native.small_gemm(x, gw, None),
                    "oneDNN": lambda i, xp=xp, pw=pw: torch.ops.mkldnn._linear_pointwise(xp, pw, None, "none", [], ""),
                },
                10,
                warmup=1,
            )
            for a in total:
                total[a] += t[a]
        rule = gemm_dispatch.small_gemm_whole(m, mp, dtype)
        print(
            f"m {m:5d} (bucket {mp:5d}): native {total['native']:7.2f} ms  oneDNN {total['oneDNN']:7.2f} ms  "
            f"native/oneDNN {total['native'] / total['oneDNN']:.3f}  rule takes native: {rule}"
        )


def steps(dtype: str) -> None:
    import os

    from kvledger import LLM, SamplingParams

    os.environ["KVLEDGER_GEMM_DISPATCH"] = "builtin"  # the rule switched below is the builtin one

    print(f"== whole steps ({dtype}), the rule on vs off, alternated step by step")
    llm = LLM(str(ensure_model("bench-60m")), dtype=dtype, block_size=32, kv_cache_memory=1 << 30, max_model_len=1024)
    eng = llm.llm_engine
    eng.executor.worker.kv_pool.populate()  # as `kvledger serve` does: no first-touch page faults in the steps timed
    rule = gemm_dispatch.small_gemm_whole
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    for ndec, prompts in STEPS:
        for i in range(ndec):
            params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
            eng.add_request(torch.randint(10, 30000, (150,), generator=g).tolist(), params, request_id=f"d{i}")
        for _ in range(3):
            eng.step()
        times: dict[str, list[float]] = {"on": [], "off": []}
        try:
            for rep in range(12):
                arm = "on" if rep % 2 else "off"
                gemm_dispatch.small_gemm_whole = rule if arm == "on" else (lambda m, p, d: False)
                for j, n in enumerate(prompts):
                    eng.add_request(torch.randint(10, 30000, (n,), generator=g).tolist(), one, request_id=f"p{rep}-{j}")
                t = time.perf_counter()
                eng.step()
                if rep >= 2:
                    times[arm].append(time.perf_counter() - t)
                gemm_dispatch.small_gemm_whole = rule
                if ndec:
                    eng.step()
                while not ndec and eng.has_unfinished_requests():
                    eng.step()
        finally:
            gemm_dispatch.small_gemm_whole = rule
        for rid in list(eng.groups):
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        on, off = (statistics.median(times[a]) * 1e3 for a in ("on", "off"))
        print(f"{ndec:3d} decodes + {sum(prompts):5d} prompt tokens: rule on {on:7.1f} ms  off {off:7.1f} ms  on/off {on / off:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="272,288,300,384,512,768,1024,1100,1300,1536,2048")
    ap.add_argument("--steps", action="store_true", help="also time whole steps of the 60M model")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print_header("the native GEMM taking products whole vs oneDNN on padded buckets")
    if native.library() is None:
        print("native kernels unavailable here")
        return 1
    kernels(getattr(torch, a.dtype), [int(r) for r in a.rows.split(",")])
    if a.steps:
        steps(a.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
