"""W4A8 (model/quant_q4.py, csrc/q4_gemm.c): 4-bit group-wise weights repacked into tiles and
multiplied with int8 activations per group of 32. The tiles hold exactly the group-wise weight's
values; the native kernel gives the torch reference's bits in every build this CPU runs; which
models take the path; and the engine on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.kernels import native
from kvledger.model import quant_q4
from kvledger.model.quant_group import GroupWeight, dequantize, quantize_weight
from kvledger.model.quant_q4 import Q4Weight, pack, quantize_act, reference_gemm

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


def _weight(n: int, k: int, seed: int, zeros: bool = False, perm: bool = False, bits: int = 4) -> GroupWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 8:  # GGUF Q8_0's values: any int8 code (-128 too), fp16 scales
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        codes[0, :4] = torch.tensor([127, 127, -128, -128], dtype=torch.int8)
        return GroupWeight(codes, (torch.rand(n, k // 32, generator=g) * 0.1).half().float(), 8)
    w = quantize_weight(torch.randn(n, k, generator=g))
    zero = torch.randint(0, 16, (n, k // 32), generator=g, dtype=torch.uint8) if zeros else None
    order = torch.randperm(k, generator=g) if perm else None
    return GroupWeight(w.q, w.scale, 4, zero, order)


@pytest.mark.parametrize(("n", "k", "zeros", "bits"), [(16, 32, False, 4), (37, 96, True, 4), (5, 64, False, 4),
                                                       (48, 128, True, 4), (37, 96, False, 8)])
def test_tiles_hold_the_group_weights_values(n, k, zeros, bits):
    gw = _weight(n, k, seed=n, zeros=zeros, bits=bits)
    t = pack(gw)
    assert t.q.shape == (-(-n // 16), k // 32, 64 * bits) and t.scale.dtype == torch.int16
    assert torch.equal(t.dequantize(), dequantize(gw))
    if not zeros:
        assert t.zero is None
    # A weight whose scales are not fp16 values has no tiles (it keeps the float-activation path).
    odd = GroupWeight(gw.q, gw.scale + 1e-6, bits)
    assert not quant_q4.eligible(odd)
    with pytest.raises(ValueError, match="fp16 scales"):
        pack(odd)


def test_the_reference_is_close_to_the_float_product():
    """int8 activations per group of 32 cost ~1 % of a product's size, not more."""
    gw = _weight(64, 256, seed=1)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    y = reference_gemm(x, pack(gw), None)
    want = F.linear(x, dequantize(gw))
    assert (y - want).norm() / want.norm() < 0.02
    q, s, sums = quantize_act(x)
    assert torch.equal(sums, q.view(6, 8, 32).sum(-1, dtype=torch.int32))
    assert ((q.float().view(6, 8, 32) * s[..., None]).view(6, 256) - x).abs().max() <= s.max() / 2 + 1e-6


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "zeros", "bias", "bits"),
                         [(1, 40, 64, False, False, 4), (5, 33, 96, True, True, 4), (17, 64, 1024, False, True, 4),
                          (3, 16, 32, True, False, 4), (1, 40, 64, False, False, 8), (6, 33, 96, False, True, 8)])
def test_native_w4a8_is_the_reference_bit_for_bit(isa, dtype, m, n, k, zeros, bias, bits):
    """4 bits (W4A8) and 8 bits (GGUF Q8_0 x int8 groups: vpdpbusd on VNNI, the sign trick on
    the builds without it, whose int16 pairs would otherwise saturate on code -128)."""
    g = torch.Generator().manual_seed(m * 7 + n)
    w = pack(_weight(n, k, seed=k, zeros=zeros, bits=bits))
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # a group of zeros: scale 1, codes 0
    x[-1, :32] = 100.0  # codes 127 against weight codes 127 and -128: the largest pair products
    x[-1, 2:4] = -100.0
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    xq, xs, xsum = native.q4_quantize_act(x)
    rq, rs, rsum = quantize_act(x)
    assert torch.equal(xq, rq) and torch.equal(xs, rs) and torch.equal(xsum, rsum)
    y = native.q4_gemm(xq, xs, xsum, w.q, w.scale, w.zero, n, b, dtype, bits)
    assert torch.equal(y, reference_gemm(x, w, b))
    # One row's result does not depend on the rows beside it.
    assert torch.equal(native.q4_gemm(xq[-1:], xs[-1:], xsum[-1:], w.q, w.scale, w.zero, n, b, dtype, bits), y[-1:])
    assert torch.equal(native.q4_dequantize(w.q, w.scale, w.zero, n, dtype, bits), w.dequantize(dtype))


