"""OpenAI's Responses API on the wire: the request model of /v1/responses and its translation
into a chat completion request (so the chat path's template, tools, structured outputs and
parsers serve it), and the output items a finished answer becomes.

``input`` is text (one user message) or items: messages (``input_text`` / ``output_text``
parts), ``function_call`` items (the assistant's earlier calls) and ``function_call_output``
items (their results, role ``tool``); ``instructions`` is a system message in front, not
carried to a follow-up (OpenAI's rule); ``text.format`` json_schema / json_object is
``response_format``; function tools and ``tool_choice`` map onto chat's. Fields this server
cannot honour are refused with a 400 naming them.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import Field

from kvledger.server.fields import FieldError
from kvledger.server.protocol import INT64_MAX, Int64, _Request
from kvledger.server.tools import ToolCall

# vLLM's sampling extras a Responses request may carry; forwarded to the chat request.
_FORWARDED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "stop", "ignore_eos", "min_tokens", "logit_bias", "priority")  # fmt: skip
_ACCEPTED = frozenset({"metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier"})
_REFUSED = {
    "reasoning": "reasoning effort and summaries are not implemented (a --reasoning-parser server "
                 "returns the model's thinking as reasoning items)",
    "conversation": "conversations are not stored; use previous_response_id",
    "prompt": "stored prompt templates are not available",
    "include": "no extra output (reasoning content, logprobs, search results) is produced",
    "top_logprobs": "logprobs are not returned by this endpoint",
    "max_tool_calls": "the number of tool calls is not limited",
}
_NEUTRAL = {"truncation": ("disabled",), "include": ([],), "max_tool_calls": (), "top_logprobs": (0,)}


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(None, max_length=256)
    truncation: str | None = None
    priority: Int64 = 0

    def check(self) -> dict[str, Any]:
        """The forwarded sampling extras, after refusing what cannot be honoured."""
        out = {}
        for name, value in (self.model_extra or {}).items():
            if value is None or name in _ACCEPTED:
                continue
            if name in _FORWARDED:
                out[name] = value
            elif name in _REFUSED:
                if name == "reasoning" and isinstance(value, dict) and all(v is None for v in value.values()):
                    continue  # {"effort": null, ...}: nothing asked
                if value not in _NEUTRAL.get(name, ()):
                    raise FieldError(f"{name} is not supported: {_REFUSED[name]}", param=name)
            else:
                raise FieldError(f"unknown field {name!r}", param=name)
        if self.truncation not in (None, "disabled"):
            raise FieldError("truncation 'auto' is not supported: prompts are never cut", param="truncation")
        if self.background and self.stream:
            raise FieldError("background responses cannot be streamed here; poll GET /v1/responses/{id}", param="background")
        if self.background and not self.store:
            raise FieldError("background responses need store: true (they are read back by id)", param="background")
        if isinstance(self.input, str) and not self.input:
            raise FieldError("input is empty", param="input")
        return out

    def chat_fields(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request: ``history`` (a previous response's conversation), then
        this input; instructions in front."""
        extras = self.check()
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += history
        messages += input_messages(self.input)
        out: dict[str, Any] = {**extras, "model": self.model, "messages": messages,
                               "parallel_tool_calls": self.parallel_tool_calls}  # fmt: skip
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            out["max_tokens"] = self.max_output_tokens
        if self.tools:
            out["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            out["tool_choice"] = _tool_choice(self.tool_choice)
        rf = _text_format(self.text)
        if rf is not None:
            out["response_format"] = rf
        return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}.content must be a string or a list of text parts", param=where)
    parts = []
    for i, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise FieldError(f"{where}.content[{i}]: {kind} is not supported (this server serves text-only models)", param=where)
        else:
            raise FieldError(f"{where}.content[{i}] must be an input_text or output_text part", param=where)
    return "\n".join(parts)


def input_messages(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (an assistant's calls merged into one message)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise FieldError("input is empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldError(f"{where}.role must be user, system, developer or assistant", param=where)
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, cid)):
                raise FieldError(f"{where}: a function_call item needs call_id, name and arguments strings", param=where)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str) or output is None:
                raise FieldError(f"{where}: a function_call_output item needs call_id and output", param=where)
            out.append({"role": "tool", "tool_call_id": cid, "content": _text(output, where)})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: not shown to the model again
        else:
            raise FieldError(f"{where}: input items of type {kind!r} are not supported", param=where)
    return out


def _tool(i: int, t: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise FieldError(f"tools[{i}]: only function tools are served (got {kind!r})", param="tools")
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise FieldError(f"tools[{i}].name must be a non-empty string", param="tools")
    fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(tc: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(tc, str):
        return tc  # none / auto / required: checked by the chat path
    if tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise FieldError("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", param="tool_choice")


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise FieldError("text.format json_schema needs a schema object", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise FieldError(f"text.format type {kind!r} is not one of text, json_object, json_schema", param="text.format")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    """The thinking (--reasoning-parser) as a reasoning item; not shown to the model again."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def call_item(call: ToolCall, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}  # fmt: skip


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up continues from."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return input_messages(items) if items else []
