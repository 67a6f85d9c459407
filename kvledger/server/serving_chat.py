"""POST /v1/chat/completions: messages through the chat template, then the same engine path
as completions; streamed chunks open with the assistant role, as OpenAI's do."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvledger.outputs import CompletionOutput, RequestOutput
from kvledger.server.chat_run import prepare_chat
from kvledger.server.fields import warning_headers
from kvledger.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from kvledger.server.serving import ServingContext, chat_logprobs, render_prompt_logprobs
from kvledger.server.streaming import SSEResponse, sse, sse_stream, until_disconnect, usage_of
from kvledger.server.tool_stream import ToolCallStream, tool_message


def mount_chat(app: FastAPI, ctx: ServingContext) -> None:
    model_name = ctx.model_name

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prepared = prepare_chat(ctx, body)
        params, tool_choice, prompt = prepared.params, prepared.tool_choice, prepared.prompt
        add_special = prepared.add_special_tokens
        parser = ctx.config.tool_call_parser
        rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        created = int(time.time())
        streams = await ctx.add_all(
            [prompt], params, rid, body.priority, add_special, cache_salt=body.cache_salt
        )
        if body.stream:

            def chunk(choices: list[ChatStreamChoice], usage: Any = None) -> str:
                return sse(
                    ChatCompletionChunk(
                        id=rid, created=created, model=model_name, choices=choices, usage=usage
                    )
                )

            # With tools in play each choice's text goes through a ToolCallStream: content as
            # it is known to be content, delta.tool_calls fragments as calls form; the pieces
            # add up to the non-streamed message. Logprobs ride with the next chunk sent.
            tool_streams: dict[int, ToolCallStream] = {}
            held_lps: dict[int, list] = {}
            splitters: dict[int, Any] = {}  # --reasoning-parser: each choice's thinking apart

            def render(
                i: int, index: int, out: RequestOutput, c: CompletionOutput, step: Any, first: bool
            ) -> list[str]:
                if step is None:
                    return []
                text, _, finished = step
                thought = ""
                if prepared.reasoning is not None:
                    sp = splitters.get(index) or splitters.setdefault(index, prepared.splitter())
                    thought, text = sp.step(text, final=finished)
                think = prepared.thinking(thought)
                if tool_choice.mode != "none":
                    ts = tool_streams.get(index)
                    if ts is None:
                        ts = tool_streams[index] = ToolCallStream(tool_choice, parser)
                    held_lps.setdefault(index, []).extend(c.logprobs or [])
                    content, fragments, finish = ts.step(text, c.finish_reason if finished else None)
                    if not content and not fragments and not think and not finished:
                        return []
                    lp_list = held_lps.pop(index)
                    delta = DeltaMessage(content=content or None, tool_calls=fragments or None, **think)
                    choice = ChatStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=chat_logprobs(lp_list, params.logprobs or 0)
                        if c.logprobs is not None
                        else None,
                        finish_reason=finish,
                    )
                    return [chunk([choice])]
                lps = None
                if c.logprobs is not None:
                    lps = chat_logprobs(c.logprobs, params.logprobs or 0)
                choice = ChatStreamChoice(
                    index=index,
                    delta=DeltaMessage(content=text if text or not think else None, **think),
                    logprobs=lps,
                    finish_reason=c.finish_reason if finished else None,
                )
                return [chunk([choice])]

            opening = [
                chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(params.n)
            ]
            usage = (lambda u: chunk([], u)) if body.include_usage else None
            gen = sse_stream(streams, params.n, render, usage, opening)
            resp = SSEResponse(gen, on_close=ctx.abort_all(streams))
            resp.headers.update(warning_headers(body.model_extra or {}))
            return resp
        try:
            outs = await until_disconnect(request, ctx.final_outputs(streams))
        finally:
            ctx.abort_all(streams)()
        if outs is None:
            return Response(status_code=499)
        (out,) = outs
        choices = []
        for c in out.outputs:
            thought, text = prepared.split(c.text)
            content, calls, finish = tool_message(tool_choice, parser, text, c.finish_reason)
            if thought is not None and content == "":
                content = None  # all thinking, as vLLM answers
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        content=content, tool_calls=[t.to_openai() for t in calls],
                        **prepared.thinking(thought),
                    ),
                    logprobs=chat_logprobs(c.logprobs, params.logprobs or 0)
                    if c.logprobs is not None
                    else None,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        resp = ChatCompletionResponse(
            id=rid,
            created=created,
            model=model_name,
            choices=choices,
            usage=usage_of([out], [len(streams[0].prompt_token_ids)]),
            prompt_logprobs=render_prompt_logprobs(out.prompt_logprobs)
            if params.prompt_logprobs is not None
            else None,
        )
        headers = warning_headers(body.model_extra or {})
        return JSONResponse(resp.model_dump(), headers=headers)
