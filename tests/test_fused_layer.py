"""The native decoder layer (kvledger.model.fused_layer, csrc/decoder_layer.c) against the modules.

It calls the modules' kernels in their order, so logits and the K/V it writes must be the same
bits as the module path's (KVLEDGER_FUSED_LAYER=0), over prefill, mixed and decode steps, and
greedy tokens the same as Hugging Face's. Each test also checks that the native layer actually
ran, so none passes by falling back.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from kvledger import LLM, SamplingParams
from kvledger.kernels import native
from kvledger.kernels.gemm_rows import row_wise
from kvledger.model import fused_layer
from kvledger.model.loader import load_model
from tests.model_factory import PagedDriver, build_hf_model, tiny_config
from tests.test_engine_exact import hf_greedy

pytestmark = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")

# head_dim 16: the smallest the native RoPE (and so the native layer) takes.
_SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=2048,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def _config(kind: str):
    return Qwen2Config(**_SHAPE) if kind == "qwen2" else LlamaConfig(**_SHAPE, rope_theta=500000.0)


@pytest.fixture
def fused_runs(monkeypatch):
    """How many forward passes went through the native layer."""
    runs = [0]
    orig = fused_layer.FusedLayers.run

    def run(self, *a, **k):
        out = orig(self, *a, **k)
        runs[0] += out is not None
        return out

    monkeypatch.setattr(fused_layer.FusedLayers, "run", run)
    return runs


def _steps(rng: torch.Generator) -> list[list[tuple[str, list[int]]]]:
    """Prefill (one prompt in two chunks), then mixed steps (decodes beside a new prompt), then decodes."""
    def ids(n: int) -> list[int]:
        return torch.randint(3, 97, (n,), generator=rng).tolist()

    steps = [[("a", ids(37)), ("b", ids(9))], [("a", ids(20)), ("c", ids(5))]]
    steps.append([("a", ids(1)), ("b", ids(1)), ("c", ids(1)), ("d", ids(70))])
    for _ in range(6):
        steps.append([(r, ids(1)) for r in "abcd"])
    steps.append([(r, ids(1)) for r in "abcd"] + [("e", ids(3))])
    return steps


def _row_wise_steps(steps, dtype: torch.dtype) -> int:
    """Steps whose rows all take the native row-wise GEMM (the native layer's condition)."""
    n = 0
    for batch in steps:
        decodes = next((i for i, (_, ids) in enumerate(batch) if len(ids) != 1), len(batch))
        n += row_wise(sum(len(ids) for _, ids in batch), dtype, invariant_rows=decodes)
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: biases on q, k, v
def test_native_layer_gives_the_modules_bits(kind, dtype, tmp_path, monkeypatch, fused_runs):
    build_hf_model(_config(kind), tmp_path)
    loaded = load_model(tmp_path, dtype=dtype)
    assert loaded.model.fused_layers is not None
    native_drv, module_drv = PagedDriver(loaded, block_size=8), PagedDriver(loaded, block_size=8)
    for batch in _steps(torch.Generator().manual_seed(3)):
        monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "1")
        a = native_drv.step(batch)
        monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "0")
        b = module_drv.step(batch)
        assert torch.equal(a, b), batch
    for x, y in zip(native_drv.pool.layers, module_drv.pool.layers, strict=True):
        assert torch.equal(x.kv, y.kv)  # every K/V row written to the same slot, same bits
    # Every step whose products all take the row-wise kernel (all of them on AVX-512; the
    # decode steps at least on every build).
    assert fused_runs[0] == _row_wise_steps(_steps(torch.Generator().manual_seed(3)), dtype) >= 7


def test_engine_on_the_native_layer_matches_hf(tmp_path, fused_runs):
    hf = build_hf_model(_config("llama"), tmp_path)
    llm = LLM(str(tmp_path), block_size=4, calibrate_preemption=False)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 40, 23, 2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), p
    assert fused_runs[0] > 20


def test_steps_the_native_layer_does_not_take_go_through_the_modules(tmp_path, monkeypatch, fused_runs):
    build_hf_model(_config("llama"), tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32)
    batches = [[("a", list(range(3, 58)) * 20)], [("a", [5])]]  # 1,100 rows: oneDNN's, not row-wise
    drv, ref = PagedDriver(loaded, num_blocks=400), PagedDriver(loaded, num_blocks=400)
    for batch in batches:
        monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "1")
        a = drv.step(batch)
        monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "0")
        assert torch.equal(a, ref.step(batch))
    assert fused_runs[0] == 1  # the decode step only
    # A model the native layer does not cover (q/k norms) never builds one.
    build_hf_model(tiny_config("qwen3"), tmp_path / "qwen3")
    assert load_model(tmp_path / "qwen3").model.fused_layers is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_kernel_is_torch_add_then_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 64, generator=g).to(dtype)
    d = torch.randn(37, 64, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    want_h = h + d
    want_y = native.rms_norm(want_h, w, 1e-5)
    lib = native.library()
    fn = lib.kvl_add_rms_norm_bf16 if dtype == torch.bfloat16 else lib.kvl_add_rms_norm
    y = torch.empty_like(h)
    assert fn(h.data_ptr(), d.data_ptr(), w.data_ptr(), y.data_ptr(), 37, 64, ctypes.c_float(1e-5), 2) == 0
    assert torch.equal(h, want_h) and torch.equal(y, want_y)
    before = h.clone()
    assert fn(h.data_ptr(), d.data_ptr(), None, None, 37, 64, ctypes.c_float(1e-5), 2) == 0  # add only
    assert torch.equal(h, before + d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_native_layer_takes_quantised_layers(method, dtype, tmp_path, monkeypatch, fused_runs):
    """W8A8 and W4A8 layers run in the native layer with the modules' bits, at every step's rows
    (their modules take the integer kernels at any row count, so no step falls back)."""
    monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", "int8")  # W4A8 for float32 too
    build_hf_model(_config("qwen2"), tmp_path)
    loaded = load_model(tmp_path, dtype=dtype, quantization=method)
    assert loaded.model.fused_layers is not None and loaded.model.fused_layers.all_quantised
    native_drv, module_drv = PagedDriver(loaded, block_size=8), PagedDriver(loaded, block_size=8)
    steps = _steps(torch.Generator().manual_seed(5))
    for batch in steps:
        monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "1")
        a = native_drv.step(batch)
        monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "0")
        assert torch.equal(a, module_drv.step(batch)), batch
    for x, y in zip(native_drv.pool.layers, module_drv.pool.layers, strict=True):
        assert torch.equal(x.kv, y.kv)
    assert fused_runs[0] == len(steps)
