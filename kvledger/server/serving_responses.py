"""OpenAI's Responses API over the chat path: POST /v1/responses (streamed with its typed
events or not, or in the background), GET and DELETE /v1/responses/{id}, and
POST /v1/responses/{id}/cancel.

Responses live in a bounded in-memory store for the server's lifetime (``STORE_SIZE``, oldest
dropped first; ``store: false`` keeps one out), holding each response and the conversation
it ended, so that ``previous_response_id`` continues it. Only a background response can be
cancelled (OpenAI's rule): its task is cancelled and the request aborted, its blocks freed.

A stream is ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``; for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``;
for a function call ``response.function_call_arguments.delta`` ... ``.done``; then
``response.output_item.done``; and last ``response.completed`` (``response.incomplete`` when
max_output_tokens cut it), each with a ``sequence_number``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvledger.errors import EngineDeadError, KVLedgerError
from kvledger.server.chat_run import Answer, ChatRun, chat_request
from kvledger.server.errors import APIError
from kvledger.server.protocol import UsageInfo
from kvledger.server.protocol_responses import (
    ResponsesRequest,
    call_item,
    input_messages,
    message_item,
    new_id,
    output_messages,
    reasoning_item,
)
from kvledger.server.serving import ServingContext
from kvledger.server.streaming import SSEResponse
from kvledger.server.tools import ToolCall

logger = logging.getLogger("kvledger.server")

STORE_SIZE = 1024  # responses kept for previous_response_id and GET, oldest dropped first


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages before the output (no instructions)
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response's
    run: ChatRun | None = field(default=None, repr=False)  # ... and its request


class ResponseStore:
    """The server's responses by id, bounded (least recently stored dropped first)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, rid: str) -> Stored:
        item = self._items.get(rid)
        if item is None:
            raise APIError(404, f"no response with id {rid!r} is stored on this server", param="response_id",
                           code="response_not_found")  # fmt: skip
        return item

    def put(self, rid: str, item: Stored) -> None:
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def pop(self, rid: str) -> Stored:
        item = self.get(rid)
        del self._items[rid]
        return item


def _usage(u: UsageInfo) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _finish(base: dict[str, Any], output: list[dict[str, Any]], finish: str | None, usage: UsageInfo) -> dict[str, Any]:
    cut = finish == "length"
    return {**base, "status": "incomplete" if cut else "completed", "output": output, "usage": _usage(usage),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}  # fmt: skip


def _answer_items(answer: Answer) -> list[dict[str, Any]]:
    items = [reasoning_item(answer.reasoning, new_id("rs"))] if answer.reasoning else []
    items += [message_item(answer.content, new_id("msg"))] if answer.content else []
    return items + [call_item(c, new_id("fc")) for c in answer.tool_calls]


