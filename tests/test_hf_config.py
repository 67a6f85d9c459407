"""A model folder's configuration is read in one torch-free place, kvledger/hf/config.py: the
planner's spec and the loader's model config come from the same reading, and no other module
picks fields out of a config dict."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.hf import config as hf
from kvledger.ledger.spec import DTYPE_BYTES, ModelSpec, load_model_spec
from kvledger.model.loader import load_model, resolve_dtype
from tests.model_factory import build_hf_model, tiny_config

ROOT = Path(__file__).resolve().parents[1]
KINDS = [
    "llama_gqa",
    "qwen2",
    "qwen3",
    "mistral_window",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
]
# Fields only a config.json has: reading one of them is reading the HF config.
CONFIG_KEYS = {
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "tie_word_embeddings", "torch_dtype", "text_config", "layer_types",
    "sliding_window", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "eos_token_id",
    "quantization_config", "num_local_experts", "num_experts_per_tok", "hidden_act", "max_new_tokens",
}  # fmt: skip


def test_the_config_reader_and_the_planner_do_not_import_torch():
    code = (
        "import sys, kvledger.ledger.accounting, kvledger.hf.config, kvledger.cache.kv_cache_manager, "
        "kvledger.core.scheduler, kvledger.envs, kvledger.commands.plan; assert 'torch' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _config_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        key = None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
        ):
            key = (
                node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            )
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant)
        ):
            key = node.slice.value
        if key in CONFIG_KEYS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {key}")
    return found


def test_no_module_outside_hf_config_reads_config_fields():
    assert _config_reads(ROOT / "kvledger" / "hf" / "config.py"), "the scan finds nothing: broken"
    others = [
        r
        for p in sorted((ROOT / "kvledger").rglob("*.py"))
        if p.parent.name != "hf"
        for r in _config_reads(p)
    ]
    assert not others, others


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_is_built_on_the_planners_reading(kind, tmp_path):
    """ModelSpec (planner, ledger, engine) and ModelConfig (the model) agree on every shape field,
    read from the same config.json, and the loader's "auto" dtype is the planner's."""
    build_hf_model(tiny_config(kind), tmp_path)
    cfg = hf.read_json(tmp_path / "config.json")
    spec = load_model_spec(str(tmp_path))
    mc = hf.model_config_from_hf(cfg)
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (
        mc.num_layers,
        mc.num_heads,
        mc.num_kv_heads,
        mc.head_dim,
    )
    assert (spec.hidden_size, spec.vocab_size, spec.tie_word_embeddings, spec.architecture) == (
        mc.hidden_size,
        mc.vocab_size,
        mc.tie_word_embeddings,
        mc.architecture,
    )
    assert (spec.layer_types, spec.sliding_window) == (mc.layer_types, mc.sliding_window)
    assert str(resolve_dtype("auto", cfg)).removeprefix("torch.") == spec.dtype
    shape = hf.model_shape(cfg, spec.name)
    assert all(getattr(spec, f.name) == getattr(shape, f.name) for f in fields(shape))


def test_dtype_spellings_are_one_table():
    assert tuple(DTYPE_BYTES) == hf.DTYPES
    for spelling, name in [
        ("bf16", "bfloat16"),
        ("torch.float16", "float16"),
        ("half", "float16"),
        ("float", "float32"),
        ("fp32", "float32"),
        ("float8_e4m3fn", None),
    ]:
        assert hf.dtype_name(spelling) == name
    assert resolve_dtype("bf16", {}) == torch.bfloat16  # the planner's spellings load too
    with pytest.raises(ConfigError, match="unsupported torch_dtype 'int4'"):
        ModelSpec.from_hf_config(
            {
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "hidden_size": 8,
                "vocab_size": 8,
                "torch_dtype": "int4",
            }
        )


def test_generation_config_gives_stop_ids_and_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [7, 2],
                "temperature": 0.6,
                "top_p": 0.9,
                "max_new_tokens": 50,
                "top_k": None,
            }
        )
    )
    assert hf.eos_token_ids(tmp_path, {"eos_token_id": 2}) == [7, 2]
    assert hf.eos_token_ids(tmp_path / "none", {"eos_token_id": 3}) == [3]
    assert hf.generation_defaults(tmp_path, "auto") == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_tokens": 50,
    }
    assert hf.generation_defaults(tmp_path, "vllm") == {}
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="generation_config.json"):
        hf.generation_defaults(tmp_path, "auto")
    with pytest.raises(ConfigError, match="not valid JSON"):
        hf.eos_token_ids(tmp_path, {})


def test_a_loaded_model_keeps_the_readers_facts(tmp_path):
    build_hf_model(tiny_config("gemma3"), tmp_path)
    loaded = load_model(tmp_path, pack_linear=False)
    assert loaded.config == hf.model_config_from_hf(loaded.hf_config)
    assert loaded.eos_token_ids == hf.eos_token_ids(tmp_path, loaded.hf_config)
