"""Tool calling for /v1/chat/completions and LLM.chat: tool_choice, the grammar that forces a
call, and the parsers that find calls in free text (``--tool-call-parser``).

``required`` and a named function are enforced by a JSON-schema grammar (so the arguments
always parse): a named choice generates the function's arguments object; ``required``
generates a JSON array of ``{"name", "parameters"}`` items, one per call (at most one when
``parallel_tool_calls`` is false), as vLLM does. ``auto`` leaves the model free and a parser
extracts the calls from its text in the model family's own format.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvledger.errors import InvalidRequestError
from kvledger.structured.params import StructuredOutputsParams

TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


def new_call_id(parser: str | None = None) -> str:
    """A tool call's id; Mistral's chat template wants 9 alphanumeric characters."""
    if parser == "mistral":
        return uuid.uuid4().hex[:9]
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d["index"] = index
        return d


@dataclass
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> its JSON schema of parameters; 400 on a malformed tool."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params
    return out


def resolve_tool_choice(
    tools: dict[str, dict[str, Any]], tool_choice: Any, auto_enabled: bool
) -> ToolChoice:
    """OpenAI's tool_choice (default: auto when there are tools) checked against the server."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice must be none, auto, required or "
                                      "{'type': 'function', 'function': {'name': ...}}")
        if name not in tools:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
        return ToolChoice("named", name)
    if tool_choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f"tool_choice {tool_choice!r} is not none, auto, required or a named function")
    if tool_choice != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "auto" and not auto_enabled:
        raise InvalidRequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    return ToolChoice(tool_choice)


def forced_call_constraint(
    tools: dict[str, dict[str, Any]], choice: ToolChoice, parallel: bool, **options: Any
) -> StructuredOutputsParams | None:
    """The grammar for ``required`` / a named function; None for none / auto."""
    if choice.mode == "named":
        return StructuredOutputsParams(json=tools[choice.name], **options)
    if choice.mode != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        }
        for name, params in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, **options)


def forced_calls(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls in a forced (grammar-constrained) output; [] if it was cut short."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []  # max_tokens ended it before the grammar did
    if choice.mode == "named":
        return [ToolCall(choice.name, text)]  # the arguments as generated, as vLLM sends them
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


# -- parsers for tool_choice="auto" --------------------------------------------------------------


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) found in ``text`` by the named parser; text it cannot read is content."""
    content, calls = _PARSERS[parser](text)
    return (content or None) if calls else text, calls


def _call_from_json(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return text[:start], calls  # content as written (not stripped), as vLLM


def _llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.x JSON: {"name": ..., "parameters": {...}} objects, ';'-separated."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, dec, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, end = dec.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call_from_json(obj)
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return "", calls


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Mistral: [TOOL_CALLS] followed by a JSON array of {"name", "arguments"}."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start + len("[TOOL_CALLS]") :].lstrip())
    except json.JSONDecodeError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_json(v) for v in items]
    if not calls or any(c is None for c in calls):
        return text, []
    for c in calls:
        c.id = new_call_id("mistral")  # type: ignore[union-attr]
    return text[:start], calls  # type: ignore[return-value]


def _pythonic_call(node: ast.expr) -> ToolCall | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except ValueError:
        return None
    return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


def pythonic_arguments(call_text: str) -> str | None:
    """The JSON arguments of one ``name(k=v, ...)`` call; None if it is not one."""
    try:
        call = _pythonic_call(ast.parse(call_text.strip(), mode="eval").body)
    except SyntaxError:
        return None
    return call.arguments if call is not None else None


def _pythonic(text: str) -> tuple[str, list[ToolCall]]:
    """Pythonic (Llama 3.2 / 4): [get_weather(city="Paris"), other(x=1)]."""
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = [_pythonic_call(node) for node in tree.elts]
    if any(c is None for c in calls):
        return text, []
    return "", calls  # type: ignore[return-value]


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "pythonic": _pythonic}


def chat_constraint(
    body: Any, params: Any, defaults: dict[str, Any], auto_enabled: bool
) -> ToolChoice:
    """A chat request's tools and structured-output fields -> its grammar (set on ``params``)
    and its tool choice."""
    from kvledger.server.structured_fields import server_options, structured_params

    tools = check_tools(body.tools)
    choice = ToolChoice("none")
    if body.tools or body.tool_choice not in (None, "none"):
        choice = resolve_tool_choice(tools, body.tool_choice, auto_enabled)
    structured = structured_params(body, defaults)
    forced = forced_call_constraint(tools, choice, body.parallel_tool_calls, **server_options(defaults))
    if forced is not None and structured is not None:
        raise InvalidRequestError(
            f"tool_choice {choice.mode!r} forces a tool call; it cannot be combined with "
            "response_format or structured outputs"
        )
    if forced is not None:
        from kvledger.structured.backends import resolve_backend

        resolve_backend(forced, (defaults or {}).get("backend", "auto"))
    params.structured_outputs = forced or structured
    return choice


def tool_output(
    choice: ToolChoice, parser: str | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish_reason) of a finished choice's text."""
    if choice.mode in ("named", "required"):
        calls = forced_calls(text, choice)
        if not calls:  # cut short by max_tokens: tool_stream.tool_message reads it as far as it got
            return text, [], finish_reason
        return None, calls, "tool_calls" if choice.mode == "required" else finish_reason
    if choice.mode == "auto" and parser is not None:
        content, calls = parse_tool_calls(parser, text)
        return content, calls, "tool_calls" if calls else finish_reason
    return text, [], finish_reason
