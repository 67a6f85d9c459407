"""The tiered prefix cache (issue 44) for sliding-window and hybrid models: each KV cache group's
blocks are kept under its own hash chain, a hit length counts only if every group can serve it
(full-attention groups every block before it, sliding groups the window's blocks), and the
prefix comes back exactly from host memory and from disk after a restart.

Block size 4; Gemma 3's tiny config has one full-attention layer and two sliding ones (window
6), so three groups of one layer each; each prompt is 41 tokens (10 full blocks).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvledger import LLM, SamplingParams
from kvledger.cache import kv_block_file
from kvledger.cache.attention_policy import RELEASED
from kvledger.cache.kv_block_file import OffloadSpec
from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.cache.kv_tiers import KVTiers
from kvledger.cache.tier_hit import longest_after_failure
from tests.model_factory import build_hf_model, tiny_config
from tests.test_engine_exact import hf_greedy

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# -- the agreement rule, on the block manager --------------------------------------------------
def _evicted_prompt(
    windows: list[int | None], length: int = 41
) -> tuple[KVCacheManager, list[int]]:
    """A manager whose prompt's blocks were published, then evicted from the pool into the host
    tier (every group's, each under its own chain)."""
    kv = KVCacheManager(64, BS, bytes_per_token=8, windows=windows)
    kv.attach_tiers(
        KVTiers(OffloadSpec("t", num_host_blocks=64, num_disk_blocks=0, block_bytes=32), BS)
    )
    prompt = list(range(3, 3 + length))
    assert kv.allocate_slots("a", length)
    kv.cache_blocks("a", prompt, length)
    kv.free("a")
    taken = kv.pool.allocate(kv.num_free_blocks)  # evicts every cached block
    kv.tiers.on_evicted(kv.pool.evicted)
    kv.pool.evicted = []
    kv.pool.free(taken)
    kv.tiers.take_ops()
    return kv, prompt


def _drop(kv: KVCacheManager, prompt: list[int], group: int, index: int) -> None:
    g = kv.groups[group]
    h = list(g.chain(prompt, None, 0, index + 1, g.hash_root))[index][0]
    del kv.tiers.host[h]


def test_hit_length_is_the_longest_every_group_serves():
    """Full group: every block before the hit; sliding group (window 10): only the blocks its
    window covers there, so dropping a sliding block shortens the hit to where the window no
    longer needs it, which is not a prefix rule."""
    kv, prompt = _evicted_prompt([None, 10])
    hit = kv.tier_hit(prompt, None, 0)
    assert hit.num_blocks == 10  # 41 tokens: at least one is computed
    full, sliding = hit.tables
    assert len(full) == 10 and sliding[:7] == [RELEASED] * 7  # (40 - 10 + 1) // 4 = 7
    assert [(g, i) for g, i, _ in hit.loads] == [(0, i) for i in range(7)] + [
        (g, i) for i in range(7, 10) for g in (0, 1)
    ]
    _drop(kv, prompt, 1, 9)
    assert kv.tier_hit(prompt, None, 0).num_blocks == 9  # its window starts at block 6
    _drop(kv, prompt, 1, 6)
    assert kv.tier_hit(prompt, None, 0).num_blocks == 6  # 7 and 8 need block 6 too
    _drop(kv, prompt, 0, 2)
    assert kv.tier_hit(prompt, None, 0).num_blocks == 2  # the full group needs blocks 0, 1
    assert kv.tier_hit(prompt, "other salt", 0) is None
    assert kv.tier_hit(prompt, None, 2 * BS) is None  # nothing past the device's own hit


def test_a_failed_load_cuts_the_hit_only_where_no_window_needs_released_blocks():
    kv, prompt = _evicted_prompt([None, 10])
    hit = kv.tier_hit(prompt, None, 0)
    fresh = kv.allocate_tier_hit("r", hit, None)
    assert len(fresh) == len(hit.loads) and kv.num_used_blocks == len(fresh)
    tables = kv.block_tables("r")
    assert all(b >= 0 for b in tables[0]) and tables[1][:7] == [RELEASED] * 7
    # The sliding group released blocks 0-6: no shorter hit has its window without them.
    assert longest_after_failure(kv.groups, tables, 9) is None
    kv.free("r")
    kv.check_invariants()
    full_only, prompt = _evicted_prompt([None])
    hit = full_only.tier_hit(prompt, None, 0)
    full_only.allocate_tier_hit("r", hit, None)
    assert longest_after_failure(full_only.groups, full_only.block_tables("r"), 4) == 4
    full_only.free("r")


# -- through the engine, against HF ----------------------------------------------------------
def _prompts(n: int = 4, length: int = 41, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 97) for _ in range(length - 1)] for _ in range(n)]


def _run(llm: LLM, prompts) -> tuple[list[list[int]], list[int]]:
    """One prompt at a time (each pass evicts the earlier prompts): tokens, cached tokens."""
    toks, cached = [], []
    for p in prompts:
        (o,) = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
        toks.append(list(o.outputs[0].token_ids))
        cached.append(o.num_cached_tokens)
    return toks, cached


@pytest.mark.parametrize("kind,blocks", [("gemma3", 40), ("mistral_window", 12)])
def test_hybrid_and_sliding_prefix_from_host_then_disk_matches_hf(kind, blocks, tmp_path, caplog):
    """A pool too small to keep any earlier prompt: without tiers nothing hits; with them the
    second pass comes from host memory, and a restarted engine's from disk, with HF's tokens.
    Then a sliding group's block file is damaged: that load fails, the hit is cut (here the
    request starts over with the hit its groups still agree on), and the tokens stay HF's."""
    hf = build_hf_model(tiny_config(kind), tmp_path / "m")
    prompts = _prompts()
    ref = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    kw = dict(block_size=BS, num_kv_blocks=blocks, calibrate_preemption=False)
    toks, cached = _run(LLM(str(tmp_path / "m"), **kw), prompts * 2)
    assert toks == ref * 2 and cached == [0] * 8

    tiers_kw = dict(kw, kv_offload_dir=str(tmp_path / "kv"))
    llm = LLM(str(tmp_path / "m"), kv_offload_host_bytes="1MiB", **tiers_kw)
    toks, cached = _run(llm, prompts * 2)
    assert toks == ref * 2 and cached == [0] * 4 + [40] * 4
    assert llm.engine.kv.tiers.hits["host"] > 0
    llm.engine.shutdown()

    again = LLM(str(tmp_path / "m"), **tiers_kw)  # disk only
    kv = again.engine.kv
    toks, cached = _run(again, prompts)
    assert toks == ref and cached == [40] * 4 and kv.tiers.hits["disk"] > 0
    # Damage the last block of prompt 0 in its last (sliding) group.
    g = kv.groups[-1]
    h = list(g.chain(prompts[0], None, 0, 10, g.hash_root))[-1][0]
    path = kv_block_file.block_path(kv.tiers.spec.directory, h)
    assert os.path.exists(path)
    Path(path).write_bytes(Path(path).read_bytes()[:-7])
    assert again.reset_prefix_cache()  # the device's copies go; the disk tier stays
    with caplog.at_level("WARNING", logger="kvledger"):
        toks, cached = _run(again, prompts[:1])
    assert toks == ref[:1] and cached == [36]  # block 9 is recomputed; the windows before it load
    assert any("unusable" in r.getMessage() for r in caplog.records)
    again.engine.shutdown()
