"""Structured outputs in the engine (xgrammar): the constraint forces validity on a tiny model,
so these tests check the mechanism, not the model's quality."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvledger.errors import InvalidRequestError
from kvledger.llm import LLM
from kvledger.sampling_params import SamplingParams, StructuredOutputsParams
from tests.data.json_schemas import SCHEMAS

PROMPTS = ["Once upon a time", "Lily wanted", "The dog"]


def _so(**kw) -> StructuredOutputsParams:
    # No free whitespace between JSON tokens: a tiny model would pad with it until max_tokens.
    return StructuredOutputsParams(disable_any_whitespace=True, **kw)


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False)


def test_json_schemas_validate(llm):
    assert len(SCHEMAS) >= 30
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=_so(json=s)) for s in SCHEMAS]
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(SCHEMAS))], params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    # The same constraint is compiled once.
    compiler = llm.engine.structured.compiler
    n = compiler.num_compiled
    llm.generate(PROMPTS[0], params[0], use_tqdm=False)
    assert compiler.num_compiled == n and compiler.num_cache_hits >= 1


def test_sampled_regex_choice_grammar(llm):
    cases = [
        (_so(regex=r"[0-9]{3}-[a-z]{2,4}( [A-Z]\.)?"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}( [A-Z]\.)?", t)),
        (_so(choice=["yes", "no", 'say "maybe"']), lambda t: t in ("yes", "no", 'say "maybe"')),
        (_so(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ]
    for so, ok in cases:
        sp = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=120, structured_outputs=so)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        for out in outs:
            for c in out.outputs:  # n > 1 children each run their own (forked) matcher
                assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_invalid_constraints_name_the_problem():
    with pytest.raises(InvalidRequestError, match=r"invalid regex.*parenthesis"):
        StructuredOutputsParams(regex="a(b")
    with pytest.raises(InvalidRequestError, match=r"invalid JSON schema.*nonsense"):
        StructuredOutputsParams(json={"type": "nonsense"})
    with pytest.raises(InvalidRequestError, match=r"invalid JSON schema: not JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(InvalidRequestError, match=r"invalid grammar.*\"foo\" is not defined"):
        StructuredOutputsParams(grammar="root ::= foo")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_greedy_equals_transformers_with_xgrammar_processor(stories_path, llm):
    """Greedy constrained decoding == HF generate() with xgrammar's own logits processor."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    from xgrammar.contrib.hf import LogitsProcessor

    tok = llm.tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(stories_path), torch_dtype=torch.float32)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=llm.engine.vocab_size, stop_token_ids=[1, 2])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    specs = [SCHEMAS[22], SCHEMAS[10], SCHEMAS[32]]
    for i, schema in enumerate(specs):
        prompt = PROMPTS[i % 3]
        ids = tok(prompt, return_tensors="pt").input_ids
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        ref = model.generate(ids, do_sample=False, max_new_tokens=100, eos_token_id=[1, 2],
                             logits_processor=[LogitsProcessor(grammar)], pad_token_id=0)
        ref_ids = ref[0, ids.shape[1]:].tolist()
        sp = SamplingParams(temperature=0, max_tokens=100, structured_outputs=_so(json=schema))
        out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref_ids, (schema, out.text, tok.decode(ref_ids))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_exactly(stories_path, llm, mode):
    schemas = SCHEMAS[20:32]
    prompts = [PROMPTS[i % 3] * 3 for i in range(len(schemas))]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=120, structured_outputs=_so(json=s))
              for i, s in enumerate(schemas)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(stories_path), num_kv_blocks=40, block_size=4, preemption_mode=mode,
                calibrate_preemption=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert tight.ledger().preemptions[mode] > 0
    for schema, out in zip(schemas, outs):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_llm_chat_renders_tools_and_tool_history(llm):
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}:"
        "{{ c.function.arguments.city }};{% endfor %}{{ m.content or '' }}|{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    sp = SamplingParams(temperature=0, max_tokens=4)
    out = llm.chat(history, sp, chat_template=template, tools=tools, use_tqdm=False)[0]
    # The JSON-string arguments reach the template as a dict (c.function.arguments.city).
    assert out.prompt == "[get_weather]Weather?|get_weather:Oslo;|sunny|"
