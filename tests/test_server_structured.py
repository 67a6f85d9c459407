"""Structured outputs and tool calling over HTTP: a real `kvledger serve` process driven with
the official `openai` client. The constraint forces validity on the tiny stories260k model."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.data.json_schemas import SCHEMAS
from tests.test_server import STORIES, ServerProcess

# Renders tools, the assistant's earlier tool calls and role "tool" results.
TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}Result {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}Call {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}\n{% endfor %}{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
    },
}


CLOSED = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer", "minimum": 0,
          "maximum": 9}}, "required": ["a", "b"], "additionalProperties": False}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (STORIES / "config.json").exists():
        pytest.skip("stories260k not found")
    srv = ServerProcess(
        str(STORIES), "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--structured-outputs-config",
        '{"disable_any_whitespace": true}', "--torch-threads", "1",
        log_path=tmp_path_factory.mktemp("srv") / "server.log",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_completions_fields(client):
    schema = SCHEMAS[22]
    cases = [
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2}"}}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
        ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"guided_grammar": 'root ::= "a" [0-9] "b"'}, lambda t: re.fullmatch(r"a[0-9]b", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
         lambda t: jsonschema.validate(json.loads(t), schema) is None),
        # xgrammar has no whitespace_pattern: the server's default "auto" backend hands it to llguidance.
        ({"guided_json": CLOSED, "guided_whitespace_pattern": "[ ]?"},
         lambda t: jsonschema.validate(json.loads(t), CLOSED) is None and "\n" not in t),
    ]
    for extra, ok in cases:
        r = client.completions.create(model="x" if False else client.models.list().data[0].id,
                                      prompt="Once upon a time", max_tokens=120, temperature=0.7,
                                      seed=1, n=2, extra_body=extra)
        for c in r.choices:
            assert c.finish_reason == "stop" and ok(c.text), (extra, c.text)


def test_bad_constraints_are_400s(client):
    model = client.models.list().data[0].id
    cases = [
        ({"guided_regex": "a(b"}, "invalid regex"),
        ({"guided_json": {"type": "nonsense"}}, "invalid JSON schema"),
        ({"structured_outputs": {"grammar": "root ::= foo"}}, "invalid grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "only one kind"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "request-level backend selection"),
    ]
    for extra, msg in cases:
        with pytest.raises(openai.BadRequestError, match=msg):
            client.completions.create(model=model, prompt="Hi", max_tokens=5, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'nope'"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_chat_parse_pydantic(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Lily is"}],
                                      response_format=Person, max_tokens=100, temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Person), msg.content
    assert msg.parsed == Person.model_validate_json(msg.content)


def test_streaming_equals_non_streaming(client):
    model = client.models.list().data[0].id
    for extra in ({"guided_json": SCHEMAS[20]}, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[29]}}}):
        kw = dict(model=model, messages=[{"role": "user", "content": "The dog"}], max_tokens=100,
                  temperature=0, extra_body=extra)
        full = client.chat.completions.create(**kw).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert "".join(parts) == full
        json.loads(full)


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def _streamed(client, **kw):
    """(content, calls, finish_reason, logprob tokens) put together from a stream's chunks,
    checking the fragments' shape: the first of a call has id, type and name, then arguments."""
    content, calls, finish, tokens = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        finish = ch.finish_reason or finish
        tokens += [t.token for t in (ch.logprobs.content or [])] if ch.logprobs else []
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": "", "pieces": 0}
            else:
                assert tc.id is None and tc.function.name is None, tc
            calls[tc.index]["arguments"] += tc.function.arguments or ""
            calls[tc.index]["pieces"] += 1
    return content, [calls[k] for k in sorted(calls)], finish, tokens


