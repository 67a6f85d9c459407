"""The dp_routing comparison at 4, 16 and 64 replicas, in the simulator (the engine's own
Scheduler and KVCacheManager per replica on a virtual clock; kvledger/sim/data_parallel.py).

    python -m benchmarks.dp_routing_sim [--replicas 4,16,64] [--rate-per-replica 30]

Weak scaling: per replica, 8 tenants (system prompts of 500-2,000 tokens), 128 requests (a
tenant's prompt + a 20-80-token question, 16-64 output tokens), arriving Poisson at
``--rate-per-replica`` x N per second; each replica's pool holds ``--num-kv-blocks`` x 16
tokens (768: about the prompts of its fair share of 8 tenants plus room, so a router that
scatters tenants evicts). Cost model: Llama-3-8B on one H100 (``gpu_cost_model``: datasheet
bandwidth and FLOPs x efficiency). Policies: round_robin, least_loaded, sglang_model (a model of
sglang-router's cache_aware, documented in kvledger/sim/data_parallel.py) and cache_aware.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from benchmarks.common import BENCH_OUT
from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.ledger.accounting import kv_bytes_per_token
from kvledger.ledger.spec import load_model_spec
from kvledger.sim.cost_model import gpu_cost_model
from kvledger.sim.data_parallel import simulate_data_parallel
from kvledger.sim.trace import TraceRequest


def trace(n: int, rate: float, tenants_per: int, reqs_per: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    lens = [rng.randint(500, 2000) for _ in range(tenants_per * n)]
    t, rows = 0.0, []
    for _ in range(reqs_per * n):
        t += rng.expovariate(rate * n)
        k = rng.randrange(len(lens))
        rows.append(TraceRequest(t, lens[k] + rng.randint(20, 80), rng.randint(16, 64), f"tenant{k}", lens[k]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="4,16,64")
    ap.add_argument("--rate-per-replica", type=float, default=30.0)
    ap.add_argument("--num-kv-blocks", type=int, default=768)
    ap.add_argument("--tenants-per-replica", type=int, default=8)
    ap.add_argument("--requests-per-replica", type=int, default=128)
    ap.add_argument("--policies", default="round_robin,least_loaded,sglang_model,cache_aware")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spec = load_model_spec("llama-3-8b")
    cost = gpu_cost_model("h100-80gb", spec, 1)
    bpt = kv_bytes_per_token(spec, "auto", 1).total
    print("== dp_routing_sim: N replicas in the simulator (real scheduler per replica)")
    print(f"cost model: {cost.name} ({cost.source})")
    out, rows = BENCH_OUT / "dp_routing_sim", []
    out.mkdir(parents=True, exist_ok=True)
    for n in (int(x) for x in a.replicas.split(",")):
        tr = trace(n, a.rate_per_replica, a.tenants_per_replica, a.requests_per_replica, a.seed)
        res = {}
        for pol in a.policies.split(","):
            t0 = time.perf_counter()
            r = res[pol] = simulate_data_parallel(
                tr, n, pol, SchedulerConfig(max_model_len=4096), CacheConfig(block_size=16),
                a.num_kv_blocks, bpt, cost)
            print(f"N={n:3d} {pol:13s} {r['throughput_tokens_per_s']:9.0f} tok/s  TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms"
                  f"  p99 {r['ttft_p99_s'] * 1e3:8.1f} ms  hit {r['prefix_hit_rate']:.3f}  "
                  f"req/replica {r['requests_per_replica_min']}-{r['requests_per_replica_max']}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            rows.append(r)
        ex = res.get("cache_aware")
        for pol in ("round_robin", "sglang_model"):
            if ex and pol in res:
                b = res[pol]
                print(f"N={n:3d} cache_aware / {pol}: throughput {ex['throughput_tokens_per_s'] / b['throughput_tokens_per_s']:.2f}x, "
                      f"hit rate {ex['prefix_hit_rate'] / max(b['prefix_hit_rate'], 1e-9):.2f}x, "
                      f"TTFT p99 {b['ttft_p99_s'] / ex['ttft_p99_s']:.2f}x lower")
    (out / "results.json").write_text(json.dumps({"args": vars(a), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
