"""Microbenchmark of the scheduling path alone: scheduler + block manager + input preparation.

No model runs: each step is schedule() -> ModelRunner.prepare() (positions, slot mapping,
block tables as tensors) -> the engine's post-step update with a placeholder token. All
requests are in decode with ~1,000-token contexts. Target (issue 7): <= 1 ms per step at 256
running requests.

    python -m benchmarks.sched_step [--sizes 16,64,256,1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.core.request import Request
from kvledger.core.scheduler import Scheduler
from kvledger.sampling_params import SamplingParams
from kvledger.worker.model_runner import ModelRunner


def one_size(n: int, context: int, steps: int, block_size: int = 16) -> dict:
    sc = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(8192, n), max_model_len=context + steps + 64)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True, swap_space=0)
    num_blocks = n * ((context + steps + 2 * block_size) // block_size + 1)
    sched = Scheduler.build(sc, cc, num_blocks, bytes_per_token=1024)
    no_pool = SimpleNamespace(overlay=None, layers=[])  # prepare() never touches the KV tensors
    runner = ModelRunner(None, no_pool, None, block_size, torch.device("cpu"))
    sp = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(n):
        # Distinct prompts (no prefix hits), so every request owns its ~63 blocks.
        sched.add_request(Request(str(i), [3 + (i * 7919 + p) % 30000 for p in range(context)], sp,
                                  max_total_tokens=context + steps + 64))

    phases: list[tuple[float, float, float]] = []

    def step() -> float:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        runner.update_states(so)  # the runner's own request states and block tables
        runner.prepare(so)
        t2 = time.perf_counter()
        for req in sched.update_after_step(so, 0.0):
            req.append_output_token(7)
        t3 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        return t3 - t0

    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        step()  # prefill everything first
    phases.clear()
    times = [step() for _ in range(steps)]
    assert all(len(sched.requests[rid].output_token_ids) > 1 for rid in sched.schedule().req_ids)
    split = [1e3 * statistics.median(p[i] for p in phases) for i in range(3)]
    return {"running": n, "context": context, "p50_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times), "mean_ms": 1e3 * statistics.fmean(times),
            "max_ms": 1e3 * max(times), "schedule_ms": split[0], "prepare_ms": split[1],
            "update_ms": split[2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("command:", " ".join(sys.argv))
    print(f"{'running':>8} {'context':>8} {'p50 ms/step':>12} {'min':>8} {'mean':>8} {'max':>8}"
          f" | p50 of schedule / prepare / update")
    for n in map(int, args.sizes.split(",")):
        r = one_size(n, args.context, args.steps)
        print(f"{r['running']:>8} {r['context']:>8} {r['p50_ms']:>12.3f} {r['min_ms']:>8.3f} {r['mean_ms']:>8.3f}"
              f" {r['max_ms']:>8.3f} | {r['schedule_ms']:.3f} / {r['prepare_ms']:.3f} / {r['update_ms']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