class _Events:
    """The typed events of one streamed response; ``items`` are its output so far."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: int | None = None  # the index of the item being written
        self.text = ""  # the open message's text
        self.by_call: dict[int, int] = {}  # tool-call fragment index -> output index

    def ev(self, kind: str, **payload: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **payload}, ensure_ascii=False)
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def close(self) -> list[str]:
        if self.open is None:
            return []
        i, item = self.open, self.items[self.open]
        self.open = None
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            item.update(status="completed", content=[part])
            out = [self.ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                           text=self.text)]  # fmt: skip
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item.update(status="completed", content=[part])
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out = [self.ev("response.output_text.done", **where, text=self.text, logprobs=[]),
                   self.ev("response.content_part.done", **where, part=part)]  # fmt: skip
        else:
            item["status"] = "completed"
            out = [self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                           name=item["name"], arguments=item["arguments"])]  # fmt: skip
        return [*out, self.ev("response.output_item.done", output_index=i, item=item)]

    def _begin(self, item: dict[str, Any]) -> list[str]:
        """Close the open item and open ``item`` (an in-progress output item)."""
        out = self.close()
        self.items.append(item)
        self.open, self.text = len(self.items) - 1, ""
        return [*out, self.ev("response.output_item.added", output_index=self.open, item=dict(item))]

    def reasoning_delta(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.items[self.open]["type"] != "reasoning":
            out += self._begin(reasoning_item("", new_id("rs"), status="in_progress"))
        self.text += text
        out.append(self.ev("response.reasoning_text.delta", item_id=self.items[self.open]["id"],
                           output_index=self.open, content_index=0, delta=text))  # fmt: skip
        return out

    def text_delta(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.items[self.open]["type"] != "message":
            out += self._begin(message_item("", new_id("msg"), status="in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.ev("response.content_part.added", item_id=self.items[self.open]["id"],
                               output_index=self.open, content_index=0, part=part))  # fmt: skip
        self.text += text
        out.append(self.ev("response.output_text.delta", item_id=self.items[self.open]["id"], output_index=self.open,
                           content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return out

    def call_fragment(self, frag: dict[str, Any]) -> list[str]:
        out: list[str] = []
        fn = frag.get("function") or {}
        if frag["index"] not in self.by_call:
            call = ToolCall(fn.get("name") or "", "", frag.get("id") or "")
            out += self._begin(call_item(call, new_id("fc"), "in_progress"))
            self.by_call[frag["index"]] = self.open  # type: ignore[assignment]
        i = self.by_call[frag["index"]]
        if fn.get("arguments"):
            self.items[i]["arguments"] += fn["arguments"]
            out.append(self.ev("response.function_call_arguments.delta", item_id=self.items[i]["id"], output_index=i,
                               delta=fn["arguments"]))  # fmt: skip
        return out


def mount_responses(app: FastAPI, ctx: ServingContext, store: ResponseStore | None = None) -> None:
    store = store if store is not None else ResponseStore()

    async def stream_events(run: ChatRun, base: dict[str, Any], conversation: list, keep: bool) -> AsyncIterator[str]:
        e = _Events()
        yield e.ev("response.created", response={**base, "status": "in_progress"})
        yield e.ev("response.in_progress", response={**base, "status": "in_progress"})
        finish = None
        try:
            async for piece in run.pieces():
                if piece.reasoning:
                    for s in e.reasoning_delta(piece.reasoning):
                        yield s
                if piece.content:
                    for s in e.text_delta(piece.content):
                        yield s
                for frag in piece.tool_calls:
                    for s in e.call_fragment(frag):
                        yield s
                if piece.finish_reason is not None:
                    finish = piece.finish_reason
        except (EngineDeadError, KVLedgerError) as err:
            yield e.ev("error", code="server_error", message=str(err), param=None)
            return
        for s in e.close():
            yield s
        final = _finish(base, e.items, finish, run.usage())
        if keep:
            store.put(base["id"], Stored(final, conversation))
        yield e.ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)

    async def background(run: ChatRun, rid: str) -> None:
        item = store.get(rid)
        item.response["status"] = "in_progress"
        try:
            answer = await run.answer(None)
        except asyncio.CancelledError:
            item.response.update(status="cancelled", usage=_usage(run.usage()))
            return
        except Exception as err:  # the engine died, or a bug: the response says so instead of hanging
            if not isinstance(err, (EngineDeadError, KVLedgerError)):
                logger.exception("background response %s failed", rid)
            item.response.update(status="failed", error={"code": "server_error", "message": str(err)})
            return
        assert answer is not None
        item.response = _finish(item.response, _answer_items(answer), answer.finish_reason, answer.usage)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id)
            if prev.response["status"] in ("queued", "in_progress"):
                raise APIError(400, f"response {body.previous_response_id!r} is still in progress",
                               param="previous_response_id")  # fmt: skip
            history = prev.conversation + output_messages(prev.response["output"])
        chat = chat_request(body.chat_fields(history))
        conversation = history + input_messages(body.input)
        rid = new_id("resp")
        run = await ChatRun.start(ctx, chat, rid, body.priority)
        base = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": body.model or ctx.model_name,
            "status": "queued", "output": [], "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": body.tools or [], "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "text": body.text or {"format": {"type": "text"}}, "store": body.store, "background": body.background,
            "truncation": "disabled", "metadata": (body.model_extra or {}).get("metadata") or {},
            "usage": None, "error": None, "incomplete_details": None,
        }  # fmt: skip
        if body.background:
            stored = Stored(base, conversation, run=run)
            store.put(rid, stored)
            stored.task = asyncio.create_task(background(run, rid))
            return JSONResponse(base)
        if body.stream:
            return SSEResponse(stream_events(run, base, conversation, body.store), on_close=run.abort)
        answer = await run.answer(request)
        if answer is None:
            return Response(status_code=499)  # the client is gone
        final = _finish(base, _answer_items(answer), answer.finish_reason, answer.usage)
        if body.store:
            store.put(rid, Stored(final, conversation))
        return JSONResponse(final)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        item = store.pop(response_id)
        if item.task is not None and not item.task.done():
            item.task.cancel()
            item.run.abort()  # type: ignore[union-attr]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        item = store.get(response_id)
        if item.task is None:
            raise APIError(400, "only background responses can be cancelled", param="response_id")
        if item.response["status"] in ("queued", "in_progress"):
            item.task.cancel()
            await asyncio.wait([item.task])
            if item.response["status"] in ("queued", "in_progress"):  # cancelled before it ran
                item.run.abort()  # type: ignore[union-attr]
                item.response["status"] = "cancelled"
        elif item.response["status"] != "cancelled":
            raise APIError(400, f"response {response_id!r} is {item.response['status']}; only a queued or "
                           "in-progress response can be cancelled", param="response_id")  # fmt: skip
        return JSONResponse(item.response)
