"""POST /v1/completions: text or token-id prompts (several at once), echo, logprobs, prompt
logprobs, streamed or not."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvledger.outputs import CompletionOutput, RequestOutput
from kvledger.sampling_params import RequestOutputKind
from kvledger.server.fields import warning_headers
from kvledger.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvledger.server.serving import (
    ServingContext,
    completion_logprobs,
    echo_logprobs,
    render_prompt_logprobs,
)
from kvledger.server.streaming import SSEResponse, sse, sse_stream, until_disconnect, usage_of
from kvledger.server.structured_fields import structured_params


def mount_completions(app: FastAPI, ctx: ServingContext) -> None:
    model_name = ctx.model_name

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx.check_model(body.model)
        params = body.to_sampling_params(ctx.sampling_defaults)
        params.structured_outputs = structured_params(body, ctx.config.structured_outputs_config)
        params.output_kind = RequestOutputKind.DELTA  # the engine sends only what is new
        prompts = body.prompts()
        ctx.check_params(params, len(prompts))
        rid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        created = int(time.time())
        streams = await ctx.add_all(
            prompts, params, rid, body.priority, body.add_special_tokens, cache_salt=body.cache_salt
        )
        echo = [p if isinstance(p, str) else "" for p in prompts] if body.echo else None
        ids = bool(body.return_token_ids)

        def response(choices: list[CompletionChoice], usage: Any = None) -> CompletionResponse:
            return CompletionResponse(
                id=rid, created=created, model=model_name, choices=choices, usage=usage
            )

        if body.stream:
            ids_sent: set[int] = set()  # choices whose prompt_token_ids went out

            def render(
                i: int, index: int, out: RequestOutput, c: CompletionOutput, step: Any, first: bool
            ) -> list[str]:
                chunks = []
                prefix = echo[i] if echo else ""
                if first and prefix:
                    lps = None
                    if params.logprobs is not None:
                        lps = echo_logprobs(out, streams[i].prompt_token_ids, ctx.tokenizer)
                    chunks.append(
                        sse(response([CompletionChoice(index=index, text=prefix, logprobs=lps)]))
                    )
                if step is not None:
                    text, offset, finished = step
                    lps = None
                    if c.logprobs is not None:
                        lps = completion_logprobs(c.logprobs, offset + len(prefix))
                    choice = CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=lps,
                        finish_reason=c.finish_reason if finished else None,
                        stop_reason=c.stop_reason if finished else None,
                    )
                    if ids:
                        choice.token_ids = list(c.token_ids)
                        if index not in ids_sent:
                            ids_sent.add(index)
                            choice.prompt_token_ids = list(streams[i].prompt_token_ids)
                    chunks.append(sse(response([choice])))
                return chunks

            usage = (lambda u: sse(response([], u))) if body.include_usage else None
            gen = sse_stream(streams, params.n, render, usage)
            resp = SSEResponse(gen, on_close=ctx.abort_all(streams))
            resp.headers.update(warning_headers(body.model_extra or {}))
            return resp
        try:
            outs = await until_disconnect(request, ctx.final_outputs(streams))
        finally:
            ctx.abort_all(streams)()  # a no-op for finished streams
        if outs is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = []
        for i, out in enumerate(outs):
            prefix = echo[i] if echo else ""
            for c in out.outputs:
                lps = None
                if c.logprobs is not None:
                    lps = completion_logprobs(c.logprobs, len(prefix))
                    if echo:
                        prompt_ids = streams[i].prompt_token_ids
                        lps = echo_logprobs(out, prompt_ids, ctx.tokenizer).extend(lps)
                choices.append(
                    CompletionChoice(
                        index=i * params.n + c.index,
                        text=prefix + c.text,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=render_prompt_logprobs(out.prompt_logprobs)
                        if params.prompt_logprobs is not None
                        else None,
                        prompt_token_ids=list(streams[i].prompt_token_ids) if ids else None,
                        token_ids=list(c.token_ids) if ids else None,
                    )
                )
        usage = usage_of(outs, [len(s.prompt_token_ids) for s in streams])
        headers = warning_headers(body.model_extra or {})
        return JSONResponse(response(choices, usage).model_dump(), headers=headers)
