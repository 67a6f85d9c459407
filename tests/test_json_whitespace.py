"""JSON that never runs away: JSON grammars bound the whitespace in each gap by default
(max_whitespace_cnt), so stories260k, which prefers newlines after ``{``, still closes its
objects; ``"max_whitespace_cnt": null`` asks for xgrammar's unbounded whitespace again.

A real `kvledger serve` with no --structured-outputs-config (test_server's keyed server), driven with the `openai` client.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kvledger.errors import InvalidRequestError
from kvledger.structured.params import DEFAULT_MAX_WHITESPACE_CNT, StructuredOutputsParams
from tests.data.json_schemas import SCHEMAS
from tests.test_server import KEY, KEYED_ARGS

# Small objects: a bounded string, a bounded integer, an enum, a boolean, a nested object.
CASES = [SCHEMAS[0], SCHEMAS[4], SCHEMAS[7], SCHEMAS[2], SCHEMAS[20], SCHEMAS[34]]


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    import xgrammar as xgr

    return xgr.testing._is_grammar_accept_string(params.parsed_grammar, text)


def test_the_grammar_bounds_each_gap():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    bounded = StructuredOutputsParams(json=schema)
    gap = " " * DEFAULT_MAX_WHITESPACE_CNT
    assert _accepts(bounded, "{" + gap + '"a":' + gap + "1" + gap + "}")
    assert not _accepts(bounded, "{" + gap + ' "a":1}')
    assert _accepts(StructuredOutputsParams(json=schema, max_whitespace_cnt=None), "{" + " " * 50 + '"a":1}')
    assert _accepts(StructuredOutputsParams(json_object=True), '{\n  "x": [1, 2]\n}')
    assert not _accepts(StructuredOutputsParams(json_object=True), "{" + gap + ' "x": 1}')
    # Different bounds are different grammars: the compile cache must not mix them.
    assert bounded.key() != StructuredOutputsParams(json=schema, max_whitespace_cnt=None).key()
    for bad in (0, -1, True, 1.5, "4"):
        with pytest.raises(InvalidRequestError, match="max_whitespace_cnt must be a positive integer"):
            StructuredOutputsParams(json=schema, max_whitespace_cnt=bad)


@pytest.fixture(scope="module")
def client(shared_stories_server):
    """test_server's keyed server (the same plain chat template; its key and served name change
    nothing here): one server start fewer."""
    return shared_stories_server(*KEYED_ARGS).client(KEY)


def _ask(client, schema, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Once upon a time"}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        max_tokens=120, **kw,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_close_by_default(client, temperature):
    for schema in CASES:
        r = _ask(client, schema, temperature=temperature, seed=7, n=2)
        for c in r.choices:
            assert c.finish_reason == "stop", (schema, c.message.content)
            jsonschema.validate(json.loads(c.message.content), schema)


def test_unbounded_whitespace_on_request_runs_away(client):
    # The same request with xgrammar's unbounded whitespace (what vLLM runs): the tiny model
    # fills max_tokens with whitespace inside the object; the default closes it.
    extra = {"structured_outputs": {"max_whitespace_cnt": None}}
    runaway = _ask(client, CASES[0], temperature=0, extra_body=extra).choices[0]
    assert runaway.finish_reason == "length"
    assert runaway.message.content.startswith("{") and not runaway.message.content.rstrip().endswith("}")
    bounded = _ask(client, CASES[0], temperature=0).choices[0]
    assert bounded.finish_reason == "stop"
    # A bound of the request's own, and a bad one named.
    one = _ask(client, CASES[0], temperature=0, extra_body={"structured_outputs": {"max_whitespace_cnt": 1}})
    text = one.choices[0].message.content
    assert "  " not in text.replace(json.loads(text)["name"], "")
    with pytest.raises(openai.BadRequestError, match="max_whitespace_cnt must be a positive integer"):
        _ask(client, CASES[0], extra_body={"structured_outputs": {"max_whitespace_cnt": 0}})
