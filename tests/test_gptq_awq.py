"""GPTQ and AWQ 4-bit checkpoints (model/packed_int4.py): random-weight Llamas quantised and
packed here as AutoGPTQ / AutoAWQ pack them (written from their formats, not from kvledger's
reader), then kvledger's greedy tokens against transformers running the dequantised weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_exact import hf_greedy
from transformers import LlamaConfig

from kvledger import LLM, SamplingParams
from tests.model_factory import build_hf_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantise(w: torch.Tensor, group: int, g_idx: torch.Tensor):
    """Asymmetric 4-bit per group of input columns: (codes [K, N], zeros [G, N], scales [G, N])
    and the weight they stand for."""
    n, k = w.shape
    groups = k // group
    codes = torch.empty(k, n, dtype=torch.int32)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        block = w[:, cols].float()
        lo, hi = block.amin(1), block.amax(1)
        s = ((hi - lo) / 15).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).int()
        codes[cols] = (torch.round(block / s.float()[:, None]) + z[:, None]).clamp(0, 15).int().T
        zeros[g], scales[g] = z, s
    deq = (codes - zeros[g_idx]).float() * scales[g_idx].float()  # [K, N]
    return codes, zeros, scales, deq.T.contiguous()


def _pack_k(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: eight codes along K per int32, low bits first."""
    k, n = codes.shape
    c = codes.reshape(k // 8, 8, n)
    return sum(c[:, j] << (4 * j) for j in range(8)).to(torch.int32)


def _pack_n(codes: torch.Tensor, order=None) -> torch.Tensor:
    """Eight codes along N per int32 (AWQ: nibble i holds column order[i] of its eight)."""
    r, n = codes.shape
    c = codes.reshape(r, n // 8, 8)
    order = order or list(range(8))
    return sum(c[:, :, order[i]] << (4 * i) for i in range(8)).to(torch.int32)


def write_checkpoint(folder, method: str, group: int, desc_act: bool = False, v1: bool = True):
    """Quantise the folder's projections in place of their float weights; returns the dequantised
    state dict (the oracle's weights)."""
    sd = load_file(str(folder / "model.safetensors"))
    oracle = dict(sd)
    for name in list(sd):
        if not any(f"{p}.weight" in name for p in LINEARS):
            continue
        w = sd.pop(name)
        n, k = w.shape
        g_idx = torch.arange(k) // group
        if desc_act:  # act order follows the input: q/k/v share one, gate/up another
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            g = torch.Generator().manual_seed(sum(map(ord, shared)))
            g_idx = g_idx[torch.randperm(k, generator=g)]
        codes, zeros, scales, deq = _quantise(w, group, g_idx)
        stem = name.removesuffix(".weight")
        if method == "gptq":
            sd[f"{stem}.qweight"] = _pack_k(codes)
            sd[f"{stem}.qzeros"] = _pack_n(zeros - 1 if v1 else zeros)
            sd[f"{stem}.g_idx"] = g_idx.to(torch.int32)
        else:
            sd[f"{stem}.qweight"] = _pack_n(codes, AWQ_ORDER)
            sd[f"{stem}.qzeros"] = _pack_n(zeros, AWQ_ORDER)
        sd[f"{stem}.scales"] = scales
        oracle[name] = deq
    save_file(sd, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "gptq":
        qc |= {"desc_act": desc_act, "sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        qc |= {"zero_point": True, "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    return oracle


@pytest.mark.parametrize(
    ("method", "group", "desc_act", "v1"),
    [("gptq", 128, False, True), ("gptq", 64, True, True), ("gptq", 32, False, False), ("awq", 128, False, True)],
)
def test_a_packed_4bit_checkpoint_runs_as_transformers_runs_its_dequantised_weights(tmp_path, method, group, desc_act, v1):
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf = build_hf_model(cfg, tmp_path)
    oracle = write_checkpoint(tmp_path, method, group, desc_act, v1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(oracle[name])
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, calibrate_preemption=False)
    lin = llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert lin.quant is not None and lin.quant.zero is not None and (lin.quant.perm is not None) == desc_act
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):  # the 40-token prompt's prefill takes the dequantising path
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), p
