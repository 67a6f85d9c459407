"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a real `kvledger serve`
driven with the official `anthropic` SDK: text, stop sequences, streamed event sequences that add
up to the non-streamed message, tool use with tool_result turns, structured output, token
counting, and Anthropic-shaped errors for hostile bodies.

Sampling options the current SDK no longer types (temperature, top_k) go in ``extra_body``, as
clients of vLLM's /v1/messages send them.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.test_server_structured import TEMPLATE, WEATHER

KEY = "sk-ant-test"
NAME = "stories"
GREEDY = {"temperature": 0}
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip


# One server for this module and tests/test_server_responses.py (conftest's shared_stories_server).
SERVER_ARGS = ("--chat-template", TEMPLATE, "--api-key", KEY, "--served-model-name", NAME,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip


@pytest.fixture(scope="module")
def server(shared_stories_server):
    return shared_stories_server(*SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _events(client, **kw):
    """(event types in order, the SDK's accumulated final message)."""
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        return kinds, s.get_final_message()


def _check_sequence(kinds: list[str]) -> None:
    """Anthropic's order: message_start, blocks (start, deltas, stop), message_delta, message_stop."""
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    body = kinds[1:-2]
    assert body and body.count("content_block_start") == body.count("content_block_stop"), kinds
    open_ = False
    for k in body:
        if k == "content_block_start":
            assert not open_
            open_ = True
        elif k == "content_block_stop":
            assert open_
            open_ = False
        elif k in ("content_block_delta", "text", "input_json"):  # the SDK's derived events too
            assert open_, kinds
    assert not open_


def test_text_streamed_and_not_and_the_chat_path_agree(client, server):
    messages = [{"role": "user", "content": "Once upon a time"},
                {"role": "assistant", "content": [{"type": "text", "text": "there was a cat."}]},
                {"role": "user", "content": [{"type": "text", "text": "The cat"}]}]  # fmt: skip
    kw = dict(model=NAME, max_tokens=24, system=[{"type": "text", "text": "A story."}], messages=messages,
              extra_body=GREEDY)  # fmt: skip
    r = client.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant" and r.model == NAME and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 24
    # The same conversation through /v1/chat/completions: the same prompt, the same greedy text.
    chat = server.client(KEY).chat.completions.create(
        model=NAME, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "A story."},
                  {"role": "user", "content": "Once upon a time"},
                  {"role": "assistant", "content": "there was a cat."},
                  {"role": "user", "content": "The cat"}],
    )  # fmt: skip
    assert chat.choices[0].message.content == r.content[0].text
    assert chat.usage.prompt_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    kinds, final = _events(client, **kw)
    _check_sequence(kinds)
    assert final.content[0].text == r.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24


def test_stop_sequences_and_sampling_fields(client):
    base = client.messages.create(model=NAME, max_tokens=30, messages=[{"role": "user", "content": "Once upon a time"}],
                                  extra_body=GREEDY).content[0].text  # fmt: skip
    word = base.split()[3]
    r = client.messages.create(model=NAME, max_tokens=30, stop_sequences=[word],
                               messages=[{"role": "user", "content": "Once upon a time"}], extra_body=GREEDY)  # fmt: skip
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert base.startswith(r.content[0].text) and word not in r.content[0].text
    kinds, final = _events(client, model=NAME, max_tokens=30, stop_sequences=[word],
                           messages=[{"role": "user", "content": "Once upon a time"}], extra_body=GREEDY)  # fmt: skip
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == r.content[0].text
    # top_k 1 is greedy whatever the temperature
    r1 = client.messages.create(model=NAME, max_tokens=30, messages=[{"role": "user", "content": "Once upon a time"}],
                                extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9})  # fmt: skip
    assert r1.content[0].text == base


