"""W4A8 (model/quant_q4.py, csrc/q4_gemm.c): 4-bit group-wise weights repacked into tiles and
multiplied with int8 activations per group of 32. The tiles hold exactly the group-wise weight's
values; the native kernel gives the torch reference's bits in every build this CPU runs; which
models take the path; and the engine on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvledger.kernels import native, native_quant
from kvledger.model import quant_q4
from kvledger.model.quant_group import GroupWeight, dequantize, quantize_weight
from kvledger.model.quant_q4 import Q4Weight, pack, quantize_act, reference_gemm

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


def _weight(n: int, k: int, seed: int, zeros: bool = False, perm: bool = False, bits: int = 4, run: int = 1) -> GroupWeight:
    """``run``: groups of 32 sharing a scale and zero (a GPTQ / AWQ checkpoint's group of 32 x run
    columns, as the loader holds it)."""
    g = torch.Generator().manual_seed(seed)
    if bits == 8:  # GGUF Q8_0's values: any int8 code (-128 too), fp16 scales
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        codes[0, :4] = torch.tensor([127, 127, -128, -128], dtype=torch.int8)
        scale = (torch.rand(n, k // 32 // run, generator=g) * 0.1).half().float()
        return GroupWeight(codes, scale.repeat_interleave(run, dim=1), 8)
    w = quantize_weight(torch.randn(n, k, generator=g))
    scale = w.scale[:, ::run].repeat_interleave(run, dim=1)
    zero = torch.randint(0, 16, (n, k // 32 // run), generator=g, dtype=torch.uint8).repeat_interleave(run, dim=1) if zeros else None
    order = torch.randperm(k, generator=g) if perm else None
    return GroupWeight(w.q, scale, 4, zero, order)


@pytest.mark.parametrize(("n", "k", "zeros", "bits", "run"), [(16, 32, False, 4, 1), (37, 96, True, 4, 1), (5, 64, False, 4, 1),
                                                              (48, 128, True, 4, 1), (37, 96, False, 8, 1),
                                                              (37, 256, True, 4, 4), (20, 128, False, 4, 2),
                                                              (17, 256, False, 8, 8)])  # fmt: skip
def test_tiles_hold_the_group_weights_values(n, k, zeros, bits, run):
    gw = _weight(n, k, seed=n, zeros=zeros, bits=bits, run=run)
    t = pack(gw)
    assert t.q.shape == (-(-n // 16), k // 32, 64 * bits) and t.scale.dtype == torch.int16
    assert 1 << t.sgs == run and t.scale.shape == (-(-n // 16), k // 32 // run, 16), "a scale a run of groups"
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
@pytest.mark.parametrize(("m", "n", "k", "zeros", "bias", "bits", "run"),
                         [(1, 40, 64, False, False, 4, 1), (5, 33, 96, True, True, 4, 1), (17, 64, 1024, False, True, 4, 1),
                          (3, 16, 32, True, False, 4, 1), (1, 40, 64, False, False, 8, 1), (6, 33, 96, False, True, 8, 1),
                          (1, 40, 512, True, False, 4, 4), (5, 33, 256, False, True, 4, 2), (3, 20, 256, False, False, 8, 4)])  # fmt: skip
def test_native_w4a8_is_the_reference_bit_for_bit(int_dot_isa, dtype, m, n, k, zeros, bias, bits, run):
    """4 bits (W4A8) and 8 bits (GGUF Q8_0 x int8 groups: vpdpbusd on VNNI, the sign trick on
    the builds without it, whose int16 pairs would otherwise saturate on code -128); ``run``: a
    scale per 64 or 128 columns, GPTQ's and AWQ's groups, held once a run."""
    g = torch.Generator().manual_seed(m * 7 + n)
    w = pack(_weight(n, k, seed=k, zeros=zeros, bits=bits, run=run))
    assert 1 << w.sgs == run
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # a group of zeros: scale 1, codes 0
    x[-1, :32] = 100.0  # codes 127 against weight codes 127 and -128: the largest pair products
    x[-1, 2:4] = -100.0
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    xq, xs, xsum = native_quant.q4_quantize_act(x)
    rq, rs, rsum = quantize_act(x)
    assert torch.equal(xq, rq) and torch.equal(xs, rs) and torch.equal(xsum, rsum)
    y = native_quant.q4_gemm(xq, xs, xsum, w, b, dtype)
    assert torch.equal(y, reference_gemm(x, w, b))
    # One row's result does not depend on the rows beside it.
    assert torch.equal(native_quant.q4_gemm(xq[-1:], xs[-1:], xsum[-1:], w, b, dtype), y[-1:])
    assert torch.equal(native_quant.q4_dequantize(w, dtype), w.dequantize(dtype))


def test_a_scale_is_held_once_a_run_only_where_every_row_repeats_it():
    """scale_run is exact: one row's scales differing between the halves of a run of 4 halve the
    run; a zero differing inside a pair leaves a scale a group."""
    gw = _weight(24, 512, seed=3, zeros=True, run=4)
    assert quant_q4.scale_run(gw) == 2
    scale = gw.scale.clone()
    scale[17, 6:8] *= 2  # groups 6 and 7: the second half of the second run of 4
    assert quant_q4.scale_run(GroupWeight(gw.q, scale, 4, gw.zero)) == 1
    zero = gw.zero.clone()
    zero[5, 1] ^= 1  # group 1 differs from group 0
    odd = GroupWeight(gw.q, gw.scale, 4, zero)
    assert quant_q4.scale_run(odd) == 0
    assert torch.equal(pack(odd).dequantize(), dequantize(odd))


def test_zero_points_that_are_all_8_are_not_held():
    """A symmetric GPTQ checkpoint stores a zero of 8 per group: the tiles drop them (the kernel's
    own 8), same values."""
    gw = _weight(40, 256, seed=6, run=4)
    sym = GroupWeight(gw.q, gw.scale, 4, torch.full_like(gw.scale, 8, dtype=torch.uint8))
    t = pack(sym)
    assert t.zero is None and t.sgs == 2
    assert torch.equal(t.dequantize(), dequantize(sym))


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


def _k_quant(kind: str, n: int, k: int, g: torch.Generator):
    """Random Q4_K / Q5_K / Q6_K values packed, and the weight they stand for (llama.cpp's formulas,
    written here from its dequantize_row_q*_K), codes at their extremes included."""
    from kvledger.model.quant_q4 import pack_k, pack_q6

    top = {"Q4_K": 16, "Q5_K": 32, "Q6_K": 64}[kind]
    codes = torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :2] = torch.tensor([top - 1, 0], dtype=torch.uint8)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half()
    if kind == "Q6_K":
        sub = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
        sub[0, 0] = -128
        per16 = d.float().repeat_interleave(16, dim=1) * sub.float()
        want = ((codes.float() - 32).view(n, k // 16, 16) * per16[..., None]).view(n, k)
        return pack_q6(codes, sub, d), want
    sc, m = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    dmin = (torch.rand(n, k // 256, generator=g) * 1e-2).half()
    scale = d.float().repeat_interleave(8, dim=1) * sc.float()
    mins = dmin.float().repeat_interleave(8, dim=1) * m.float()
    want = (codes.float().view(n, k // 32, 32) * scale[..., None] - mins[..., None]).view(n, k)
    return pack_k(codes, sc, m, d, dmin, kquant=kind), want


@needs_native
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 256), (6, 33, 512)])
def test_native_k_quants_are_the_reference_bit_for_bit(int_dot_isa, kind, m, n, k):
    """GGUF's K-quants in their own bits: Q4_K (nibble x d x sc - dmin x m), Q5_K (a fifth bit
    from its plane) and Q6_K ((code - 32) x d x sc, two high bits from their planes, sc per 16
    columns: the halves of a group weighted in integers). The tiles hold exactly the values, and
    the native kernel gives the reference's bits in every build (top codes against activations of
    127: the largest int16 pairs of the builds without VNNI)."""
    g = torch.Generator().manual_seed(n + k)
    w, want = _k_quant(kind, n, k, g)
    assert w.q.shape[2] == {"Q4_K": 256, "Q5_K": 320, "Q6_K": 384}[kind]  # 4, 5 or 6 bits a weight
    assert torch.equal(w.dequantize(), want)
    assert torch.equal(native_quant.q4_dequantize(w, torch.float32), want)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    x[-1, :16] = 100.0
    xq, xs, xsum = native_quant.q4_quantize_act(x)
    y = native_quant.q4_gemm(xq, xs, xsum, w, None, torch.bfloat16)
    assert torch.equal(y, reference_gemm(x, w, None))
    assert torch.equal(native_quant.q4_gemm(xq[-1:], xs[-1:], xsum[-1:], w, None, torch.bfloat16), y[-1:])
    assert (y.float() - F.linear(x.float(), want)).norm() / F.linear(x.float(), want).norm() < 0.02


@needs_native
def test_a_split_projection_writes_each_pieces_columns():
    """Q4_K_M's qkv: Q4_K, Q4_0 and Q6_K pieces of one fused product, one activation quantisation,
    each piece's kernel into its columns (with its slice of the bias)."""
    from kvledger.model.quant_q4 import Q4Split

    g = torch.Generator().manual_seed(9)
    k = 256
    split = Q4Split((_k_quant("Q4_K", 32, k, g)[0], pack(_weight(16, k, seed=3)), _k_quant("Q6_K", 17, k, g)[0]))
    assert split.shape == (65, k)
    x = torch.randn(3, k, generator=g).bfloat16()
    b = torch.randn(65, generator=g).bfloat16()
    y = quant_q4.q4_linear(x, split, b)
    assert torch.equal(y, reference_gemm(x, split, b))
    assert torch.equal(y[:, 32:48], quant_q4.q4_linear(x, split.parts[1], b[32:48]))
    assert torch.equal(split.dequantize(), torch.cat([p.dequantize() for p in split.parts]))