def test_tool_call_round_trip(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # One call: with parallel calls allowed a tiny model never closes the array.
        kw = dict(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                  parallel_tool_calls=False, max_tokens=150, temperature=0)
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert msg.tool_calls, msg
        for call in msg.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(_args(call), schema)
        assert r.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
        if choice != "required":
            assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        # Streamed: the same calls as delta.tool_calls fragments.
        content, calls, finish, _ = _streamed(client, **kw)
        assert content == "" and finish == r.choices[0].finish_reason
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in msg.tool_calls
        ]
    # The history goes back through the template: the assistant's call and the tool's result.
    call = msg.tool_calls[0]
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                        max_tokens=5, temperature=0)
    assert r2.choices[0].message.tool_calls == [] and r2.choices[0].message.content is not None
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
    assert r2.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # tools, call and result rendered


def test_parallel_tool_calls_false_allows_one_call(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Once"}],
                                       tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=150, temperature=1.0, seed=3, n=3)
    for c in r.choices:
        assert len(c.message.tool_calls) == 1


def test_auto_tool_calls_stream_like_vllm(client):
    """tool_choice auto with the hermes parser: the constraint makes the tiny model write text
    then a <tool_call> block; the stream sends the text as content, then the call in pieces,
    with logprobs, adding up to the non-streamed message."""
    model = client.models.list().data[0].id
    regex = (r'Ok\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", '
             r'"unit": "(c|f)"\}\}</tool_call>')
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice="auto", max_tokens=120, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw)
    msg, full = r.choices[0].message, r.choices[0]
    assert msg.content == "Ok. " and full.finish_reason == "tool_calls"
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(_args(msg.tool_calls[0]), WEATHER["function"]["parameters"])
    content, calls, finish, tokens = _streamed(client, **kw)
    assert (content, finish) == (msg.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert calls[0]["pieces"] > 3  # the arguments came in fragments, not in one piece at the end
    assert tokens == [t.token for t in full.logprobs.content]


def _one_message(client, **kw):
    """The non-streamed choice after asserting the stream of the same request adds up to it:
    each call's name and arguments, the content and the finish_reason."""
    full = client.chat.completions.create(**kw).choices[0]
    content, calls, finish, _ = _streamed(client, **kw)
    msg = full.message
    want = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    assert [(c["name"], c["arguments"]) for c in calls] == want, (kw["max_tokens"], calls, want)
    assert (content or None, finish) == (msg.content or None, full.finish_reason), kw["max_tokens"]
    return full


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_streamed_and_not_is_one_message_at_every_length(client, choice):
    """tool_choice required / named, cut by max_tokens at several points and left to finish:
    the stream's chunks add up to the non-streamed message (content, each call's name and
    arguments, finish_reason); a cut call is the call as far as it was generated, as OpenAI
    answers, never raw JSON as content."""
    model = client.models.list().data[0].id
    seen_cut = seen_whole = False
    for max_tokens in (6, 12, 20, 40, 200):
        kw = dict(model=model, messages=[{"role": "user", "content": "Weather and time?"}],
                  tools=[WEATHER, TIME], tool_choice=choice, max_tokens=max_tokens, temperature=0,
                  parallel_tool_calls=False)  # one call: it ends within the largest max_tokens
        full = _one_message(client, **kw)
        msg = full.message
        if full.finish_reason == "length" and msg.tool_calls:
            seen_cut = True
            assert msg.content is None  # the cut JSON is not passed off as text
        seen_whole |= full.finish_reason in ("tool_calls", "stop")
    assert seen_cut and seen_whole


def test_an_auto_call_streamed_and_not_is_one_message_at_every_length(client):
    """tool_choice auto with the hermes parser, the call cut by max_tokens at several points and
    left to finish: the stream adds up to the non-streamed message (the text before the call as
    content, the call as far as it was generated, finish_reason), never the raw tag as content."""
    model = client.models.list().data[0].id
    regex = (r'Ok\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", '
             r'"unit": "(c|f)"\}\}</tool_call>')
    seen_cut = False
    for max_tokens in (3, 20, 40, 50, 60, 70, 80, 120):
        kw = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice="auto", max_tokens=max_tokens, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
        full = _one_message(client, **kw)
        msg = full.message
        if full.finish_reason == "length" and msg.tool_calls:
            seen_cut = True
            assert msg.content == "Ok. "  # the cut tag and JSON are not passed off as text
    assert seen_cut and full.finish_reason == "tool_calls"
