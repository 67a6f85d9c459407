"""Anthropic's Messages API on the wire: the request models of /v1/messages and
/v1/messages/count_tokens, and their translation into a chat completion request, so that the
chat path (template, tools, structured outputs, parsers) serves them unchanged.

Translation, as vLLM's Anthropic front does: ``system`` becomes a system message; ``tool_use``
blocks become the assistant's ``tool_calls`` (``input`` as JSON arguments); ``tool_result``
blocks become role ``tool`` messages; ``stop_sequences`` is ``stop``; ``tool_choice`` auto /
any / tool / none is auto / required / the named function / none, and
``disable_parallel_tool_use`` is ``parallel_tool_calls: false``. Fields this server cannot
honour are refused with a 400 naming them, never dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from kvledger.server.fields import FieldError
from kvledger.server.protocol import INT64_MAX, Int64, _Request

# Request fields accepted without effect here (Anthropic's account, routing and cache hints;
# kvledger's prefix cache needs no breakpoints).
_ACCEPTED = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "user_profile_id",
                       "workspace_id", "diagnostics"})  # fmt: skip
_REFUSED = {
    "container": "containers (Anthropic's code execution) are not available",
    "mcp_servers": "MCP servers are not available",
    "context_management": "context management is not implemented",
    "speed": "one speed is served ('standard')",
}
_IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # earlier turns' thinking


class AnthropicTool(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused

    @model_validator(mode="after")
    def _custom_only(self) -> AnthropicTool:
        if self.type not in (None, "custom"):
            raise ValueError(f"tool type {self.type!r} is not served (only custom tools with an input_schema)")
        return self

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class _MessagesBase(_Request):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: json_schema -> structured outputs

    def _check_extra(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if value is None or name in _ACCEPTED:
                continue
            if name == "speed" and value == "standard":
                continue
            if name in _REFUSED:
                raise FieldError(f"{name} is not supported: {_REFUSED[name]}", param=name)
            raise FieldError(f"unknown field {name!r}", param=name)
        if self.thinking is not None and self.thinking.get("type") not in ("enabled", "adaptive", "disabled"):
            raise FieldError("thinking.type must be enabled, adaptive or disabled", param="thinking")

    @property
    def wants_thinking(self) -> bool:
        """Thinking blocks asked for (the budget is not enforced: the model thinks as it does)."""
        return self.thinking is not None and self.thinking.get("type") in ("enabled", "adaptive")

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request's messages, tools and tool choice."""
        self._check_extra()
        out: dict[str, Any] = {"model": self.model, "messages": _messages(self.system, self.messages)}
        if self.tools:
            out["tools"] = [t.to_openai() for t in self.tools]
        if self.tool_choice is not None:
            out.update(_tool_choice(self.tool_choice, bool(self.tools)))
        elif self.tools:
            out["tool_choice"] = "auto"  # Anthropic's default with tools
        out.update(_output_config(self.output_config))
        out["include_reasoning"] = self.wants_thinking
        budget = (self.thinking or {}).get("budget_tokens")
        if self.wants_thinking and budget is not None:
            out["thinking_token_budget"] = budget  # checked as the chat field
        return out


class MessagesRequest(_MessagesBase):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int64 | None = Field(None, ge=0)

    def to_chat(self) -> dict[str, Any]:
        if self.stop_sequences is not None and any(s == "" for s in self.stop_sequences):
            raise FieldError("stop_sequences must not hold an empty string", param="stop_sequences")
        out = self.chat_fields()
        out["max_tokens"] = self.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop_sequences:
            out["stop"] = self.stop_sequences
        return out


class CountTokensRequest(_MessagesBase):
    """/v1/messages/count_tokens: the same input, nothing generated."""


def _text_of_blocks(blocks: list[dict[str, Any]], where: str) -> str:
    parts = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text" or not isinstance(b.get("text"), str):
            raise FieldError(f"{where}[{i}] must be a text block ({{'type': 'text', 'text': ...}})", param=where)
        parts.append(b["text"])
    return "\n".join(parts)


def _messages(system: str | list[dict[str, Any]] | None, messages: list[MessageParam]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _text_of_blocks(system, "system")})
    for m, msg in enumerate(messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for i, block in enumerate(msg.content):
            where = f"messages[{m}].content[{i}]"
            kind = block.get("type")
            if not isinstance(kind, str):
                raise FieldError(f"{where}.type must be a string naming the block's kind", param=where)
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise FieldError(f"{where}.text must be a string", param=where)
                texts.append(block["text"])
            elif kind == "tool_use" and msg.role == "assistant":
                name, args, cid = block.get("name"), block.get("input", {}), block.get("id")
                if not isinstance(name, str) or not isinstance(cid, str) or not isinstance(args, dict):
                    raise FieldError(f"{where}: a tool_use block needs id, name and an input object", param=where)
                calls.append({"id": cid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and msg.role == "user":
                cid, content = block.get("tool_use_id"), block.get("content", "")
                if not isinstance(cid, str):
                    raise FieldError(f"{where}: a tool_result block needs tool_use_id", param=where)
                if not isinstance(content, str):
                    if not isinstance(content, list):
                        raise FieldError(f"{where}.content must be a string or text blocks", param=where)
                    content = _text_of_blocks(content, f"{where}.content")
                results.append({"role": "tool", "tool_call_id": cid, "content": content})
            elif kind in _IGNORED_BLOCKS and msg.role == "assistant":
                continue
            elif kind in ("image", "document", "search_result"):
                raise FieldError(f"{where}: {kind} blocks are not supported (this server serves text-only models)", param=where)
            else:
                raise FieldError(f"{where}: a {kind!r} block is not allowed in a {msg.role} message", param=where)
        out.extend(results)  # the results answer the previous assistant turn's calls
        if msg.role == "assistant":
            if texts or calls:
                d: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
                if calls:
                    d["tool_calls"] = calls
                out.append(d)
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_choice(tc: dict[str, Any], has_tools: bool) -> dict[str, Any]:
    kind = tc.get("type")
    out: dict[str, Any] = {}
    if tc.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    if kind == "auto":
        out["tool_choice"] = "auto" if has_tools else "none"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise FieldError("tool_choice of type 'tool' needs the tool's name", param="tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    elif kind == "none":
        out["tool_choice"] = "none"
    else:
        raise FieldError(f"tool_choice type {kind!r} is not one of auto, any, tool, none", param="tool_choice")
    return out


def _output_config(cfg: dict[str, Any] | None) -> dict[str, Any]:
    """``output_config.format`` (Anthropic's structured outputs) as a json_schema response_format."""
    if not cfg:
        return {}
    unknown = set(cfg) - {"format", "effort"}
    if unknown:
        raise FieldError(f"output_config has unknown fields {sorted(unknown)}", param="output_config")
    if cfg.get("effort") is not None:
        raise FieldError("output_config.effort is not supported: this server has no reasoning effort", param="output_config.effort")
    fmt = cfg.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise FieldError("output_config.format must be {'type': 'json_schema', 'schema': {...}}", param="output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}