@needs_native
def test_gptq_act_order_columns_are_gathered_first():
    """A weight whose groups hold permuted columns (GPTQ desc_act): q4_linear multiplies x[:, perm]."""
    gw = _weight(32, 128, seed=4, perm=True)
    w = pack(gw)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = quant_q4.q4_linear(x, w, None)
    assert torch.equal(got, reference_gemm(x.index_select(1, gw.perm), w, None))


@pytest.mark.parametrize(
    ("dtype", "env", "tiles"),
    [(torch.bfloat16, None, True), (torch.float32, None, False), (torch.float32, "int8", True),
     (torch.bfloat16, "float", False)],
)  # fmt: skip
def test_which_models_take_w4a8(tmp_path, monkeypatch, dtype, env, tiles):
    """bf16 models multiply 4-bit weights with int8 activations, float32 models with float ones
    (exact against the dequantised weights); KVLEDGER_INT4_ACTIVATIONS overrides either way."""
    from kvledger.model.loader import load_model
    from tests.model_factory import build_hf_model, tiny_config

    if env:
        monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", env)
    build_hf_model(tiny_config("llama_gqa"), tmp_path)
    layer = load_model(tmp_path, dtype=dtype, quantization="int4").model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant, Q4Weight) == tiles
    assert isinstance(layer.mlp.gate_up_proj.quant, Q4Weight if tiles else GroupWeight)


def test_a_bad_activation_choice_is_refused(monkeypatch):
    from kvledger import envs
    from kvledger.errors import ConfigError

    monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", "int3")
    with pytest.raises(ConfigError, match="KVLEDGER_INT4_ACTIVATIONS must be one of auto, int8, float"):
        envs.KVLEDGER_INT4_ACTIVATIONS  # noqa: B018


@needs_native
def test_native_and_reference_w4a8_engines_give_the_same_tokens(stories_path, monkeypatch):
    """stories260k in W4A8 (float32 activations quantised, so the reference path is exact torch
    arithmetic): the engine on the native kernels and on the torch reference, same tokens (the
    quality cost is benchmarks/quant_quality.py's perplexity)."""
    from kvledger import LLM, SamplingParams

    prompts = ["Once upon a time", "The little dog", "Lily wanted to"]
    sp = SamplingParams(temperature=0, max_tokens=40)

    def tokens(**kw):
        llm = LLM(str(stories_path), calibrate_preemption=False, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", "int8")
    fast = tokens(quantization="int4")
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    try:
        ref = tokens(quantization="int4")
    finally:
        monkeypatch.delenv("KVLEDGER_NATIVE")
        native.library.cache_clear()
    assert fast == ref


@needs_native
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 64), (6, 33, 256)])
def test_native_q4_k_is_the_reference_bit_for_bit(isa, m, n, k):
    """GGUF Q4_K's groups (nibble x scale - min, float32 scales and mins) in the tiles."""
    from kvledger.model.quant_q4 import pack_k

    g = torch.Generator().manual_seed(n)
    nib = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    mins = torch.rand(n, k // 32, generator=g) * 0.05
    w = pack_k(nib, scale, mins)
    want = (nib.float().view(n, k // 32, 32) * scale[..., None] - mins[..., None]).view(n, k)
    assert torch.equal(w.dequantize(), want)
    assert torch.equal(native.q4_dequantize(w.q, w.scale, None, n, torch.float32, 4, w.mins), want)
    x = torch.randn(m, k, generator=g).bfloat16()
    xq, xs, xsum = native.q4_quantize_act(x)
    y = native.q4_gemm(xq, xs, xsum, w.q, w.scale, None, n, None, torch.bfloat16, 4, w.mins)
    assert torch.equal(y, reference_gemm(x, w, None))
    assert (y.float() - F.linear(x.float(), want)).norm() / F.linear(x.float(), want).norm() < 0.02
