"""Tensor parallelism on this CPU (issue 17): TP=1 with 2 threads vs TP=2 with 1 thread per rank.

The issue-7 workload (64 token-id requests, prompts 32-256, outputs 16-64 for 90 % and
256-512 for 10 %, greedy, ignore_eos) on the random-weight "bench-60m" Llama (8 layers,
hidden 512, GQA 8/2, float32), each configuration in a fresh process, one after the other:

- tp1: ``LLM(model)`` with torch.set_num_threads(2);
- tp2: ``LLM(model, tensor_parallel_size=2, tp_worker_threads=1)``: two worker processes
  (gloo), the driver process sampling.

Prints generated tok/s, wall s and the ratio, whether the greedy tokens are identical, the
foreign CPU (other processes' CPU seconds during the run; our workers are not foreign), and
for tp2 the time per step inside all-reduce / all-gather on each rank, their compute time and
the driver's round trip. Then the simulator's figure for the seed's 70B on 2 x H100 with the
all-reduce priced explicitly (``gpu_cost_model(allreduce=True)``) against without.

    python -m benchmarks.tp_cpu [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    BENCH_OUT,
    REPO_ROOT,
    _own_cpu_s,
    _system_busy_s,
    ensure_model,
    make_workload,
    workload_summary,
)


def _proc_cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def child(model: str, wl_path: Path, out: Path, tp: int) -> None:
    import torch

    from kvledger import LLM, SamplingParams

    if tp == 1:
        torch.set_num_threads(2)
        llm = LLM(model, dtype="float32", calibrate_preemption=False)
    else:
        torch.set_num_threads(1)
        llm = LLM(model, dtype="float32", calibrate_preemption=False, tensor_parallel_size=tp,
                  tp_worker_threads=1)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([[5] * 8], warm, use_tqdm=False)
    wl = json.loads(wl_path.read_text())
    prompts = [r["prompt_token_ids"] for r in wl]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in wl]
    eng = llm.llm_engine
    pids = [r["pid"] for r in llm.ledger().ranks]
    timings = getattr(eng.executor, "timings", None)  # tensor-parallel executors only
    if timings is not None:
        for k in timings:
            timings[k] = [0.0] * tp if isinstance(timings[k], list) else 0
    busy0, own0 = _system_busy_s(), _own_cpu_s() + sum(_proc_cpu_s(p) for p in pids)
    steps0 = eng.scheduler.step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    own = _own_cpu_s() + sum(_proc_cpu_s(p) for p in pids) - own0
    busy = _system_busy_s() - busy0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    res = {
        "tp": tp, "wall_s": wall, "generated_tokens": sum(map(len, tokens)),
        "steps": eng.scheduler.step - steps0, "own_cpu_s": own,
        "foreign_cpu_s": max(0.0, busy - own), "outputs": tokens,
    }
    if timings is not None:
        res["executor"] = timings
    out.write_text(json.dumps(res))
    eng.shutdown()


def simulated_70b() -> list[str]:
    from kvledger.ledger.spec import PRESETS
    from kvledger.sim.cost_model import gpu_cost_model

    spec = PRESETS["seed-70b"]
    base = gpu_cost_model("h100-80gb", spec, tp=2)
    ar = gpu_cost_model("h100-80gb", spec, tp=2, allreduce=True)
    from kvledger.sim.cost_model import ALLREDUCE_LATENCY_S, NVLINK_EFFICIENCY

    lines = [f"simulated seed-70b on 2 x H100 (tp 2), {ar.source}; all-reduce: 2 per layer, "
             f"{ALLREDUCE_LATENCY_S * 1e6:g} us each + ring bytes over {NVLINK_EFFICIENCY} x 450 GB/s NVLink"]
    for label, tokens, ctx in (("decode, 64 requests x 1000 context", 64, 64 * 1000),
                               ("decode, 1 request x 1000 context", 1, 1000),
                               ("prefill, 2048 tokens", 2048, 2048)):
        pairs = tokens * (tokens + 1) / 2 if label.startswith("prefill") else 0.0
        t0 = base.compute_time(tokens, ctx, pairs)
        t1 = ar.compute_time(tokens, ctx, pairs)
        lines.append(f"  {label:36s} step {t0 * 1e3:8.2f} ms -> with all-reduce {t1 * 1e3:8.2f} ms "
                     f"(all-reduce {1e3 * (t1 - t0):.2f} ms, {100 * (t1 - t0) / t1:.1f} % of the step)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=BENCH_OUT / "tp_cpu")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "WORKLOAD", "OUT", "TP"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], Path(a.child[1]), Path(a.child[2]), int(a.child[3]))
        return 0
    print("command:", "python -m benchmarks.tp_cpu", *(argv or sys.argv[1:]))
    a.out_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model("bench-60m")
    wl = make_workload(a.num_requests)
    wl_path = a.out_dir / "workload.json"
    wl_path.write_text(json.dumps(wl))
    print("workload:", workload_summary(wl))
    res = {}
    for tp in (1, 2):
        out = a.out_dir / f"tp{tp}.json"
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        subprocess.run([sys.executable, "-m", "benchmarks.tp_cpu", "--child", str(model), str(wl_path),
                        str(out), str(tp)], check=True, cwd=REPO_ROOT, env=env)
        res[tp] = json.loads(out.read_text())
    for tp in (1, 2):
        r = res[tp]
        label = "TP=1, 2 threads" if tp == 1 else "TP=2, 1 thread per rank"
        print(f"{label:26s} {r['generated_tokens'] / r['wall_s']:7.1f} tok/s  wall {r['wall_s']:6.1f} s  "
              f"steps {r['steps']}  foreign CPU {r['foreign_cpu_s']:.1f} s")
    t1, t2 = (res[tp]["generated_tokens"] / res[tp]["wall_s"] for tp in (1, 2))
    print(f"ratio TP=2 / TP=1: {t2 / t1:.2f}x")
    print("greedy tokens identical:", res[1]["outputs"] == res[2]["outputs"])
    ex = res[2]["executor"]
    n = ex["steps"]
    for rank in range(2):
        print(f"  rank {rank}: compute {1e3 * ex['compute_s'][rank] / n:.2f} ms/step, of which all-reduce "
              f"+ all-gather {1e3 * ex['collective_s'][rank] / n:.2f} ms/step "
              f"({ex['collectives'][rank] / n:.1f} collectives/step)")
    print(f"  driver round trip {1e3 * ex['round_trip_s'] / n:.2f} ms/step over {n} steps")
    for line in simulated_70b():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
