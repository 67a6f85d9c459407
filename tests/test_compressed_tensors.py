"""llm-compressor's compressed-tensors checkpoints: INT8 W8A8 run as they are (the same arithmetic
as quantization="int8" on the float weights), FP8 dequantised on load (transformers on the
dequantised weights is the oracle), other schemes refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_exact import hf_greedy
from transformers import LlamaConfig

from benchmarks.w8a8_checkpoint import write_w8a8_checkpoint
from kvledger import LLM, SamplingParams
from kvledger.errors import ConfigError
from kvledger.model.quant_int8 import quantize_weight
from tests.model_factory import build_hf_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CFG = LlamaConfig(
    vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
W8A8 = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
}
FP8 = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}


def _convert(src, dst, scheme: dict, fmt: str, convert) -> dict:
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    oracle = dict(sd)
    for name in list(sd):
        if any(f"{p}.weight" in name for p in LINEARS):
            sd[name], sd[name.replace(".weight", ".weight_scale")], oracle[name] = convert(sd[name])
    save_file(sd, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": {"targets": ["Linear"], **scheme}}, "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    return oracle


def _tokens(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5, 17, 33, 8], list(range(3, 40))]


def test_an_int8_w8a8_checkpoint_is_the_on_the_fly_w8a8_of_its_float_model(tmp_path):
    build_hf_model(CFG, tmp_path / "float")

    def w8a8(w):  # kvledger's own codes (max/127), so the two models hold the same weights
        q = quantize_weight(w)
        return q.codes().clone(), q.scale[:, None].clone()

    # written as llm-compressor writes it: its whole quantization_config, no zero points
    write_w8a8_checkpoint(tmp_path / "float", tmp_path / "ct", quantize=w8a8)
    ct = LLM(str(tmp_path / "ct"), dtype="float32", calibrate_preemption=False)
    fly = LLM(str(tmp_path / "float"), dtype="float32", quantization="int8", calibrate_preemption=False)
    a = ct.engine.executor.worker.model.model.layers[1].mlp.gate_up_proj
    b = fly.engine.executor.worker.model.model.layers[1].mlp.gate_up_proj
    assert a.weight.dtype == torch.int8 and torch.equal(a.weight, b.weight) and torch.equal(a.quant.scale, b.quant.scale)
    assert _tokens(ct, PROMPTS) == _tokens(fly, PROMPTS)


def test_an_fp8_checkpoint_runs_as_transformers_runs_its_dequantised_weights(tmp_path):
    hf = build_hf_model(CFG, tmp_path / "float")

    def fp8(w):
        s = w.abs().amax(1, keepdim=True) / 448.0
        q = (w / s).to(torch.float8_e4m3fn)
        return q, s, q.float() * s

    oracle = _convert(tmp_path / "float", tmp_path / "ct", FP8, "float-quantized", fp8)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(oracle[name])
    llm = LLM(str(tmp_path / "ct"), dtype="float32", calibrate_preemption=False)
    for p, got in zip(PROMPTS, _tokens(llm, PROMPTS), strict=True):
        assert got == hf_greedy(hf, p, 20)


@pytest.mark.parametrize(
    ("scheme", "match"),
    [
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}, "weights .* are not supported"),
        ({"weights": W8A8["weights"]}, "need dynamic per-token symmetric int8 activations"),
    ],
)
def test_other_schemes_are_refused_by_name(tmp_path, scheme, match):
    build_hf_model(CFG, tmp_path / "float")
    _convert(tmp_path / "float", tmp_path / "ct", scheme, "pack-quantized", lambda w: (w, w[:, :1].clone(), w))
    with pytest.raises(ConfigError, match=match):
        LLM(str(tmp_path / "ct"), calibrate_preemption=False)
