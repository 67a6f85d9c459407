"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path
(kvledger/server/chat_run.py), answered in Anthropic's shapes.

A stream is Anthropic's event sequence: ``message_start``, then per content block
``content_block_start`` / ``content_block_delta`` (``text_delta``, or ``input_json_delta`` for a
``tool_use`` block's input) / ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``; a ``ping`` follows ``message_start``, as Anthropic sends one. The
blocks are built from the same content and tool-call pieces /v1/chat/completions streams, so the
stream adds up to the non-streamed message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvledger.errors import EngineDeadError, KVLedgerError
from kvledger.server.chat_run import ChatRun, chat_request, prepare_chat
from kvledger.server.errors import anthropic_error_body
from kvledger.server.fields import FieldError
from kvledger.server.protocol import UsageInfo
from kvledger.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from kvledger.server.serving import ServingContext
from kvledger.server.streaming import SSEResponse
from kvledger.server.tools import ToolCall


def stop_reason(finish: str | None, stop: int | str | None, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) from the chat path's finish."""
    if has_calls and finish != "length":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as Anthropic's ``input`` object; {} for arguments cut by max_tokens."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _usage(u: UsageInfo, output: bool = True) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens the prefix cache did not serve."""
    cached = u.prompt_tokens_details.cached_tokens
    d: dict[str, Any] = {"input_tokens": u.prompt_tokens - cached, "cache_read_input_tokens": cached}
    if output:
        d["output_tokens"] = u.completion_tokens
    return d


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


async def _events(run: ChatRun, message: dict[str, Any]) -> AsyncIterator[str]:
    """Anthropic's stream of one answer."""
    yield _event("message_start", {"message": {**message, "usage": {**_usage(run.usage(), False), "output_tokens": 0}}})
    yield _event("ping", {})
    index = -1  # the open block's index
    open_kind: str | None = None
    by_call: dict[int, int] = {}  # tool-call index -> block index
    finish, stop, calls = None, None, False
    try:
        async for piece in run.pieces():
            if piece.reasoning:
                if open_kind != "thinking":
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, "thinking"
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "thinking_delta", "thinking": piece.reasoning}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            if piece.content:
                if open_kind != "text":
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, "text"
                    yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece.content}})
            for frag in piece.tool_calls:
                fn = frag.get("function") or {}
                if frag["index"] not in by_call:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, "tool_use"
                    by_call[frag["index"]] = index
                    calls = True
                    block = {"type": "tool_use", "id": frag.get("id"), "name": fn.get("name"), "input": {}}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                if fn.get("arguments"):
                    delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                    yield _event("content_block_delta", {"index": by_call[frag["index"]], "delta": delta})
            if piece.finish_reason is not None:
                finish, stop = piece.finish_reason, piece.stop_reason
    except (EngineDeadError, KVLedgerError) as e:
        status = 503 if isinstance(e, EngineDeadError) else 500
        yield _event("error", {"error": anthropic_error_body(status, str(e))["error"]})
        return
    if open_kind is None:  # an empty answer is one empty text block, as non-streamed
        index = 0
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event("content_block_stop", {"index": index})
    reason, sequence = stop_reason(finish, stop, calls)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": _usage(run.usage())})  # fmt: skip
    yield _event("message_stop", {})


def mount_messages(app: FastAPI, ctx: ServingContext) -> None:
    model_name = ctx.model_name

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        if body.wants_thinking and ctx.config.reasoning_parser is None:
            raise FieldError("thinking needs a reasoning model: start the server with --reasoning-parser",
                             param="thinking")  # fmt: skip
        chat = chat_request(body.to_chat())
        rid = f"msg_{uuid.uuid4().hex}"
        run = await ChatRun.start(ctx, chat, rid)
        message: dict[str, Any] = {
            "id": rid, "type": "message", "role": "assistant", "model": body.model or model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
        }  # fmt: skip
        if body.stream:
            return SSEResponse(_events(run, message), on_close=run.abort)
        answer = await run.answer(request)
        if answer is None:
            return Response(status_code=499)  # the client is gone
        content: list[dict[str, Any]] = []
        if answer.reasoning:  # no signature: nothing here verifies a thinking block sent back
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.content:
            content.append({"type": "text", "text": answer.content})
        for call in answer.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call)})
        if not content:
            content.append({"type": "text", "text": ""})
        reason, sequence = stop_reason(answer.finish_reason, answer.stop_reason, bool(answer.tool_calls))
        message.update(content=content, stop_reason=reason, stop_sequence=sequence, usage=_usage(answer.usage))
        return JSONResponse(message)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        fields = body.chat_fields()
        fields["max_tokens"] = 1
        if body.tools:  # rendered as for /v1/messages; no tool-call parser needed to count
            fields["tool_choice"], fields["parallel_tool_calls"] = "none", True
        prepared = prepare_chat(ctx, chat_request(fields))
        ids = ctx.tokenizer(prepared.prompt, add_special_tokens=prepared.add_special_tokens).input_ids
        return JSONResponse({"input_tokens": len(ids)})
