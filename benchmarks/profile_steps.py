"""Where kvledger's time goes on the issue-7 workload: per-step timings by kind, optionally
with the torch profiler's op table. kvledger only (the peer comparison is vs_vllm_cpu.py).

Steps are bucketed as "mixed" (any prefill chunk) or "decode<N>" (pure decode, N = number
of requests rounded down to a multiple of 8), with count, total seconds and ms per step.

    python -m benchmarks.vs_vllm_cpu --only vllm     # once, writes the model and workload
    python -m benchmarks.profile_steps               # timings
    python -m benchmarks.profile_steps --torch-profiler   # + top ops (slower)
    python -m benchmarks.profile_steps --split            # + time inside each part, per step kind

The torch profiler does not see the native kernels (ctypes calls); --split times them, the
attention backend and the runner's phases with wall clocks around each call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import BENCH_OUT, print_header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=BENCH_OUT / "models" / "bench-60m-seed0")
    ap.add_argument("--workload", type=Path, default=BENCH_OUT / "vs_vllm_cpu" / "workload.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_int8"])
    ap.add_argument("--torch-profiler", action="store_true")
    ap.add_argument("--split", action="store_true", help="wall time inside each part, per step kind")
    a = ap.parse_args()
    if not a.model.is_dir() or not a.workload.is_file():
        raise SystemExit(f"missing {a.model} or {a.workload}: run benchmarks.vs_vllm_cpu once first")
    torch.set_num_threads(a.threads)
    print_header("kvledger step profile (issue-7 workload)")
    from kvledger import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(a.model), dtype=a.dtype, block_size=a.block_size, kv_cache_dtype=a.kv_cache_dtype
    )
    print(f"dtype {a.dtype}, kv_cache_dtype {a.kv_cache_dtype}")
    print(f"start-up {time.perf_counter() - t0:.2f} s")
    wl = json.loads(a.workload.read_text())
    prompts = [r["prompt_token_ids"] for r in wl]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in wl]

    runner = llm.engine.executor.worker.runner
    execute = runner.execute
    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    current = {"kind": ""}
    if a.split:
        _install_split_timers(runner, parts, current)

    def timed(so):
        decode = all(n == 1 for n in so.num_scheduled_tokens)
        kind = f"decode{len(so.req_ids) // 8 * 8:03d}" if decode else "mixed"
        current["kind"] = kind
        t = time.perf_counter()
        out = execute(so)
        dt = time.perf_counter() - t
        st = stats[kind]
        st[0] += 1
        st[1] += dt
        st[2] += so.total_num_scheduled_tokens
        return out

    runner.execute = timed
    t0 = time.perf_counter()
    if a.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} tokens in {wall:.2f} s = {n / wall:.1f} tok/s" + (" (under the profiler)" if a.torch_profiler else ""))
    print(f"{'kind':>10} {'steps':>6} {'seconds':>8} {'tokens':>7} {'ms/step':>8}")
    for kind, (c, s, t) in sorted(stats.items()):
        print(f"{kind:>10} {c:>6} {s:>8.2f} {t:>7} {1e3 * s / c:>8.1f}")
    if a.split:
        names = sorted({n for p in parts.values() for n in p})
        print("\nms per step inside each part (nested: attention includes paged_decode, forward")
        print("includes attention and the kernels; the LM head GEMM is inside compute_logits)")
        print(f"{'kind':>10} " + " ".join(f"{n:>15}" for n in names))
        for kind, p in sorted(parts.items()):
            c = stats[kind][0]
            print(f"{kind:>10} " + " ".join(f"{1e3 * p.get(n, 0.0) / c:>15.2f}" for n in names))
    if a.torch_profiler:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


def _install_split_timers(runner, parts, current) -> None:
    """Wrap the native kernels, the attention backend and the runner's phases with timers."""
    from kvledger.kernels import native
    from kvledger.model.attention import torch_backend

    def wrap(owner, name, label):
        orig = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                parts[current["kind"]][label] += time.perf_counter() - t

        setattr(owner, name, timed)

    for fn in ("small_gemm", "paged_decode", "rms_norm", "rope_", "silu_mul"):
        wrap(native, fn, fn)
    wrap(torch_backend.TorchAttentionBackend, "forward", "attention")
    wrap(runner.model, "forward", "forward")
    wrap(runner.model, "compute_logits", "compute_logits")
    wrap(runner, "prepare", "prepare")
    wrap(runner, "_sample", "sample")


if __name__ == "__main__":
    raise SystemExit(main())
