"""The offline API as vLLM users call it: prompt dicts, chat, the tokenizer, the engine,
resetting the prefix cache, and vLLM's constructor keywords."""

from __future__ import annotations

import logging

import pytest
import torch

from kvledger import LLM, SamplingParams
from kvledger.core.engine import LLMEngine
from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.inputs import TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0, max_tokens=12)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False, num_kv_blocks=64)


def test_prompt_dicts_equal_plain_prompts(llm):
    tok = llm.get_tokenizer()
    ids = tok("Lily and Tom").input_ids
    plain = llm.generate(["Once upon a time", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate(
        [TextPrompt(prompt="Once upon a time"), TokensPrompt(prompt_token_ids=ids)], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in dicts] == [o.outputs[0].text for o in plain]
    assert dicts[0].prompt == "Once upon a time" and dicts[1].prompt is None
    assert dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt": "Once upon a time"}, GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    for bad, words in (({"text": "x"}, "unsupported prompt key"), ({}, "needs 'prompt'"), (3.5, "a prompt is")):
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate([bad], GREEDY, use_tqdm=False)
    assert isinstance(llm.llm_engine, LLMEngine) and tok is llm.llm_engine.tokenizer


def test_chat_renders_the_template_and_generates(llm):
    msgs = [{"role": "user", "content": "Lily had a red ball"}]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        llm.chat(msgs, GREEDY)
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(tok.bos_token) and rendered.endswith("assistant:")
    ids = tok(rendered, add_special_tokens=False).input_ids  # the template wrote BOS itself
    assert ids.count(tok.bos_token_id) == 1
    want = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    got = llm.chat(msgs, GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    assert len(got) == 1 and got[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert got[0].prompt == rendered and got[0].prompt_token_ids == ids
    # A list of conversations; continue_final_message continues the last message's text.
    convs = [msgs, [{"role": "user", "content": "Tom"}, {"role": "assistant", "content": "Once"}]]
    two = llm.chat(convs, GREEDY, chat_template=TEMPLATE, add_generation_prompt=False,
                   continue_final_message=True, use_tqdm=False)  # fmt: skip
    assert len(two) == 2 and two[1].prompt.endswith("assistant: Once")
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        llm.chat(msgs, GREEDY, chat_template=TEMPLATE, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY, chat_template=TEMPLATE)


def test_reset_prefix_cache_refuses_while_requests_hold_blocks(llm, caplog):
    long = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    llm.generate([long], GREEDY, use_tqdm=False)
    pool = llm.llm_engine.kv.pool
    assert pool.num_cached_free > 0
    eng = llm.llm_engine
    eng.add_request("Lily and Tom went to the beach", GREEDY, request_id="busy")
    eng.step()
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        assert llm.reset_prefix_cache() is False
    assert "refused" in caplog.text and "1 unfinished request" in caplog.text
    assert pool.num_cached_free > 0
    eng.abort_request("busy")
    assert llm.reset_prefix_cache() is True and pool.num_cached_free == 0
    again = llm.generate([long], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # nothing left to hit


def test_vllm_constructor_keywords(stories_path, caplog):
    path = str(stories_path)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide .* 8 attention heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        LLM(path, gpu_memory_utilization=1.5, calibrate_preemption=False)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        LLM(path, dtype="fp64")
    with pytest.raises(ConfigError, match="unknown option.*max_num_sequences"):
        LLM(path, max_num_sequences=4)
    with pytest.raises(ConfigError, match="generation_config must be"):
        LLM(path, generation_config="hf")
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        half = LLM(path, dtype="half", seed=3, enforce_eager=False, trust_remote_code=True,
                   tensor_parallel_size=1, enable_prefix_caching=False, max_logprobs=5,
                   gpu_memory_utilization=0.5, calibrate_preemption=False, num_kv_blocks=16)  # fmt: skip
        LLM(path, enforce_eager=False, calibrate_preemption=False, num_kv_blocks=16)
    assert half.llm_engine.model_dtype is torch.float16
    assert not half.llm_engine.kv.enable_prefix_caching and half.llm_engine.config.max_logprobs == 5
    for name in ("enforce_eager", "trust_remote_code", "gpu_memory_utilization"):
        assert caplog.text.count(f"{name} has no effect") == 1, name  # once per process
    assert LLM(path, dtype="float", calibrate_preemption=False, num_kv_blocks=16).llm_engine.model_dtype is torch.float32
