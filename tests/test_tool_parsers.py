"""The --tool-call-parser formats, on text in each model family's own tool-call syntax."""

from __future__ import annotations

import json

import pytest

from kvledger.errors import InvalidRequestError
from kvledger.server.tool_stream import ToolCallStream
from kvledger.server.tools import (
    ToolChoice,
    check_tools,
    forced_call_constraint,
    forced_calls,
    parse_tool_calls,
    resolve_tool_choice,
    tool_output,
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
    assert content == "Sure. " and found[0].name == "get_weather" and json.loads(found[0].arguments) == {"city": "Rome"}
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


STREAM_CASES = [
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00eds", "days": [1, 2.50]}}\n'
               '</tool_call>\n<tool_call>{"arguments":{"zone":"utc"},"name":"get_time"}</tool_call>'),
    ("hermes", "Just text, and a < sign <tool_"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": {"b": [true, null, -1e2]}}}</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city":"Oslo"}} ; {"name": "f", "parameters": {}}'),
    ("llama3_json", "  Hello {not a call}"),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome\\n"}}, {"name": "g", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS] {\"name\": \"h\", \"arguments\": {\"x\": \"\\ud83d\\ude00\"}}"),
    ("pythonic", '[get_weather(city="San Francisco", days=3), get_time(zone=None, ok=True)]'),
    ("pythonic", "[1, 2]"),
]


@pytest.mark.parametrize("parser,text", STREAM_CASES)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed_fragments_add_up(parser, text, chunk):
    """Fragments, fed a few characters at a time, add up to the non-streamed content and calls;
    each call's first fragment carries id, type and name, its arguments come in pieces."""
    choice = ToolChoice("auto")
    content, found, finish = tool_output(choice, parser, text, "stop")
    stream = ToolCallStream(choice, parser)
    got_content, got, pieces = "", {}, 0
    for i in range(0, len(text), chunk):
        part = text[i : i + chunk]
        c, deltas, f = stream.step(part, "stop" if i + chunk >= len(text) else None)
        got_content += c
        for d in deltas:
            if d["index"] not in got:
                assert d["type"] == "function" and d["id"] and d["function"]["name"], d
                got[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert "name" not in d["function"] and "id" not in d
                pieces += 1
            got[d["index"]]["arguments"] += d["function"]["arguments"]
    assert f == finish
    assert got_content == (content or "")
    assert [(g["name"], g["arguments"]) for _, g in sorted(got.items())] == [(t.name, t.arguments) for t in found]
    if found and chunk == 1 and parser != "pythonic":
        assert pieces > len(found)  # arguments streamed, not sent whole at the end


@pytest.mark.parametrize("choice,text", [
    (ToolChoice("required"), '[{"name":"get_weather","parameters":{"city":"X"}},{"name":"f","parameters":{"q":[1,{"r":"s"}]}}]'),
    (ToolChoice("named", "get_weather"), '{"city":"Y","unit":"c"}'),
])
def test_streamed_forced_calls_add_up(choice, text):
    stream = ToolCallStream(choice, None)
    args: dict[int, str] = {}
    names = {}
    for i, ch in enumerate(text):
        c, deltas, f = stream.step(ch, "stop" if i == len(text) - 1 else None)
        assert c == ""
        for d in deltas:
            names.setdefault(d["index"], d["function"].get("name"))
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    want = forced_calls(text, choice)
    assert [(names[k], args[k]) for k in sorted(args)] == [(t.name, t.arguments) for t in want]
    assert f == ("tool_calls" if choice.mode == "required" else "stop")


FORCED_CASES = [
    ("required", None, '[{"name":"get_weather","parameters":{"city":"X"}},{"name":"f","parameters":{"q":[1,{"r":"s"}]}}]'),
    ("named", "get_weather", '{"city":"Y","unit":"c"}'),
]


@pytest.mark.parametrize("mode,name,parser,text", [("auto", None, p, t) for p, t in STREAM_CASES]
                         + [(m, n, None, t) for m, n, t in FORCED_CASES])
def test_cut_at_every_length_streamed_and_not_are_one_message(mode, name, parser, text):
    """max_tokens may cut the text anywhere (finish_reason length): what a stream of the prefix
    sends, accumulated as the openai client does, is the non-streamed message of that prefix, in
    auto mode with each parser as in required and named mode (a call begun is kept as far as it
    was generated, on both sides)."""
    from kvledger.server.tool_stream import tool_message

    choice = ToolChoice(mode, name)
    for cut in range(1, len(text) + 1):
        prefix = text[:cut]
        content, calls, finish = tool_message(choice, parser, prefix, "length")
        stream = ToolCallStream(choice, parser)
        got_content, got = "", {}
        for i, ch in enumerate(prefix):
            c, deltas, f = stream.step(ch, "length" if i == len(prefix) - 1 else None)
            got_content += c
            for d in deltas:
                g = got.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                g["arguments"] += d["function"]["arguments"]
        assert (f, got_content or None) == (finish, content or None), prefix
        assert [(g["name"], g["arguments"]) for _, g in sorted(got.items())] == [(t.name, t.arguments) for t in calls], prefix
