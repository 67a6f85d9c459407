"""N replicas in the simulator: every policy serves the whole trace on the real schedulers, the
router's event-fed view equals each pool, and exact cache-aware dispatch beats round-robin's hit
rate on a multi-tenant trace whose tenants do not all fit in one replica."""

from __future__ import annotations

import random

import pytest

from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.errors import ConfigError
from kvledger.ledger.accounting import kv_bytes_per_token
from kvledger.ledger.spec import load_model_spec
from kvledger.sim.cost_model import gpu_cost_model
from kvledger.sim.data_parallel import DP_SIM_POLICIES, simulate_data_parallel
from kvledger.sim.trace import TraceRequest


def _trace(n_req: int = 120, tenants: int = 8, rate: float = 40.0) -> list[TraceRequest]:
    rng = random.Random(3)
    lens = [rng.randint(300, 700) for _ in range(tenants)]
    t, rows = 0.0, []
    for _ in range(n_req):
        t += rng.expovariate(rate)
        k = rng.randrange(tenants)
        rows.append(TraceRequest(t, lens[k] + rng.randint(10, 40), rng.randint(4, 16), f"t{k}", lens[k]))
    return rows


def test_policies_serve_everything_and_cache_aware_hits_more():
    spec = load_model_spec("llama-3-8b")
    cost = gpu_cost_model("h100-80gb", spec, 1)
    bpt = kv_bytes_per_token(spec, "auto", 1).total
    tr = _trace()
    out = {}
    for pol in DP_SIM_POLICIES:
        r = out[pol] = simulate_data_parallel(tr, 3, pol, SchedulerConfig(max_model_len=2048),
                                              CacheConfig(block_size=16), 160, bpt, cost)
        assert r["num_finished"] == len(tr) and r["index_exact"], (pol, r)
    assert out["round_robin"]["requests_per_replica_max"] - out["round_robin"]["requests_per_replica_min"] <= 1
    assert out["cache_aware"]["prefix_hit_rate"] > 1.3 * out["round_robin"]["prefix_hit_rate"], out
    with pytest.raises(ConfigError, match="policy must be one of"):
        simulate_data_parallel(tr, 2, "random", SchedulerConfig(), CacheConfig(), 64, bpt, cost)
