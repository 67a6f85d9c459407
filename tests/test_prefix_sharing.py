"""64 requests behind one 1,200-token system prompt: the prefix is stored once.

The byte figures are the manager's real block counts times the seed 70B model's block size
(80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 327,680 B/token; 16-token blocks). The
seed article rounds them to "24 GB -> 0.4 GB"; exactly, the prefix costs 25.17 GB (23.44 GiB)
unshared and 0.39 GB (375 MiB) shared, plus each request's own suffix blocks.
"""

import pytest

from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.ledger import format_bytes, kv_bytes_per_token, load_model_spec
from kvledger.ledger.accounting import prefix_sharing_savings

NUM_REQUESTS = 64
PREFIX_LEN = 1200
SUFFIX_LEN = 20
BLOCK_SIZE = 16
SYSTEM_PROMPT = [1000 + (i * 7919) % 30000 for i in range(PREFIX_LEN)]


def _prompt(i: int) -> list[int]:
    return SYSTEM_PROMPT + [i * SUFFIX_LEN + j for j in range(SUFFIX_LEN)]  # distinct suffixes


def _serve(enable_prefix_caching: bool) -> KVCacheManager:
    bpt = kv_bytes_per_token(load_model_spec("seed-70b")).total
    kv = KVCacheManager(
        num_blocks=6000,
        block_size=BLOCK_SIZE,
        bytes_per_token=bpt,
        enable_prefix_caching=enable_prefix_caching,
    )
    for i in range(NUM_REQUESTS):
        prompt = _prompt(i)
        computed, num_cached = kv.get_computed_blocks(prompt)
        assert kv.allocate_slots(f"r{i}", len(prompt) - num_cached, computed)
        kv.record_prefix_lookup(len(prompt), num_cached)
        kv.cache_blocks(f"r{i}", prompt, len(prompt))
    kv.check_invariants()
    return kv


def test_system_prompt_is_stored_once_for_64_requests():
    kv = _serve(enable_prefix_caching=True)
    prefix_blocks = PREFIX_LEN // BLOCK_SIZE  # 75, all full
    blocks_per_request = -(-(PREFIX_LEN + SUFFIX_LEN) // BLOCK_SIZE)  # 77
    suffix_blocks = blocks_per_request - prefix_blocks  # 2
    tables = [kv.block_table(f"r{i}") for i in range(NUM_REQUESTS)]

    # Distinct physical blocks behind the prefix positions: one set, shared by all 64.
    assert len({tuple(t[:prefix_blocks]) for t in tables}) == 1
    assert len({b for t in tables for b in t[:prefix_blocks]}) == prefix_blocks
    assert all(kv.pool.blocks[b].ref_cnt == NUM_REQUESTS for b in tables[0][:prefix_blocks])
    # The suffix blocks are private and distinct.
    suffixes = [b for t in tables for b in t[prefix_blocks:]]
    assert len(set(suffixes)) == len(suffixes) == NUM_REQUESTS * suffix_blocks

    snap = kv.ledger()
    assert snap.shared_blocks == prefix_blocks
    assert snap.used_blocks == prefix_blocks + NUM_REQUESTS * suffix_blocks == 203
    assert snap.tokens_stored == PREFIX_LEN + NUM_REQUESTS * SUFFIX_LEN
    assert all(
        (r.shared_blocks, r.private_blocks) == (prefix_blocks, suffix_blocks)
        for r in snap.requests.values()
    )
    # Every request but the first was served the whole prefix from cache.
    assert snap.prefix_cache_hits == (NUM_REQUESTS - 1) * PREFIX_LEN

    for i in range(NUM_REQUESTS):
        kv.free(f"r{i}")
    assert kv.num_used_blocks == 0
    assert kv.ledger().cached_blocks == prefix_blocks + NUM_REQUESTS  # full suffix blocks too


def test_bytes_saved_for_the_seed_70b_config():
    shared = _serve(enable_prefix_caching=True)
    unshared = _serve(enable_prefix_caching=False)
    bpb = shared.bytes_per_block
    assert bpb == 327_680 * BLOCK_SIZE == 5_242_880
    assert unshared.ledger().shared_blocks == 0

    prefix_blocks = PREFIX_LEN // BLOCK_SIZE
    # The prefix's share of each manager's real block count.
    suffix_used = NUM_REQUESTS * (-(-(PREFIX_LEN + SUFFIX_LEN) // BLOCK_SIZE) - prefix_blocks)
    prefix_without = (unshared.num_used_blocks - suffix_used) * bpb
    prefix_with = (shared.num_used_blocks - suffix_used) * bpb
    total_without = unshared.ledger().used_bytes
    total_with = shared.ledger().used_bytes

    assert unshared.num_used_blocks == NUM_REQUESTS * 77 == 4928
    assert shared.num_used_blocks == 75 + NUM_REQUESTS * 2 == 203
    assert prefix_without == NUM_REQUESTS * prefix_blocks * bpb == 25_165_824_000
    assert prefix_with == prefix_blocks * bpb == 393_216_000
    assert prefix_without / 1e9 == pytest.approx(25.17, abs=0.005)  # the seed's "24 GB"
    assert prefix_with / 1e9 == pytest.approx(0.393, abs=0.0005)  # the seed's "0.4 GB"
    assert suffix_used * bpb == 671_088_640  # + 2 private suffix blocks per request
    assert total_with == prefix_with + suffix_used * bpb == 1_064_304_640
    assert total_without - total_with == prefix_without - prefix_with == 24_772_608_000
    assert prefix_without // prefix_with == NUM_REQUESTS

    # The planner's closed form agrees with the manager's counts.
    plan = prefix_sharing_savings(load_model_spec("seed-70b"), PREFIX_LEN, NUM_REQUESTS)
    assert plan["bytes_without_sharing"] == prefix_without
    assert plan["bytes_with_sharing"] == prefix_with

    print(
        f"\nseed-70b, {NUM_REQUESTS} requests x {PREFIX_LEN}-token system prompt "
        f"(+{SUFFIX_LEN} own tokens), {bpb:,} B per {BLOCK_SIZE}-token block:\n"
        f"  prefix unshared: {prefix_without:,} B = {format_bytes(prefix_without)}\n"
        f"  prefix shared:   {prefix_with:,} B = {format_bytes(prefix_with)}\n"
        f"  suffix blocks:   {suffix_used * bpb:,} B = {format_bytes(suffix_used * bpb)}\n"
        f"  total KV: {format_bytes(total_without)} -> {format_bytes(total_with)}, "
        f"saved {format_bytes(total_without - total_with)}"
    )
