"""The --tool-call-parser formats, on text in each model family's own tool-call syntax."""

from __future__ import annotations

import json

import pytest

from kvledger.errors import InvalidRequestError
from kvledger.server.tools import (
    ToolChoice,
    check_tools,
    forced_call_constraint,
    forced_calls,
    parse_tool_calls,
    resolve_tool_choice,
)

W = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def calls(parser, text):
    content, found = parse_tool_calls(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


def test_hermes():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert calls("hermes", text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    assert calls("hermes", "no calls here") == ("no calls here", [])
    assert calls("hermes", "<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_llama3_json():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "f", "parameters": {"x": 1}}'
    assert calls("llama3_json", text) == (None, [("get_weather", {"city": "Oslo"}), ("f", {"x": 1})])
    assert calls("llama3_json", "Hello {not a call}") == ("Hello {not a call}", [])


def test_mistral():
    content, found = parse_tool_calls("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert content == "Sure." and found[0].name == "get_weather" and json.loads(found[0].arguments) == {"city": "Rome"}
    assert len(found[0].id) == 9 and found[0].id.isalnum()


def test_pythonic():
    text = '[get_weather(city="San Francisco", days=3), get_time(zone=None, ok=True)]'
    assert calls("pythonic", text) == (None, [("get_weather", {"city": "San Francisco", "days": 3}),
                                              ("get_time", {"zone": None, "ok": True})])
    assert calls("pythonic", "[1, 2]") == ("[1, 2]", [])


def test_tool_choice_rules():
    tools = check_tools([W])
    assert resolve_tool_choice(tools, None, auto_enabled=True).mode == "auto"
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        resolve_tool_choice(tools, "auto", auto_enabled=False)
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        resolve_tool_choice(tools, {"type": "function", "function": {"name": "x"}}, True)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        resolve_tool_choice({}, "required", True)
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]"):
        check_tools([{"type": "function"}])
    req = forced_call_constraint(tools, ToolChoice("required"), parallel=False)
    assert req.kind == "json" and req.json["maxItems"] == 1
    got = forced_calls('[{"name": "get_weather", "parameters": {"city": "X"}}]', ToolChoice("required"))
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("get_weather", {"city": "X"})]
    assert forced_calls('{"city": "Y"}', ToolChoice("named", "get_weather"))[0].name == "get_weather"
    assert forced_calls('{"city": "Y', ToolChoice("named", "get_weather")) == []
