"""OpenAI's Responses API (/v1/responses) on a real `kvledger serve`, driven with the `openai`
client's ``responses.create`` / ``responses.stream`` / ``retrieve`` / ``cancel`` / ``delete``:
text and items, instructions, function tools, text.format json_schema, typed stream events that
add up to the non-streamed response, previous_response_id and store: false, background
responses and their cancellation, and 4xx for hostile bodies."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tests.test_server_messages import KEY, NAME, SERVER_ARGS
from tests.test_server_structured import WEATHER

FN = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def server(shared_stories_server):
    """The Messages API tests' server (its tool parser is used by neither module's named or
    forced tool choices here)."""
    return shared_stories_server(*SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return server.client(KEY)


def _stream(client, **kw):
    with client.responses.stream(**kw) as s:
        events = list(s)
        return [e.type for e in events], s.get_final_response(), events


def test_text_with_instructions_matches_chat_and_streams_alike(client):
    kw = dict(model=NAME, input="Once upon a time", instructions="A story.", temperature=0, max_output_tokens=24)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 24 and r.output[0].type == "message"
    chat = client.chat.completions.create(model=NAME, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "A story."}, {"role": "user", "content": "Once upon a time"}])  # fmt: skip
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # Streamed (a text that completes, so the client's accumulator gets response.completed;
    # vLLM's stop extra ends it at the first sentence).
    kw["extra_body"] = {"stop": ["."]}
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    kinds, final, events = _stream(client, **kw)
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    raw = [e for e in events if e.type.startswith("response.")]
    assert [e.sequence_number for e in raw] == sorted(e.sequence_number for e in raw)
    assert final.output_text == whole.output_text and final.status == "completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_previous_response_id_continues_and_store_false_is_not_kept(client):
    first = client.responses.create(model=NAME, input="Once upon a time", temperature=0, max_output_tokens=12)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=NAME, input="The end.", previous_response_id=first.id, temperature=0,
                                     max_output_tokens=8)  # fmt: skip
    # The same conversation sent whole, as items: the same prompt, the same answer.
    items = [{"role": "user", "content": "Once upon a time"},
             {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
             {"role": "user", "content": [{"type": "input_text", "text": "The end."}]}]  # fmt: skip
    whole = client.responses.create(model=NAME, input=items, temperature=0, max_output_tokens=8)
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    gone = client.responses.create(model=NAME, input="Hi", store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.create(model=NAME, input="Hi", previous_response_id=gone.id, max_output_tokens=3)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_function_tools_streamed_and_not_then_the_output_goes_back(client):
    kw = dict(model=NAME, input="Weather in Paris?", tools=[FN], temperature=0, max_output_tokens=150,
              tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    r = client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), FN["parameters"])
    kinds, final, _ = _stream(client, **kw)
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (fcall,) = final.output
    assert (fcall.name, fcall.arguments) == (call.name, call.arguments)
    out = client.responses.create(model=NAME, previous_response_id=r.id, tools=[FN], tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                                  temperature=0, max_output_tokens=4)  # fmt: skip
    assert out.output[0].type == "message" and out.usage.input_tokens > r.usage.input_tokens + 10
    required = client.responses.create(**{**kw, "tool_choice": "required", "parallel_tool_calls": False})
    assert [o.type for o in required.output] == ["function_call"]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"hero": {"type": "string", "maxLength": 8}, "age": {
        "type": "integer", "minimum": 1, "maximum": 12}}, "required": ["hero", "age"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "hero", "schema": schema, "strict": True}}
    for temperature in (0.0, 1.0):
        r = client.responses.create(model=NAME, input="Once upon a time", text=fmt, temperature=temperature,
                                    max_output_tokens=120)  # fmt: skip
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)


def test_background_response_is_cancelled_and_its_request_aborted(client, server):
    aborts = "vllm:request_success_total{engine=0,finished_reason=abort}"
    before = server.metrics().get(aborts, 0)
    b = client.responses.create(model=NAME, input="Once", background=True, max_output_tokens=480,
                                extra_body={"ignore_eos": True})  # fmt: skip
    assert b.status == "queued" and b.background
    c = client.responses.cancel(b.id)
    assert c.status == "cancelled" and client.responses.retrieve(b.id).status == "cancelled"
    assert client.responses.cancel(b.id).status == "cancelled"  # again: the same answer
    deadline = time.monotonic() + 30  # the abort lands before the engine's next step
    while server.ledger(KEY)["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.ledger(KEY)["used_blocks"] == 0
    assert server.metrics()[aborts] == before + 1
    done = client.responses.create(model=NAME, input="Once", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(done.id)


def test_hostile_bodies_are_4xx_naming_the_problem(client, server):
    cases = [
        (dict(input=""), "input is empty"),
        (dict(input=[]), "input is empty"),
        (dict(input=[{"type": "web_search_call"}]), "'web_search_call' are not supported"),
        (dict(input=[{"role": "robot", "content": "x"}]), "role must be"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input_image"),
        (dict(input="x", tools=[{"type": "web_search"}]), "only function tools"),
        (dict(input="x", text={"format": {"type": "xml"}}), "text.format type 'xml'"),
        (dict(input="x", reasoning={"effort": "high"}), "reasoning is not supported"),
        (dict(input="x", background=True, stream=True), "cannot be streamed"),
        (dict(input="x", background=True, store=False), "need store"),
        (dict(input="x", truncation="auto"), "truncation"),
        (dict(input="x", tool_choice="required"), "needs tools"),
        (dict(input="x", max_output_tokens=0), "max_output_tokens"),
        (dict(input="x", extra_body={"frobnicate": 1}), "unknown field 'frobnicate'"),
        (dict(input="x", extra_body={"seed": True}), "seed"),
        (dict(input="x", max_output_tokens=10**6), "maximum context length"),
    ]
    for kw, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=NAME, **kw)
        assert needle in str(e.value), (kw, e.value)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").responses.create(model=NAME, input="x")
    url, auth = f"{server.url}/v1/responses", {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for raw in (b"{", b"[]", b'{"input": 5}', b"[" * 5000 + b"]" * 5000, b'{"input": "\\ud800"}',
                b'{"input": "x", "temperature": NaN}'):
        r = httpx.post(url, content=raw, headers=auth, timeout=30)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (raw[:30], r.text)
