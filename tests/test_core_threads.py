"""The engine core's torch thread count when the user gives none (kvledger/engine/core_threads.py)."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine import core_threads
from kvledger.kernels import native
from kvledger.model.loader import load_model


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    native.set_split_threads(0)


def test_a_model_whose_matmuls_save_little_gets_one_thread(stories_path, restore_threads):
    model = load_model(stories_path).model
    threads, work = core_threads.choose_core_threads(model, 2)
    assert threads == 1 and torch.get_num_threads() == 1
    assert 0 < work < core_threads.MIN_WORK_S  # stories260k's whole step of matmuls: ~0.05 ms
    assert native._split_threads == 2  # a large decode attention still splits


def test_the_work_counts_every_layer_and_the_head_once(stories_path, restore_threads, monkeypatch):
    """Layer 0's products stand for every layer; the LM head counts once. The decision flips at
    MIN_WORK_S exactly as that sum says, and only one-thread timings are taken."""
    model = load_model(stories_path).model
    linears, runs = core_threads._decode_matmuls(model)
    num_layers = len(model.model.layers)
    assert linears[-1] is model.head and runs[-1] == 1 and num_layers > 1
    assert runs[:-1] == [num_layers] * (len(linears) - 1)
    per_layer = len(linears) - 1
    seen = set()

    def fake(seconds_per_product: float):
        def _time(lins, xs, threads, repeats=5):
            seen.add(threads)
            return [seconds_per_product for _ in lins]

        return _time

    just_enough = core_threads.MIN_WORK_S / (per_layer * num_layers + 1)
    monkeypatch.setattr(core_threads, "_time", fake(just_enough * 1.01))
    assert core_threads.choose_core_threads(model, 2)[0] == 2 and torch.get_num_threads() == 2
    assert native._split_threads == 0  # torch's count already covers the attention
    monkeypatch.setattr(core_threads, "_time", fake(just_enough * 0.99))
    assert core_threads.choose_core_threads(model, 2)[0] == 1 and torch.get_num_threads() == 1
    assert native._split_threads == 2
    assert seen == {1}
    assert core_threads.choose_core_threads(model, 1) == (1, 0.0)


def test_a_large_step_splits_and_gives_the_same_tokens(stories_path, restore_threads):
    """With one torch thread and split threads set (the core's choice for a small model), a step
    of SPLIT_STEP_TOKENS or more runs its forward on the split count and then goes back to one;
    the greedy tokens are those of an unsplit run."""
    from kvledger import LLM, SamplingParams

    assert native.step_threads(native.SPLIT_STEP_TOKENS) == 0  # nothing set: torch's count
    llm = LLM(stories_path, max_model_len=512)
    prompt = {"prompt_token_ids": [1] + [(7 * i) % 500 + 10 for i in range(300)]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    torch.set_num_threads(1)
    plain = llm.generate(prompt, params)[0].outputs[0].token_ids
    llm.reset_prefix_cache()  # the prompt is computed again, not read from cached blocks
    native.set_split_threads(2)
    assert native.step_threads(native.SPLIT_STEP_TOKENS - 1) == 0
    assert native.step_threads(native.SPLIT_STEP_TOKENS) == 2
    seen = []
    model = llm.llm_engine.executor.worker.model
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    try:
        split = llm.generate(prompt, params)[0].outputs[0].token_ids
    finally:
        hook.remove()
    assert split == plain
    assert seen[0] == 2 and set(seen[1:]) == {1}  # the 301-token prefill split, decodes did not
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantised_model_is_timed_with_its_activations_shape_and_dtype(stories_path, restore_threads, quantization):
    """A quantised Linear's weight holds codes (int8: [out, in] int8; int4 in bf16: uint8 tiles
    [tiles, K / 32, 256]), not [out, in] floats of the model's dtype: the timing takes each product's input width and the model's dtype.
    (It took the codes' shape and dtype: every engine core of a GGUF, int4 or GPTQ model started
    without --torch-threads died before READY.)"""
    model = load_model(stories_path, dtype="bfloat16", quantization=quantization).model
    linears, _ = core_threads._decode_matmuls(model)
    assert any(lin.quant is not None and lin.weight.dtype != model.dtype for lin in linears)
    threads, work = core_threads.choose_core_threads(model, 2)
    assert threads in (1, 2) and work > 0
