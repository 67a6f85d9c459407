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

from benchmarks.gptq_checkpoint import pack_k, pack_n
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
            sd[f"{stem}.qweight"] = pack_k(codes)
            sd[f"{stem}.qzeros"] = pack_n(zeros - 1 if v1 else zeros)
            sd[f"{stem}.g_idx"] = g_idx.to(torch.int32)
        else:
            sd[f"{stem}.qweight"] = pack_n(codes, AWQ_ORDER)
            sd[f"{stem}.qzeros"] = pack_n(zeros, AWQ_ORDER)
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


@pytest.mark.parametrize(("method", "group", "run"), [("gptq", 128, 4), ("awq", 64, 2)])
def test_w4a8_tiles_hold_a_checkpoints_scales_once_a_group(tmp_path, monkeypatch, method, group, run):
    """With int8 activations (a bf16 model's default; here forced in a float32 model, so that every
    other op is exact float32 on both paths) the projections become W4A8 tiles (model/quant_q4.py)
    with one scale and zero per checkpoint group, not one per 32 columns (fewer bytes streamed,
    and the ledger's weight bytes say so); the native kernels give the torch reference's tokens."""
    from kvledger.kernels import native
    from kvledger.model.quant_q4 import Q4Weight

    cfg = LlamaConfig(
        vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    build_hf_model(cfg, tmp_path)
    write_checkpoint(tmp_path, method, group)
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 21)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run_engine():
        llm = LLM(str(tmp_path), dtype="float32", block_size=4, calibrate_preemption=False)
        model = llm.engine.executor.worker.model
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        return model, toks, llm.engine.executor.worker.ready.weight_bytes

    monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", "int8")
    model, fast, held = run_engine()
    tiles = [m.quant for m in model.modules() if isinstance(getattr(m, "quant", None), Q4Weight)]
    assert len(tiles) == 8 and all(1 << w.sgs == run for w in tiles)
    # codes half a byte a weight, an fp16 scale and a uint8 zero per group (rows padded to 16)
    projections = sum(-(-w.n // 16) * 16 * (w.shape[1] // 2 + w.shape[1] // group * 3) for w in tiles)
    floats = sum(p.numel() * 4 for n, p in model.named_parameters() if "quant_" not in n and p.dtype == torch.float32)
    assert held == projections + floats
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    try:
        _, ref, _ = run_engine()
    finally:
        monkeypatch.delenv("KVLEDGER_NATIVE")
        native.library.cache_clear()
    assert fast == ref
