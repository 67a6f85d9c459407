"""The planning arithmetic: every figure here is checked against a hand calculation."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.errors import ConfigError
from kvledger.ledger import (
    PRESETS,
    ModelSpec,
    format_bytes,
    kv_bytes_per_token,
    load_model_spec,
    naive_vs_paged,
    parse_size,
    per_request_overhead_bytes,
    plan_capacity,
    prefix_sharing_savings,
)

GiB = 2**30


def test_seed_article_bytes_per_token():
    # 2 x 80 layers x kv heads x 128 x 2 bytes: GQA-8, MHA-64, MQA.
    assert kv_bytes_per_token(PRESETS["seed-70b"], "fp16").total == 327_680
    assert kv_bytes_per_token(PRESETS["seed-70b-mha"]).total == 2_621_440
    assert kv_bytes_per_token(PRESETS["seed-70b-mqa"]).total == 40_960


def test_llama_3_8b_bytes_per_token():
    assert kv_bytes_per_token(PRESETS["llama-3-8b"], "fp16").total == 131_072
    assert kv_bytes_per_token(PRESETS["llama-3-8b"], "auto").kv_dtype == "bf16"


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "fp8_int8"])
def test_quantised_bytes_count_one_fp16_scale_per_token_per_kv_head(kv_dtype):
    spec = PRESETS["llama-3-8b"]
    kv = kv_bytes_per_token(spec, kv_dtype)
    assert kv.data_bytes == 2 * 32 * 8 * 128 * 1 == 65_536
    assert kv.scale_bytes == 2 * 32 * 8 * 2 == 1_024
    assert kv.total == 66_560


def test_tp_splits_kv_heads_and_replicates_past_them():
    spec = PRESETS["seed-70b"]
    assert kv_bytes_per_token(spec, tp=2).total == 327_680 // 2
    assert kv_bytes_per_token(spec, tp=8).total == 327_680 // 8
    assert kv_bytes_per_token(spec, tp=16).total == 327_680 // 8  # 8 kv heads, 16 ranks
    with pytest.raises(ConfigError, match="does not divide"):
        kv_bytes_per_token(spec, tp=3)
    plan = plan_capacity(spec, parse_size("80GiB"), tp=2)
    assert plan.weight_bytes == 70_000_000_000  # 140 GB of fp16 weights over 2 ranks


def _small_spec(**kw) -> ModelSpec:
    base = dict(
        name="small",
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        hidden_size=32,
        vocab_size=100,
        num_params=1000,
        dtype="float16",
    )
    return ModelSpec(**{**base, **kw})


def test_capacity_arithmetic_by_hand():
    # 2 x 2 layers x 2 kv heads x 8 x 2 B = 128 B/token; 4-token blocks = 512 B.
    # budget = 20000 x 0.5 - 1000 params x 2 B - 500 reserve = 7500 -> 14 blocks (7168 B).
    plan = plan_capacity(
        _small_spec(), 20_000, 0.5, block_size=4, context_len=10, activation_reserve_bytes=500
    )
    assert (plan.bytes_per_token, plan.bytes_per_block) == (128, 512)
    assert (plan.weight_bytes, plan.kv_budget_bytes) == (2000, 7500)
    assert (plan.num_blocks, plan.max_tokens) == (14, 56)
    assert plan.blocks_per_request == 3  # 10 tokens -> 3 blocks of 4
    assert plan.max_concurrency == 7500 // 1536 == 4
    assert plan.request_cost_bytes(8) == 1024 and plan.request_cost_bytes(9) == 1536
    assert plan.to_dict()["num_blocks"] == 14


def test_capacity_counts_scales_and_sink_copies_for_quantised_kv():
    # int8: 64 data + 16 scale B/token, 320 B/block; (4 sink + 2 recent) x 128 B fp16 = 768 B.
    spec = _small_spec()
    assert per_request_overhead_bytes(spec, "int8", 4, 2) == 768
    assert per_request_overhead_bytes(spec, "fp16", 4, 2) == 0
    plan = plan_capacity(
        spec,
        20_000,
        0.5,
        block_size=4,
        context_len=10,
        kv_dtype="int8",
        activation_reserve_bytes=500,
        kv_sink_tokens=4,
        kv_recent_tokens=2,
    )
    assert (plan.bytes_per_token, plan.scale_bytes_per_token, plan.bytes_per_block) == (80, 16, 320)
    assert plan.num_blocks == 7500 // 320 == 23
    assert plan.max_concurrency == 7500 // (3 * 320 + 768) == 4


def test_model_that_does_not_fit_reports_the_shortfall_in_gib():
    with pytest.raises(ConfigError, match=r"short by \d+\.\d\d GiB"):
        plan_capacity(PRESETS["seed-70b"], parse_size("80GiB"))  # 140 GB on one 80 GiB card
    with pytest.raises(ConfigError, match="short by"):  # fits the weights, not one request
        plan_capacity(_small_spec(), 3000, 1.0, block_size=4, context_len=10)


@pytest.mark.parametrize(
    "kw",
    [
        dict(memory_fraction=0),
        dict(memory_fraction=1.5),
        dict(device_memory_bytes=0),
        dict(block_size=0),
        dict(context_len=-1),
        dict(weight_bytes=-5),
        dict(kv_dtype="int4"),
        dict(tp=0),
    ],
)
def test_plan_rejects_bad_input(kw):
    args = dict(device_memory_bytes=10**9) | kw
    with pytest.raises(ConfigError):
        plan_capacity(_small_spec(), **args)


def test_from_hf_config_defaults_to_mha_and_hidden_over_heads():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 10}
    spec = ModelSpec.from_hf_config(cfg, name="x")
    assert (spec.num_kv_heads, spec.head_dim, spec.dtype) == (4, 16, "float32")
    spec = ModelSpec.from_hf_config(
        {**cfg, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "bfloat16"}
    )
    assert (spec.num_kv_heads, spec.head_dim, spec.dtype) == (2, 32, "bfloat16")
    assert ModelSpec.from_hf_config({**cfg, "dtype": "float16"}).dtype == "float16"


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "hidden_size"])
def test_from_hf_config_names_missing_or_bad_fields(field):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 10}
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_config({k: v for k, v in cfg.items() if k != field})
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_config({**cfg, field: 0})


def test_param_estimate_matches_published_llama_3_8b():
    cfg = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    assert ModelSpec.from_hf_config(cfg).num_params == PRESETS["llama-3-8b"].num_params


def test_tiny_preset_is_the_engine_default_model():
    s = PRESETS["kvledger-tiny"]
    assert (
        s.num_layers,
        s.hidden_size,
        s.num_attention_heads,
        s.num_kv_heads,
        s.head_dim,
        s.intermediate_size,
        s.vocab_size,
        s.dtype,
        s.max_position_embeddings,
    ) == (4, 256, 8, 2, 32, 688, 512, "float32", 2048)


def test_safetensors_weight_bytes_come_from_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {
        "a": torch.zeros(3, 5, dtype=torch.float16),
        "b": torch.zeros(7, dtype=torch.float32),
        "c": torch.zeros(2, 2, 2, dtype=torch.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = sum(t.numel() * t.element_size() for t in tensors.values())
    assert load_model_spec(str(tmp_path)).weight_bytes == expected == 30 + 28 + 16
    assert load_model_spec(str(tmp_path / "config.json")).weight_bytes == expected
    plan = plan_capacity(load_model_spec(str(tmp_path)), 10**6, block_size=4, context_len=8)
    assert (plan.weight_bytes, plan.weight_source) == (expected, "checkpoint")


def test_load_model_spec_errors(tmp_path):
    with pytest.raises(ConfigError, match="seed-70b"):  # lists the presets
        load_model_spec("no-such-model")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_model_spec(str(tmp_path))
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 8)
    bad.write_text(
        json.dumps(
            {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 4}
        )
    )
    with pytest.raises(ConfigError, match="broken.safetensors"):
        load_model_spec(str(tmp_path))


def test_naive_vs_paged_by_hand():
    r = naive_vs_paged([300, 16, 17], max_seq_len=4096, block_size=16, bytes_per_token=2)
    assert r["naive_reserved_tokens"] == 3 * 4096
    assert r["paged_reserved_tokens"] == 304 + 16 + 32
    assert r["naive_utilization"] == 333 / (3 * 4096)
    assert r["paged_utilization"] == 333 / 352
    assert r["paged_waste_bytes"] == (352 - 333) * 2
    assert r["max_paged_waste_tokens_per_request"] == 15
    with pytest.raises(ConfigError, match="5000"):
        naive_vs_paged([5000], 4096, 16, 2)


@given(block_size=st.integers(1, 64), blocks=st.integers(1, 64), data=st.data())
def test_paged_never_worse_than_naive_and_wastes_under_one_block(block_size, blocks, data):
    max_seq_len = block_size * blocks
    lengths = data.draw(st.lists(st.integers(1, max_seq_len), min_size=1, max_size=40))
    r = naive_vs_paged(lengths, max_seq_len, block_size, bytes_per_token=7)
    assert r["naive_utilization"] <= r["paged_utilization"]
    assert r["max_paged_waste_tokens_per_request"] < block_size
    assert r["paged_waste_tokens"] < block_size * len(lengths)


def test_prefix_sharing_matches_the_seed_example():
    # Seed: 1,200-token system prompt x 64 requests, "24 GB -> 0.4 GB"; exactly:
    r = prefix_sharing_savings(PRESETS["seed-70b"], 1200, 64)
    assert r["bytes_without_sharing"] == 1200 * 327_680 * 64 == 25_165_824_000
    assert r["bytes_with_sharing"] == 1200 * 327_680 == 393_216_000
    assert math.isclose(r["gib_without_sharing"], 23.4375)
    # A partial last block cannot be shared: 1201 tokens = 75 shared blocks + 1 private each.
    r = prefix_sharing_savings(PRESETS["seed-70b"], 1201, 64)
    assert r["bytes_with_sharing"] == (75 + 64) * 16 * 327_680


@pytest.mark.parametrize(
    "text,expected",
    [
        ("80GiB", 80 * GiB),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1_500_000_000_000),
        ("123", 123),
        ("4 KiB", 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80G", "-1GiB", "garbage", "1.5", "", "12 GBs", "GiB"])
def test_parse_size_rejects_ambiguous_negative_and_garbage(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_format_bytes_prints_both_conventions():
    assert format_bytes(80 * 10**9) == "74.51 GiB (80.00 GB)"
    assert format_bytes(327_680) == "320.00 KiB (327.68 KB)"
    assert format_bytes(100) == "100 B"


def test_accounting_and_plan_do_not_import_torch():
    code = (
        "import sys, kvledger.ledger.accounting, kvledger.cli, kvledger.commands.plan; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
