"""Tool calls streamed as they form: ``delta.tool_calls`` fragments, as vLLM's parsers'
``extract_tool_calls_streaming`` send them.

A call's first fragment carries its index, id, type and name (``arguments: ""``); later ones
carry pieces of its arguments; text before the call goes out as content. Each format is read
by a coroutine fed one character at a time, so partial tags and partial JSON need no
re-parsing. The arguments are re-spelled the way the non-streamed response spells them
(json_stream.JsonCanonicalizer), and when the choice ends its whole text is parsed exactly as
without streaming and only the missing rest is sent: the fragments add up to the non-streamed
``tool_calls`` and content. When max_tokens cuts a call short (forced, or auto with a parser),
the non-streamed answer is read by this same reader (``tool_message``): the calls as far as
they were generated, so the stream and the whole response still agree. Otherwise what was sent cannot be taken back: if an
auto-parsed text does not parse in the end, the stream has shown the start of a call, as in
vLLM; this is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from kvledger.server.json_stream import JsonCanonicalizer
from kvledger.server.tools import ToolCall, ToolChoice, new_call_id, pythonic_arguments, tool_output

logger = logging.getLogger("kvledger.server")

_WS = " \t\n\r"
Reader = Generator[None, str, Any]  # receives characters with ``c = yield``


@dataclass
class _Call:
    id: str
    name: str | None = None
    pending: str = ""  # arguments read before the name was known
    sent: str = ""  # arguments sent


class ToolCallStream:
    """One streamed choice's text -> (content delta, tool-call fragments) per step."""

    def __init__(self, choice: ToolChoice, parser: str | None) -> None:
        self.choice, self.parser = choice, parser
        self.text = ""
        self.content_sent = ""
        self.calls: list[_Call] = []
        self._content = ""
        self._deltas: dict[int, dict[str, Any]] = {}
        if choice.mode == "named":
            self._reader: Reader = self._named()
        elif choice.mode == "required":
            self._reader = self._required()
        else:
            self._reader = _READERS[parser](self)  # type: ignore[index]
        next(self._reader)

    def step(self, text: str, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """Feed the step's new text; with a finish_reason also settle the rest. Returns the
        content delta, the fragments (one per call index) and the finish reason to send."""
        self.text += text
        for c in text:
            self._reader.send(c)
        finish = None
        if finish_reason is not None:
            finish = self._settle(finish_reason)
        content, self._content = self._content, ""
        self.content_sent += content
        deltas = [self._deltas[k] for k in sorted(self._deltas)]
        self._deltas = {}
        return content, deltas, finish

    # -- what the readers emit ------------------------------------------------------------------

    def _emit_content(self, s: str) -> None:
        self._content += s

    def _open(self, name: str | None = None) -> _Call:
        call = _Call(new_call_id(self.parser))
        self.calls.append(call)
        if name is not None:
            self._name(call, name)
        return call

    def _name(self, call: _Call, name: str) -> None:
        call.name = name
        index = self.calls.index(call)
        self._deltas[index] = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        if call.pending:
            self._args(call, call.pending)
            call.pending = ""

    def _args(self, call: _Call, s: str) -> None:
        if not s:
            return
        if call.name is None:
            call.pending += s
            return
        call.sent += s
        index = self.calls.index(call)
        d = self._deltas.setdefault(index, {"index": index, "function": {"arguments": ""}})
        d["function"]["arguments"] += s

    def _settle(self, finish_reason: str) -> str | None:
        """The rest of the non-streamed answer, sent as what is missing."""
        content, calls, finish = tool_message(self.choice, self.parser, self.text, finish_reason)
        final = (content or "") if calls or self.choice.mode != "named" else self.text
        sent = self.content_sent + self._content
        if final.startswith(sent):
            self._content += final[len(sent) :]
        else:
            logger.warning("streamed content is not a prefix of the final content")
        begun = [c for c in self.calls if c.name is not None]
        if len(begun) > len(calls):
            logger.warning("%d streamed tool call(s) did not parse in the finished text", len(begun) - len(calls))
        for k, call in enumerate(calls):
            if k < len(begun):
                s = begun[k]
                if s.name == call.name and call.arguments.startswith(s.sent):
                    self._args(s, call.arguments[len(s.sent) :])
                else:
                    logger.warning("streamed tool call %d differs from the finished text's", k)
                continue
            self._deltas[k] = call.to_openai(index=k)
        return finish

    # -- readers: coroutines fed one character at a time ----------------------------------------

    def _stall(self) -> Reader:
        """Text the format does not allow: ignore the rest (the final parse decides)."""
        while True:
            yield

    def _content_until(self, tag: str, emit: bool = True) -> Reader:
        """Content up to ``tag``, holding back a tail that may be the tag's beginning."""
        held = ""
        while True:
            held += yield
            if not emit:
                if held.endswith(tag):
                    return
                held = held[-len(tag) :]
                continue
            if held.endswith(tag):
                self._emit_content(held[: -len(tag)])
                return
            keep = next((k for k in range(min(len(held), len(tag) - 1), 0, -1) if tag.startswith(held[-k:])), 0)
            self._emit_content(held[: len(held) - keep])
            held = held[len(held) - keep :]

    def _skip_ws(self) -> Reader:
        c = yield
        while c in _WS:
            c = yield
        return c

    def _value(self, c: str, sink: Callable[[str], None]) -> Reader:
        """One JSON value from its first character ``c``; each character goes to ``sink``.
        Returns the ',', '}' or ']' that ends it."""
        depth, in_str, esc = 0, False, False
        while True:
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                if depth == 0:
                    return c
                depth -= 1
            elif c == "," and depth == 0:
                return c
            sink(c)
            c = yield

    def _call_object(self, args_keys: tuple[str, ...]) -> Reader:
        """After a '{': one {"name": ..., "arguments": {...}} object, up to its '}'."""
        call = self._open()
        streamed_key = None
        while True:
            c = yield from self._skip_ws()
            if c == ",":
                continue
            if c == "}":
                return
            if c != '"':
                yield from self._stall()
            raw, esc = c, False  # the key: a string, read to its closing quote
            while True:
                ch = yield
                raw += ch
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    break
            try:
                key = json.loads(raw)
            except ValueError:
                yield from self._stall()
            if (yield from self._skip_ws()) != ":":
                yield from self._stall()
            c = yield from self._skip_ws()
            if key == "name":
                buf: list[str] = []
                end = yield from self._value(c, buf.append)
                try:
                    name = json.loads("".join(buf))
                except ValueError:
                    name = None
                if isinstance(name, str) and call.name is None:
                    self._name(call, name)
            elif key in args_keys and streamed_key is None and c in "{[":
                streamed_key = key
                canon = JsonCanonicalizer()
                end = yield from self._value(c, lambda ch, k=canon: self._args(call, k.feed(ch)))
                self._args(call, canon.flush())
            else:
                end = yield from self._value(c, lambda ch: None)
            if end == "}":
                return
            if end != ",":
                yield from self._stall()

    def _call_array(self, args_keys: tuple[str, ...]) -> Reader:
        """After a '[': call objects separated by commas."""
        while True:
            c = yield from self._skip_ws()
            if c == ",":
                continue
            if c != "{":
                yield from self._stall()
            yield from self._call_object(args_keys)

    def _named(self) -> Reader:
        call = self._open(self.choice.name)
        while True:
            self._args(call, (yield))

    def _required(self) -> Reader:
        if (yield from self._skip_ws()) == "[":
            yield from self._call_array(("parameters",))
        yield from self._stall()

    def _hermes(self) -> Reader:
        yield from self._content_until("<tool_call>")
        while True:
            if (yield from self._skip_ws()) != "{":
                yield from self._stall()
            yield from self._call_object(("arguments", "parameters"))
            yield from self._content_until("<tool_call>", emit=False)  # text between calls is dropped

    def _mistral(self) -> Reader:
        yield from self._content_until("[TOOL_CALLS]")
        c = yield from self._skip_ws()
        if c == "[":
            yield from self._call_array(("arguments", "parameters"))
        elif c == "{":
            yield from self._call_object(("arguments", "parameters"))
        yield from self._stall()

    def _leading(self, tag: str, opener: str) -> Reader:
        """Formats whose whole text is the calls: True once ``opener`` follows the optional
        ``tag``; False (all text so far sent as content) as soon as it cannot."""
        held = ""
        while True:
            held += yield
            body = held.lstrip(_WS)
            if not body or (len(body) < len(tag) and tag.startswith(body)):
                continue
            if body.startswith(tag):
                body = body[len(tag) :].lstrip(_WS)
                if not body:
                    continue
            if body == opener:
                return True
            self._emit_content(held)
            return False

    def _content_rest(self) -> Reader:
        while True:
            self._emit_content((yield))

    def _llama3_json(self) -> Reader:
        if not (yield from self._leading("<|python_tag|>", "{")):
            yield from self._content_rest()
        while True:
            yield from self._call_object(("arguments", "parameters"))
            c = yield from self._skip_ws()
            while c in _WS + ";":
                c = yield
            if c != "{":
                yield from self._stall()

    def _pythonic(self) -> Reader:
        if not (yield from self._leading("<|python_start|>", "[")):
            yield from self._content_rest()
        while True:
            c = yield from self._skip_ws()
            if c == ",":
                continue
            if not (c.isalpha() or c == "_"):
                yield from self._stall()
            name = c
            while (c := (yield)) != "(":
                if not (c.isalnum() or c == "_"):
                    yield from self._stall()
                name += c
            call = self._open(name)
            elem = yield from self._python_call_body()
            args = pythonic_arguments(f"{name}({elem}")
            if args is None:
                yield from self._stall()
            self._args(call, args)

    def _python_call_body(self) -> Reader:
        """After 'name(': the text up to and including the matching ')'."""
        text, depth, quote, esc = "", 0, "", False
        while True:
            c = yield
            text += c
            if quote:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    return text
                depth -= 1


_READERS: dict[str, Callable[[ToolCallStream], Reader]] = {
    "hermes": ToolCallStream._hermes,
    "llama3_json": ToolCallStream._llama3_json,
    "mistral": ToolCallStream._mistral,
    "pythonic": ToolCallStream._pythonic,
}


def tool_message(
    choice: ToolChoice, parser: str | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish_reason) of a finished choice, streamed or not. A call (forced,
    or auto with a parser) cut short by max_tokens is the calls as far as they were generated (the last one's arguments
    unfinished), as OpenAI answers, and exactly what a stream of the same text has sent (vLLM's
    non-streamed answer drops them while its stream sent them: the two disagree)."""
    content, calls, finish = tool_output(choice, parser, text, finish_reason)
    forced = choice.mode in ("named", "required")
    if finish_reason == "length" and (forced or (choice.mode == "auto" and parser is not None)):
        sent, cut = _so_far(choice, parser, text)
        if len(cut) > len(calls):  # a call the stream began did not finish: as far as it got
            return (None if forced else sent or None), cut, finish_reason
    return content, calls, finish


def _so_far(choice: ToolChoice, parser: str | None, text: str) -> tuple[str, list[ToolCall]]:
    """(content, named calls) a stream of ``text`` has sent, arguments as far as they were sent."""
    stream = ToolCallStream(choice, parser)
    for c in text:
        stream._reader.send(c)
    sent = stream.content_sent + stream._content
    return sent, [ToolCall(call.name, call.sent) for call in stream.calls if call.name is not None]
