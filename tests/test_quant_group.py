"""4-bit weights on the fly (``quantization="int4"``): the format's values, the native kernels
against the torch reference in every build this CPU runs, and the engine against transformers
running the dequantised weights."""

from __future__ import annotations

import math

import pytest
import torch

from kvledger.kernels import native, native_quant
from kvledger.model.quant_group import GROUP, GroupWeight, dequantize, pack_nibbles, quantize_weight

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


def _q8(n: int, k: int, seed: int) -> GroupWeight:
    """An 8-bit group-wise weight (GGUF Q8_0's values): random codes, scales."""
    g = torch.Generator().manual_seed(seed)
    return GroupWeight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, k // 32, generator=g) * 0.1, 8)


def test_codes_scales_and_nibble_order_follow_the_format():
    w = torch.zeros(2, 64)
    w[0, :32] = torch.arange(32) - 16.0  # one group: max |w| = 16, scale 16 / 7 rounded to fp16
    w[1, 32:] = 0.0  # a zero group keeps scale 1, codes 8
    q = quantize_weight(w)
    assert q.q.dtype == torch.uint8 and q.q.shape == (2, 32) and q.scale.shape == (2, 2)
    s = torch.tensor(16 / 7).half().float().item()  # Q4_0's scales are fp16; so are these
    assert q.scale[0, 0].item() == s != 16 / 7 and q.scale[1, 1] == 1
    codes = (torch.round((torch.arange(32) - 16.0) / q.scale[0, 0]).clamp(-8, 7) + 8).to(torch.uint8)
    assert torch.equal(q.q[0, :16], codes[:16] | (codes[16:] << 4))  # byte j: weights j and j + 16
    assert torch.equal(pack_nibbles(codes[None].to(torch.int32) - 8)[0], q.q[0, :16])
    assert torch.equal(q.q[1, 16:], torch.full((16,), 8 | 8 << 4, dtype=torch.uint8))
    deq = dequantize(q)
    assert (deq - w).abs().max() <= q.scale.max() / 2 + 1e-6  # round to nearest within a group


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequantisation_is_the_reference(isa, dtype):
    w = quantize_weight(torch.randn(37, 96, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(native_quant.group_dequantize(w.q, 4, w.scale, dtype), dequantize(w, dtype))
    w8 = _q8(37, 96, seed=3)
    assert torch.equal(native_quant.group_dequantize(w8.q, 8, w8.scale, dtype), dequantize(w8, dtype))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 32), (3, 7, 256), (4, 64, 96), (5, 33, 1024), (16, 9, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_register_kernel_matches_the_dequantised_product(isa, dtype, m, n, k, bias, bits):
    g = torch.Generator().manual_seed(m * 100 + n + k)
    w = quantize_weight(torch.randn(n, k, generator=g)) if bits == 4 else _q8(n, k, seed=m)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = native_quant.group_gemm(x, w.q, bits, w.scale, b)
    ref = x.double() @ dequantize(w).double().T + (b.double() if bias else 0)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, atol=1e-5 * math.sqrt(k), rtol=1e-5)
    else:  # one bf16 rounding of the float32 sum
        torch.testing.assert_close(got.double(), ref, atol=2e-2 * math.sqrt(k / 64), rtol=2**-7)
    # an output row depends only on its own input row
    assert torch.equal(native_quant.group_gemm(x[-1:], w.q, bits, w.scale, b), got[-1:])


def test_rows_not_a_multiple_of_the_group_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_weight(torch.randn(4, 48))
    assert GROUP == 32 and isinstance(quantize_weight(torch.randn(4, 64)), GroupWeight)


def test_an_int4_engine_is_transformers_running_the_dequantised_weights(stories_path):
    """float32 activations: kvledger's int4 stories260k gives the greedy tokens that transformers
    gives with every decoder-layer weight replaced by its dequantised int4 value (down_proj's rows,
    172 weights, are not whole groups of 32: it stays float32 in both), and holds the quantised
    weights in 4.625 bits each."""
    from test_engine_exact import hf_greedy
    from transformers import AutoModelForCausalLM

    from kvledger import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for lin in [*layer.self_attn.children(), *layer.mlp.children()]:
                if isinstance(lin, torch.nn.Linear) and lin.weight.shape[1] % GROUP == 0:
                    lin.weight.copy_(dequantize(quantize_weight(lin.weight)))
    llm = LLM(str(stories_path), quantization="int4", calibrate_preemption=False)
    plain = LLM(str(stories_path), calibrate_preemption=False)
    tok = llm.get_tokenizer()
    for prompt in ["Once upon a time", "The little dog", "Lily wanted to"]:
        ids = tok.encode(prompt)
        got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        assert got[0].outputs[0].token_ids == hf_greedy(hf, ids, 32), prompt
    layer = llm.engine.executor.worker.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant is not None and layer.mlp.down_proj.quant is None
    held = llm.engine.executor.worker.ready.weight_bytes
    assert held < 0.6 * plain.engine.executor.worker.ready.weight_bytes

