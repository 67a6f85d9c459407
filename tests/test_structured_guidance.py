"""The llguidance backend ("guidance") and the "auto" fallback, on the real stories260k model:
the same constraints as with xgrammar give valid output, and, for constraints whose token
masks both backends compute alike, the same greedy tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.llm import LLM
from kvledger.sampling_params import SamplingParams, StructuredOutputsParams
from kvledger.server.structured_fields import parse_structured_outputs_config
from tests.data.json_schemas import SCHEMAS

pytest.importorskip("llguidance")

PROMPTS = ["Once upon a time", "Lily wanted", "The dog"]


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False, structured_outputs_config={"backend": "guidance"})


def _run(llm, backend, constraints, **sp):
    llm.engine.structured.backend = backend
    try:
        sp = {"temperature": 0, "max_tokens": 120, **sp}
        params = [SamplingParams(structured_outputs=StructuredOutputsParams(**c), **sp) for c in constraints]
        outs = llm.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
        assert {p.structured_outputs.resolved_backend for p in params} == {backend if backend != "auto" else "guidance"}
        return [o.outputs for o in outs]
    finally:
        llm.engine.structured.backend = "guidance"


class _GuidanceProcessor:
    """A transformers logits processor on llguidance's own matcher and mask: the reference."""

    def __init__(self, ll_tokenizer, grammar: str, vocab: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.lt, self.m, self.n = lt, llguidance.LLMatcher(ll_tokenizer, grammar), 0
        self.mask = lt.allocate_token_bitmask(1, vocab)

    def __call__(self, input_ids, scores):
        if self.n:
            assert self.m.consume_token(int(input_ids[0, -1]))
        self.n += 1
        self.lt.fill_next_token_bitmask(self.m, self.mask, 0)
        self.lt.apply_token_bitmask_inplace(scores, self.mask)
        return scores


def test_guidance_greedy_equals_transformers_with_llguidance_masks(stories_path, llm):
    """Greedy decoding on the guidance backend == HF generate() masked by llguidance itself."""
    import llguidance.hf
    import torch
    from transformers import AutoModelForCausalLM

    from kvledger.structured.backends import guidance_grammar

    tok = llm.tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(stories_path), torch_dtype=torch.float32)
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=llm.engine.vocab_size, eos_token=[1, 2])
    constraints = [{"regex": r"[a-z]{2,6} (cat|dog)s?!"}, {"choice": ["yes", "no", "maybe so"]},
                   {"json": SCHEMAS[22], "disable_any_whitespace": True, "disable_additional_properties": True}]
    outs = _run(llm, "guidance", constraints)
    for i, (c, out) in enumerate(zip(constraints, outs)):
        ids = tok(PROMPTS[i % 3], return_tensors="pt").input_ids
        proc = _GuidanceProcessor(ll_tok, guidance_grammar(StructuredOutputsParams(**c)), llm.engine.vocab_size)
        ref = model.generate(ids, do_sample=False, max_new_tokens=120, eos_token_id=[1, 2],
                             logits_processor=[proc], pad_token_id=0)
        assert out[0].token_ids == ref[0, ids.shape[1]:].tolist(), (c, out[0].text)
        assert out[0].finish_reason == "stop", (c, out[0].text)
    assert re.fullmatch(constraints[0]["regex"], outs[0][0].text)
    assert outs[1][0].text in constraints[1]["choice"]
    jsonschema.validate(json.loads(outs[2][0].text), SCHEMAS[22])


def test_guidance_json_schemas_validate_with_sampling_and_n(llm):
    schemas = [SCHEMAS[i] for i in (0, 7, 15, 22, 29)]
    outs = _run(llm, "guidance", [{"json": s, "disable_any_whitespace": True, "disable_additional_properties": True}
                                  for s in schemas],
                n=2, seed=11, temperature=1.0)
    for schema, choices in zip(schemas, outs):
        for c in choices:  # the n=2 children fork the parent's llguidance matcher
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)


def test_whitespace_pattern_falls_back_to_guidance_under_auto(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    so = {"json": schema, "whitespace_pattern": r" {0,1}", "disable_additional_properties": True}
    (out,) = _run(llm, "auto", [so])
    assert out[0].finish_reason == "stop" and "\n" not in out[0].text
    jsonschema.validate(json.loads(out[0].text), schema)
    llm.engine.structured.backend = "xgrammar"
    try:
        with pytest.raises(InvalidRequestError, match="whitespace_pattern is not supported by the xgrammar"):
            llm.generate(["Hi"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(**so)),
                         use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="whitespace_pattern"):  # auto, fallback disabled
            llm.engine.structured.backend = "auto"
            llm.generate(["Hi"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
                disable_fallback=True, **so)), use_tqdm=False)
    finally:
        llm.engine.structured.backend = "guidance"


def test_guidance_refusals_name_the_problem(llm):
    with pytest.raises(InvalidRequestError, match=r"invalid regex"):  # neither backend takes it
        StructuredOutputsParams(regex="(unclosed")
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    with pytest.raises(InvalidRequestError, match="needs the xgrammar backend"):
        llm.generate(["Hi"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
            structural_tag=json.dumps(tag))), use_tqdm=False)
    assert parse_structured_outputs_config('{"backend": "guidance"}') == {"backend": "guidance"}
    with pytest.raises(ConfigError, match="not one of xgrammar, guidance, auto"):
        parse_structured_outputs_config('{"backend": "outlines"}')
    with pytest.raises(ConfigError, match="backend"):
        LLM("unused", structured_outputs_config={"backend": "nope"})
