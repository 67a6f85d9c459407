"""W8A8 on the fly (``quantization="int8"``): the native kernel against the torch reference of the
same arithmetic in every build this CPU runs, and the engine with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.kernels import native, native_quant
from kvledger.model.quant_int8 import int8_gemm_reference, quantize_rows, quantize_weight

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_quantisation_is_the_reference_bit_for_bit(int_dot_isa, dtype):
    """203 columns: 25 vectors of 8 (csrc/act_quant.h), then a scalar tail of 3."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 203, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[2] = 0  # a zero row: scale 1, codes 0
    x[3, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # halves round to even
    x[3, 4:] = 0
    x[4, -1] = 1e4  # the row's maximum in the tail
    q, s = native_quant.quantize_rows_i8(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(s, rs) and torch.equal(q, rq)
    assert s[2] == 1 and not q[2].any()
    assert q[3, :4].tolist() == [127, 0, -0, 2]


@needs_native
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 64), (3, 7, 520), (4, 9, 100), (5, 130, 8), (17, 33, 200), (2, 5, 30)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_gemm_is_the_reference_bit_for_bit(int_dot_isa, out, m, n, k, bias):
    """Integer sums are exact, so VNNI (u8 x s8 with the row-sum correction), the int16 pairs of
    the other builds and torch's int64 matmul agree to the bit, tails of K and of the 4x4 tiles
    included."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    wf = torch.randn(n, k, generator=g)
    w = quantize_weight(wf)
    x = torch.randn(m, k, generator=g).to(out)
    b = torch.randn(n, generator=g).to(out) if bias else None
    xq, xs = quantize_rows(x)
    xq[0, : min(k, 8)] = -127  # extreme codes: the VNNI shift's largest products
    assert torch.equal(w.codes(), quantize_rows(wf)[0])  # the tiled layout (rows to 16, columns to 4) round-trips
    got = native_quant.int8_gemm(xq, xs, w.q, w.scale, w.wsum, b, out)
    want = int8_gemm_reference(xq, xs, w, b, out)
    assert got.dtype == out and torch.equal(got, want)


def test_the_reference_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(7)
    wf, x = torch.randn(96, 256, generator=g), torch.randn(12, 256, generator=g)
    xq, xs = quantize_rows(x)
    y = int8_gemm_reference(xq, xs, quantize_weight(wf), None, torch.float32)
    ref = x @ wf.T
    assert (y - ref).norm() / ref.norm() < 0.02  # int8 on both sides: ~1 % relative error


def _tokens(llm, prompts, n=40):
    from kvledger import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to"]


def test_an_int8_engine_holds_int8_weights_and_keeps_the_float_models_greedy_text(stories_path):
    """stories260k in W8A8: its layer weights are held as int8 (the ledger's weight bytes fall by
    more than half), and greedy decoding of three prompts for 40 tokens matches the float model's
    on at least two of them (W8A8's error, ~1 % of a product, rarely flips an argmax here)."""
    from kvledger import LLM

    ref = LLM(str(stories_path), calibrate_preemption=False)
    q = LLM(str(stories_path), quantization="int8", calibrate_preemption=False)
    layer = q.engine.executor.worker.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.int8 and layer.mlp.down_proj.quant is not None
    assert q.engine.executor.worker.ready.weight_bytes < 0.5 * ref.engine.executor.worker.ready.weight_bytes
    same = sum(a == b for a, b in zip(_tokens(ref, PROMPTS), _tokens(q, PROMPTS), strict=True))
    assert same >= 2


@needs_native
def test_native_and_reference_int8_engines_give_the_same_tokens(stories_path, monkeypatch):
    from kvledger import LLM

    native_tokens = _tokens(LLM(str(stories_path), quantization="int8", calibrate_preemption=False), PROMPTS)
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    try:
        ref_tokens = _tokens(LLM(str(stories_path), quantization="int8", calibrate_preemption=False), PROMPTS)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native_tokens == ref_tokens


def test_unsupported_quantization_is_refused_with_the_supported_list(stories_path):
    from kvledger import LLM

    with pytest.raises(ConfigError, match="quantization must be one of int8, int4; got 'int3'"):
        LLM(str(stories_path), quantization="int3")
    out = subprocess.run(
        [sys.executable, "-m", "kvledger", "generate", str(stories_path), "--quantization", "gptq", "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "--quantization" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("method", "source", "dtype"),
    [("int8", "int8 (W8A8)", "float32"), ("int4", "int4 (groups of 32)", "float32"),
     ("int4", "int4 (groups of 32)", "bfloat16")],  # bf16: W4A8 tiles, fp16 scales, rows padded to 16
)  # fmt: skip
def test_plan_counts_the_quantised_weights_the_engine_holds(stories_path, method, source, dtype):
    """`kvledger plan --quantization` predicts the weight bytes the live engine reports, to the
    byte (int8's tile padding and the int4 projection kept in float32 included), and the tokens
    and requests its smaller weights leave for KV."""
    import json

    from kvledger import LLM

    out = subprocess.run(
        [sys.executable, "-m", "kvledger", "plan", "--model", str(stories_path), "--quantization", method,
         "--dtype", dtype, "--device-memory", "4MiB", "--memory-fraction", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout)
    live = LLM(str(stories_path), quantization=method, dtype=dtype, calibrate_preemption=False)
    assert f["weight_bytes"] == live.engine.executor.worker.ready.weight_bytes
    assert f["weight_source"] == f"checkpoint, {source}"
    q = f["quantization"]
    assert q["unquantized_weight_bytes_per_rank"] > f["weight_bytes"] and q["extra_tokens"] > 0
    plain = LLM(str(stories_path), dtype=dtype, calibrate_preemption=False)
    assert q["unquantized_weight_bytes_per_rank"] == plain.engine.executor.worker.ready.weight_bytes
