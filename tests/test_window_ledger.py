"""The ledger and `kvledger plan` per layer type (issue 20): full layers charge every token,
sliding-window layers their window; figures checked against hand computations."""

from __future__ import annotations

import json

import pytest

from kvledger.cli import main
from kvledger.errors import ConfigError
from kvledger.ledger.accounting import GiB, plan_capacity, request_kv
from kvledger.ledger.spec import PRESETS, ModelSpec


def test_gemma3_27b_32k_request_by_hand():
    spec = PRESETS["gemma-3-27b"]
    assert (spec.num_full_layers, spec.num_sliding_layers, spec.sliding_window) == (10, 52, 1024)
    assert spec.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    r = request_kv(spec, 32768, block_size=16)
    layer = 2 * 16 * 128 * 2  # K and V, 16 KV heads x 128, bf16: 8,192 B per token per layer
    assert r.layer_bytes_per_token == layer
    # Full layers: 2,048 blocks of 16 tokens. Sliding: when the last token (position 32,767)
    # is computed its query sees positions 31,744..32,767: blocks 1,984..2,047 = 64 blocks.
    full = 2048 * 16 * 10 * layer
    sliding = 64 * 16 * 52 * layer
    assert r.bytes_with_window_freeing == full + sliding == 3_120_562_176
    assert r.bytes_without_window_freeing == 2048 * 16 * 62 * layer == 16_642_998_272
    assert r.asymptotic_bytes_per_token == 10 * layer == 81_920
    assert r.bytes_per_token_at_context == (full + sliding) / 32768 == 95_232.0
    # kvledger's pool: KV cache groups of 10 layers (the full layers' count): 1 full group and
    # 52 / 10 -> 6 sliding groups, the last padded (2 layers used of 10). A block = 10 layers x
    # 16 tokens; the request holds 2,048 blocks in the full group and 64 in each sliding one.
    assert r.window_freeing and (r.group_size, r.full_groups, r.sliding_groups) == (10, 1, 6)
    assert r.pool_blocks == 2048 + 6 * 64 == 2432
    assert r.bytes == 2432 * 16 * 10 * layer == 3_187_671_040

    plan = plan_capacity(spec, 80 * GiB, context_len=32768, block_size=16)
    budget = int(80 * GiB * 0.9) - spec.num_params * 2
    assert plan.kv_budget_bytes == budget
    assert plan.bytes_per_block == 16 * 10 * layer and plan.blocks_per_request == 2432
    assert plan.num_blocks == budget // (16 * 10 * layer)
    assert plan.request_cost_bytes(32768) == 3_187_671_040
    assert plan.max_concurrency_with_window_freeing == budget // 3_120_562_176
    assert plan.max_concurrency_without_window_freeing == budget // 16_642_998_272
    assert plan.max_concurrency == budget // 3_187_671_040
    assert plan.max_concurrency_with_window_freeing >= 5 * plan.max_concurrency_without_window_freeing


def test_every_layer_sliding_is_charged_per_window_by_the_pool_itself():
    spec = ModelSpec("w", 4, 8, 2, 64, 512, 1000, dtype="float16", max_position_embeddings=65536,
                     layer_types=("sliding_attention",) * 4, sliding_window=100)
    assert spec.uniform_window == 100
    plan = plan_capacity(spec, 1 * GiB, context_len=10_000, block_size=16, weight_bytes=1)
    # One block: 16 tokens x 4 layers x 2 x 2 heads x 64 x 2 B = 32,768 B. The window: the
    # query at 9,999 sees 9,900..9,999, blocks 618..624 = 7 blocks.
    assert plan.bytes_per_block == 32_768
    assert plan.blocks_per_request == 7
    assert plan.max_concurrency == plan.max_concurrency_with_window_freeing == plan.kv_budget_bytes // (7 * 32_768)
    assert plan.asymptotic_bytes_per_token == 0  # no full layer: a long request costs a constant
    assert plan.request_cost_bytes(10_000) == 7 * 32_768


def test_plan_json_gives_asymptotic_and_context_figures(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    assert main(["plan", "--model", "gemma-3-27b", "--context-len", "32768", "--tp", "1",
                 "--device-memory", "80GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["asymptotic_bytes_per_token"] == 81_920
    assert out["bytes_per_token_at_context"] == 95_232.0
    assert out["request_bytes_with_window_freeing"] == 3_120_562_176
    assert out["max_concurrency_with_window_freeing"] > out["max_concurrency_without_window_freeing"]
    assert main(["plan", "--model", "gemma-3-27b", "--context-len", "32768", "--tp", "1"]) == 0
    text = capsys.readouterr().out
    assert "10 full + 52 sliding" in text and "window freed / not" in text
    assert "7 KV cache group(s) of 10 layers" in text


def test_simulator_releases_window_blocks_like_the_engine():
    """The simulator builds the engine's block manager: with a window of 64 a 2,000-token
    request runs in a 12-block pool (without it, it would need 129 blocks) and the pool never
    holds more than the window's blocks plus a prefill chunk's."""
    from kvledger.cache.attention_policy import cdiv
    from kvledger.config import CacheConfig, SchedulerConfig
    from kvledger.sim import Simulator, StepCostModel, TraceRequest

    sc = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=64)
    trace = [TraceRequest(0.0, 2000, 50)]
    cheap = StepCostModel(a=1e-3, b=1e-5, c=1e-8)
    result = Simulator(trace, sc, CacheConfig(block_size=16), 12, 1024, cheap, windows=[64]).run()
    assert result.requests[0].num_output_tokens == 50
    assert max(s.used_blocks for s in result.steps) <= cdiv(64 - 1 + 64, 16) + 1
    with pytest.raises(ConfigError, match="needs 126 KV blocks; the pool only has 12"):
        Simulator(trace, sc, CacheConfig(block_size=16), 12, 1024, cheap)  # no window


def test_simulator_frees_a_hybrid_models_sliding_groups():
    """One full and two sliding groups (window 64): a 2,000-token request holds 128 full-group
    blocks at its end plus at most a window and a chunk per sliding group; the pool of 150
    blocks would not even take its prompt without the groups (3 x 126)."""
    from kvledger.cache.attention_policy import cdiv
    from kvledger.config import CacheConfig, SchedulerConfig
    from kvledger.sim import Simulator, StepCostModel, TraceRequest

    sc = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=64)
    trace = [TraceRequest(0.0, 2000, 50)]
    cheap = StepCostModel(a=1e-3, b=1e-5, c=1e-8)
    sim = Simulator(trace, sc, CacheConfig(block_size=16), 150, 1024, cheap, windows=[None, 64, 64])
    result = sim.run()
    assert result.requests[0].num_output_tokens == 50
    window = cdiv(64 - 1 + 64, 16) + 1
    for s in result.steps:
        assert s.used_blocks <= cdiv(2050, 16) + 2 * window
        assert s.tokens_stored <= s.used_blocks * 16
    assert max(s.used_blocks for s in result.steps) >= cdiv(2000, 16)
