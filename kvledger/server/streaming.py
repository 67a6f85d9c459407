"""Server-sent events: the one streaming loop both endpoints use, and the helpers that merge
the outputs of several requests and notice a client that left."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvledger.engine.front import RequestStream
from kvledger.errors import EngineDeadError, KVLedgerError
from kvledger.outputs import CompletionOutput, RequestOutput
from kvledger.server.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo

logger = logging.getLogger("kvledger.server")

T = TypeVar("T")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class _Delta:
    """What one streamed choice has sent so far."""

    num_chars: int = 0  # text sent (the logprobs' text_offset)
    finished: bool = False


def _advance(d: _Delta, c: CompletionOutput) -> tuple[str, int, bool] | None:
    """The next (text delta, its text offset, finished) of a choice; None: nothing new.

    The engine's DELTA outputs already are the new text (partial characters and a forming
    stop string held back), so the chunks add up to the final, non-streamed text. New tokens
    whose text is held back still make a chunk, with empty text, as vLLM's server sends one
    (a chunk per step that produced tokens; only an output with neither text nor tokens is
    skipped).
    """
    if d.finished:
        return None
    finished = c.finish_reason is not None
    offset = d.num_chars
    d.num_chars += len(c.text)
    d.finished = finished
    if not c.text and not c.token_ids and not finished and not c.logprobs:
        return None
    return c.text, offset, finished


def usage_of(outs: list[RequestOutput | None], prompt_lens: list[int]) -> UsageInfo:
    completion = sum(
        o.metrics.num_generation_tokens if o.metrics else sum(len(c.token_ids) for c in o.outputs)
        for o in outs
        if o is not None
    )
    prompt = sum(prompt_lens)
    cached = sum(o.num_cached_tokens for o in outs if o is not None)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnect(request: Request, coro: Coroutine[Any, Any, T]) -> T | None:
    """Await ``coro``; None if the client went away first (``coro`` is then cancelled)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        return None
    return work.result()


# One step of one choice: (prompt index, choice index, its output, the choice, the delta from
# _advance or None, whether this is the choice's first output) -> SSE chunks to send.
StepRenderer = Callable[[int, int, RequestOutput, CompletionOutput, Any, bool], list[str]]


async def sse_stream(
    streams: list[RequestStream],
    n: int,
    render: StepRenderer,
    render_usage: Callable[[UsageInfo], str] | None,
    opening: list[str] | None = None,
) -> AsyncIterator[str]:
    """The streaming loop: each choice's text deltas as they come, rendered by the endpoint;
    then the usage chunk if asked; an engine error becomes an error event; always [DONE]."""
    deltas: dict[int, _Delta] = {}
    last: list[RequestOutput | None] = [None] * len(streams)
    try:
        for chunk in opening or ():
            yield chunk
        async for i, out in merged(streams):
            last[i] = out
            for c in out.outputs:
                index = i * n + c.index
                d = deltas.get(index)
                first = d is None
                if d is None:
                    d = deltas[index] = _Delta()
                for chunk in render(i, index, out, c, _advance(d, c), first):
                    yield chunk
        if render_usage is not None:
            yield render_usage(usage_of(last, [len(s.prompt_token_ids) for s in streams]))
    except (EngineDeadError, KVLedgerError) as e:
        yield sse(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error")))
    yield "data: [DONE]\n\n"
