"""Block hashes are the same in every process (so a router can recompute a replica's chain)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvledger.cache.block_hash import HASH_FNS, get_hash_fn, hash_request_blocks
from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.errors import ConfigError

PROMPT = list(range(1000, 1070))  # 4 full blocks of 16 and a partial one
_CHILD = (
    "import json,sys; from kvledger.cache.block_hash import hash_request_blocks as h;"
    "print(json.dumps({a: h(list(range(1000, 1070)), 16, 'tenant', a) for a in sys.argv[1:]}))"
)


def _in_child(seed: str, algos: list[str]) -> dict[str, list[int]]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _CHILD, *algos], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_stable_algorithms_agree_across_processes_and_builtin_does_not():
    algos = list(HASH_FNS)
    a, b = _in_child("1", algos), _in_child("2", algos)
    for algo in ("sha256", "sha256_cbor"):
        here = hash_request_blocks(PROMPT, 16, "tenant", algo)
        assert len(here) == 4 and len(set(here)) == 4
        assert a[algo] == b[algo] == here
        assert all(0 <= h < 2**64 for h in here)  # vLLM's int form in KV events
    # The salt string is hashed with the per-process seed: why builtin cannot route.
    assert a["builtin"] != b["builtin"]
    assert hash_request_blocks(PROMPT, 16, "tenant") != hash_request_blocks(PROMPT, 16, "other")
    assert hash_request_blocks(PROMPT, 16, None, "sha256") != hash_request_blocks(PROMPT, 16, None, "sha256_cbor")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "builtin"])
def test_pool_publishes_the_chain_a_router_computes(algo):
    kv = KVCacheManager(32, 16, hash_algo=algo)
    assert kv.allocate_slots("a", len(PROMPT), [], "tenant")
    kv.cache_blocks("a", PROMPT, len(PROMPT))
    assert kv.pool.cached_hashes() == set(hash_request_blocks(PROMPT, 16, "tenant", algo))
    kv.free("a")


def test_unknown_algorithm_is_named():
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo.*'md5'"):
        get_hash_fn("md5")