def test_tool_use_streamed_and_not_then_tool_result(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, reason in (({"type": "tool", "name": "get_weather"}, "tool_use"),
                           ({"type": "any", "disable_parallel_tool_use": True}, "tool_use")):  # fmt: skip
        kw = dict(model=NAME, max_tokens=150, tools=[TOOL], tool_choice=choice, messages=messages, extra_body=GREEDY)
        r = client.messages.create(**kw)
        (block,) = r.content
        assert block.type == "tool_use" and block.name == "get_weather" and r.stop_reason == reason
        jsonschema.validate(block.input, TOOL["input_schema"])
        kinds, final = _events(client, **kw)
        _check_sequence(kinds)
        assert "input_json" in kinds
        (fblock,) = final.content
        assert (fblock.type, fblock.name, fblock.input) == ("tool_use", block.name, block.input)
        assert final.stop_reason == reason
    history = [*messages, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, block.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny, 21 C"}]}]  # fmt: skip
    r2 = client.messages.create(model=NAME, max_tokens=5, tools=[TOOL], tool_choice={"type": "none"},
                                messages=history, extra_body=GREEDY)  # fmt: skip
    assert r2.content[0].type == "text" and r2.stop_reason == "max_tokens"
    # The call and its result were rendered: count_tokens agrees with what the request used.
    n = client.messages.count_tokens(model=NAME, tools=[TOOL], messages=history).input_tokens
    assert n == r2.usage.input_tokens + r2.usage.cache_read_input_tokens
    plain = client.messages.count_tokens(model=NAME, messages=messages).input_tokens
    assert n > plain + 10


def test_auto_tool_choice_with_the_servers_parser(client):
    r = client.messages.create(model=NAME, max_tokens=12, tools=[TOOL], messages=[{"role": "user", "content": "Once"}],
                               extra_body=GREEDY)  # fmt: skip
    assert r.content[0].type == "text" and r.stop_reason == "max_tokens"  # the tiny model writes no <tool_call>


def test_output_config_json_schema(client):
    schema = {"type": "object", "properties": {"hero": {"type": "string", "maxLength": 8},
              "brave": {"type": "boolean"}}, "required": ["hero", "brave"], "additionalProperties": False}  # fmt: skip
    r = client.messages.create(model=NAME, max_tokens=100, messages=[{"role": "user", "content": "Once upon a time"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)  # fmt: skip
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_errors_are_anthropic_shaped(client, server):
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (dict(max_tokens=0, messages=msgs), "max_tokens"),
        (dict(max_tokens=5, messages=[]), "messages"),
        (dict(max_tokens=5, messages=[{"role": "system", "content": "x"}]), "role"),
        (dict(max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "image blocks"),
        (dict(max_tokens=5, messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
         "'tool_use' block is not allowed in a user message"),
        (dict(max_tokens=5, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
        (dict(max_tokens=5, messages=msgs, tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}), "'nope'"),
        (dict(max_tokens=5, messages=msgs, stop_sequences=[""]), "stop_sequences"),
        (dict(max_tokens=5, messages=msgs, extra_body={"temperature": -1}), "temperature"),
        (dict(max_tokens=5, messages=msgs, extra_body={"top_k": True}), "top_k must be a number"),
        (dict(max_tokens=5, messages=msgs, extra_body={"frobnicate": 1}), "unknown field 'frobnicate'"),
        (dict(max_tokens=5, messages=msgs, output_config={"format": {"type": "xml"}}), "output_config.format"),
        (dict(max_tokens=10**6, messages=msgs), "maximum context length"),
    ]
    for kw, needle in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=NAME, **kw)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert needle in e.value.body["error"]["message"], (kw, e.value.body)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget needs a reasoning model"):
        server.client(KEY).chat.completions.create(model=NAME, messages=msgs, max_tokens=3,
                                                   extra_body={"thinking_token_budget": 4})  # fmt: skip
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=5, messages=msgs)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=5, messages=msgs)
    assert e.value.body["error"]["type"] == "authentication_error"
    # Raw bodies: not JSON, JSON of the wrong shape, deeply nested; the key as a Bearer token.
    url, auth = f"{server.url}/v1/messages", {"Authorization": f"Bearer {KEY}"}
    for raw in (b"{", b"[]", b'{"model": 1}', b"[" * 5000 + b"]" * 5000,
                json.dumps({"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "\ud800"}]}).encode()):
        r = httpx.post(url, content=raw, headers={**auth, "content-type": "application/json"}, timeout=30)
        assert 400 <= r.status_code < 500 and r.json()["type"] == "error", (raw[:40], r.text)
    r = httpx.post(url, json={"model": NAME, "max_tokens": 3, "messages": msgs}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json={"model": NAME, "messages": msgs}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_messages_count_in_vllm_metrics(client, server):
    key = "vllm:request_success_total{engine=0,finished_reason=length}"
    before = server.metrics().get(key, 0)
    client.messages.create(model=NAME, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    _events(client, model=NAME, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert server.metrics()[key] == before + 2
    assert server.ledger(KEY)["used_blocks"] == 0  # both finished: every block is back
