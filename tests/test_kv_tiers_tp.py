"""The tiered prefix cache (issue 44) under tensor parallelism: every rank stores and loads its
own shard (its host tier, its ``rank<r>/`` files), and the driver merges the ranks' reports so
a load counts only once every rank has it in place and a block one rank cannot read is a miss
for all. tp=2 must give tp=1's tokens with the prefix from host memory and, after a restart,
from disk."""

from __future__ import annotations

import os
import random

from kvledger import LLM
from kvledger.cache import kv_block_file
from kvledger.cache.block_hash import hash_request_blocks
from kvledger.cache.kv_tier_messages import TierReport
from kvledger.cache.kv_tier_ranks import RankTierReports
from tests.model_factory import build_hf_model, tiny_config
from tests.test_kv_tiers_hybrid import _run

BS = 4


def test_ranks_agree_on_loads_and_writes():
    m = RankTierReports(2)
    # Rank 0 has request a in place; rank 1 not yet: nobody runs it.
    assert m.merge([TierReport(loads_done={"a": 3}, stores_done=[7]), None]) is None
    rep = m.merge([None, TierReport(loads_done={"a": 1}, stores_done=[7])])
    assert rep.loads_done == {"a": 1}  # the fewest intact blocks any rank has
    assert rep.stores_done == [7]  # on disk once both ranks' files are
    # A write that failed on one rank fails; an unusable block on one rank is a miss for all.
    rep = m.merge(
        [
            TierReport(stores_done=[8], traffic={"disk_load": [100, 0.5]}),
            TierReport(
                store_errors=[(8, "ENOSPC: full")],
                load_errors=[(9, "missing: x")],
                traffic={"disk_load": [100, 0.25]},
            ),
        ]
    )
    assert rep.stores_done == [] and rep.store_errors == [(8, "ENOSPC: full (rank 1)")]
    assert rep.load_errors == [(9, "missing: x (rank 1)")]
    assert rep.traffic == {"disk_load": [200, 0.5]}  # bytes add up, the slowest rank's time
    # A load aborted before every rank reported it is forgotten with the finished ids.
    assert m.merge([TierReport(loads_done={"b": 2}), None]) is None
    assert m.merge([None, None], finished_req_ids=["b"]) is None and not m.loads


def test_tp2_prefix_from_host_and_from_disk_after_restart_gives_tp1_tokens(tmp_path):
    """A pool too small to keep earlier prompts: tp=2's second pass loads them from every
    rank's host tier, a restarted tp=2 engine from every rank's files, each with tp=1's tokens.
    Then one block file of rank 1 only is deleted: that block and the ones after it are
    recomputed on both ranks (rank 0 had it), and the tokens stay tp=1's."""
    build_hf_model(tiny_config("llama_gqa"), tmp_path / "m")  # 2 KV heads: one per rank
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 97) for _ in range(40)] for _ in range(4)]
    kw = dict(block_size=BS, num_kv_blocks=14, calibrate_preemption=False)
    want, cached = _run(LLM(str(tmp_path / "m"), **kw), prompts)
    assert cached == [0] * 4

    tiers_kw = dict(kw, tensor_parallel_size=2, kv_offload_dir=str(tmp_path / "kv"))
    tp2 = LLM(str(tmp_path / "m"), kv_offload_host_bytes="1MiB", **tiers_kw)
    toks, cached = _run(tp2, prompts * 2)
    assert toks == want * 2 and cached == [0] * 4 + [40] * 4
    tiers = tp2.llm_engine.kv.tiers
    assert tiers.hits["host"] == 40
    # The host budget is summed over the ranks (vLLM's kv_offloading_size): each holds its half.
    assert tiers.spec.num_host_blocks == (1 << 20) // (2 * tiers.spec.block_bytes)
    assert tiers.stats()["host"]["capacity_bytes"] <= 1 << 20
    tp2.llm_engine.shutdown()  # every rank's writes flushed, the index saved

    again = LLM(str(tmp_path / "m"), **tiers_kw)
    try:
        directory = again.llm_engine.kv.tiers.spec.directory
        os.unlink(
            kv_block_file.block_path(directory, hash_request_blocks(prompts[0], BS)[3], rank=1)
        )
        toks, cached = _run(again, prompts)
        assert toks == want and cached == [12] + [40] * 3
        assert again.llm_engine.kv.tiers.hits["disk"] == 40
    finally:
        again.llm_engine.shutdown()
