"""Greedy tokens must be identical to Hugging Face transformers (float32) — the numerics oracle."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvledger import LLM, SamplingParams
from tests.model_factory import build_hf_model, tiny_config

STORY_PROMPTS = ["Once upon a time", "Lily and Tom went to the", "The little dog", "One day, a big"]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos=None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


def test_stories260k_matches_hf_for_200_tokens(stories_path, stories_llm):
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(stories_path))
    params = SamplingParams(temperature=0, max_tokens=220, ignore_eos=True)
    outs = stories_llm.generate(STORY_PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(STORY_PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        ref = hf_greedy(hf, ids, 220, eos=None)
        assert out.outputs[0].token_ids == ref, prompt
    # The model's README: the known continuation of "Once upon a time".
    assert outs[0].outputs[0].text.startswith(
        ", there was a little girl named Lily. She loved to play outside in the park."
    )


def test_stories260k_stops_at_eos_like_hf(stories_path, stories_llm):
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(stories_path))
    out = stories_llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=400), use_tqdm=False)[0]
    ref = hf_greedy(hf, tok("Once upon a time").input_ids, 400, eos=[1, 2])
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].finish_reason == ("stop" if ref[-1] in (1, 2) else "length")


@pytest.mark.parametrize("kind", ["llama_mha", "llama_gqa", "llama_mqa", "qwen2", "qwen3", "mistral"])
def test_random_models_match_hf(kind, tmp_path):
    hf = build_hf_model(tiny_config(kind), tmp_path)
    llm = LLM(str(tmp_path), block_size=4, calibrate_preemption=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 11, 23, 2)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 30), (kind, p)
