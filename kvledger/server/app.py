"""The OpenAI-compatible HTTP server: FastAPI over AsyncEngine.

Every error reaches the client as OpenAI's error JSON. Input errors (bad parameters, a prompt
longer than the context, anything the engine raises as KVLedgerError) are 400s and touch no
other request; a 500 means a bug in kvledger.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvledger
from kvledger.core.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvledger.core.engine import LLMEngine
from kvledger.errors import KVLedgerError
from kvledger.logprobs import Logprob
from kvledger.outputs import CompletionOutput, RequestOutput, merge_deltas
from kvledger.sampling_params import RequestOutputKind, SamplingParams
from kvledger.server.metrics import ServerMetrics
from kvledger.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger("kvledger.server")

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 1 << 20
_MAX_MESSAGES = 4096  # a chat request's messages (the body limit bounds them too)
# apply_chat_template's own arguments, which chat_template_kwargs must not override
_RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
     "tools", "documents", "return_dict", "return_tensors", "padding", "truncation", "max_length",
     "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip
_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | list[str] | None = None  # one key or several, each accepted
    chat_template: str | None = None  # overrides the tokenizer's
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    dashboard: bool = True  # GET /dashboard (kvledger/server/dashboard.py)
    created: int = field(default_factory=lambda: int(time.time()))
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])  # CORS, as vLLM
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    root_path: str = ""  # a proxy's path prefix
    log_requests: bool = True

    @property
    def api_keys(self) -> list[str]:
        if self.api_key is None:
            return []
        return [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


class _Guard:
    """ASGI middleware: the API key on /v1/*, then the body-size limit, before any parsing."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes

    def _key_ok(self, key: bytes) -> bool:
        ok = False
        for k in self.api_keys:  # compare with every key: the time says nothing about which
            ok |= hmac.compare_digest(key, k)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.api_keys and path.startswith("/v1") and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not self._key_ok(key.strip()):
                msg = "missing API key" if not auth else "incorrect API key"
                resp = error_response(
                    401, f"{msg}: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await resp(scope, receive, send)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            too_big = error_response(
                413,
                f"request body is larger than the server's limit of {self.max_body_bytes} bytes",
                code="request_too_large",
            )
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await too_big(scope, receive, send)
                return
            # Read the body here (within the limit) and replay it to the app.
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body_bytes:
                    await too_big(scope, receive, send)
                    return
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # later calls report the disconnect

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


class _SSEResponse(StreamingResponse):
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
    stop string held back), so the chunks add up to the final, non-streamed text.
    """
    if d.finished:
        return None
    finished = c.finish_reason is not None
    offset = d.num_chars
    d.num_chars += len(c.text)
    d.finished = finished
    if not c.text and not finished and not c.logprobs:
        return None
    return c.text, offset, finished


def _clamp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def _usage(outs: list[RequestOutput | None], prompt_lens: list[int]) -> UsageInfo:
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


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _until_disconnect(request: Request, coro: Coroutine[Any, Any, T]) -> T | None:
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


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    model_name = config.served_model_names[0]
    metrics = ServerMetrics(model_name)
    aengine = AsyncEngine(engine, observer=metrics)
    tokenizer = engine.tokenizer
    chat_template = config.chat_template or (
        getattr(tokenizer, "chat_template", None) if tokenizer else None
    )
    max_n = engine.config.scheduler.max_num_seqs

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            aengine.shutdown()
            logger.info("engine stopped; every request aborted")

    app = FastAPI(
        title="kvledger", version=kvledger.__version__, lifespan=lifespan, root_path=config.root_path
    )
    app.state.engine = aengine
    app.state.metrics = metrics
    app.add_middleware(_Guard, api_keys=config.api_keys, max_body_bytes=config.max_body_bytes)
    # CORS outermost (added last), so that preflights and 401s carry its headers, as in vLLM
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_credentials=config.allow_credentials,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
    )
    if config.dashboard:
        from kvledger.server.dashboard import mount_dashboard

        keys = config.api_keys
        mount_dashboard(app, aengine, model_name, keys[0] if keys else None)

    # -- errors ------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(KVLedgerError)
    async def _kvledger_error(_: Request, e: KVLedgerError) -> JSONResponse:
        return error_response(400, str(e), param=getattr(e, "param", None))

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, e: RecursionError) -> JSONResponse:
        return error_response(400, "the body is nested too deeply")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, str(e), type="server_error", code="engine_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}")
        msgs = []
        for err in errors[:5]:
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            msgs.append(f"{where}: {err.get('msg', 'invalid')}")
        return error_response(400, "; ".join(msgs), param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(e.status_code, str(e.detail), type=kind)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}", type="server_error")

    # -- helpers -----------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name not in config.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    vocab = engine.vocab_size

    def check_params(params: SamplingParams, num_prompts: int = 1) -> None:
        """What only the server can judge: sequences per request (the engine checks token ids)."""
        if params.n > max_n:
            raise APIError(400, f"n must be <= {max_n} (--max-num-seqs)", param="n")
        if params.n * num_prompts > max_n:
            raise APIError(
                400,
                f"{num_prompts} prompts x n={params.n} is over {max_n} sequences (--max-num-seqs)",
                param="prompt",
            )
        if params.top_k >= vocab:
            params.top_k = 0  # every token: the same as no top-k

    async def add_all(
        prompts: list[str | list[int]],
        params: SamplingParams,
        rid: str,
        priority: int,
        add_special_tokens: bool = True,
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                sub = rid if len(prompts) == 1 else f"{rid}-{i}"
                streams.append(
                    await aengine.add_request(p, params, sub, priority, add_special_tokens)
                )
        except BaseException:
            for s in streams:
                s.abort()
            raise
        if config.log_requests:
            for s in streams:
                logger.info(
                    "request %s: %d prompt tokens, %s",
                    s.request_id, len(s.prompt_token_ids), params,
                )  # fmt: skip
        return streams

    def abort_all(streams: list[RequestStream]) -> Callable[[], None]:
        def close() -> None:
            for s in streams:
                s.abort()

        return close

    async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
        parts: list[list[RequestOutput]] = [[] for _ in streams]
        async for i, out in _merged(streams):
            parts[i].append(out)
        return [merge_deltas(p) if p else None for p in parts]  # type: ignore[misc]

    def completion_logprobs(lps: list[dict[int, Logprob]], offset: int) -> CompletionLogprobs:
        """OpenAI's completion logprobs from vLLM-shaped dicts (sampled token first)."""
        res = CompletionLogprobs()
        for d in lps:
            chosen = next(iter(d.values()))
            tok = chosen.decoded_token or ""
            top: dict[str, float] = {}
            for lp in d.values():
                top.setdefault(lp.decoded_token or "", _clamp(lp.logprob))
            res.tokens.append(tok)
            res.token_logprobs.append(_clamp(chosen.logprob))
            res.top_logprobs.append(top)
            res.text_offset.append(offset)
            offset += len(tok)
        return res

    def echo_logprobs(out: RequestOutput, prompt_ids: list[int]) -> CompletionLogprobs:
        """The prompt's tokens as vLLM echoes them: the first has no logprob (nothing precedes
        it), the rest their prompt logprobs."""
        res = CompletionLogprobs()
        offset = 0
        plps = out.prompt_logprobs or [None] * len(prompt_ids)
        for tid, d in zip(prompt_ids, plps):
            lp = d.get(tid) if d else None
            tok = lp.decoded_token if lp is not None and lp.decoded_token is not None else (
                tokenizer.decode([tid]) if tokenizer is not None else ""
            )
            res.tokens.append(tok)
            res.token_logprobs.append(_clamp(lp.logprob) if lp is not None else None)
            res.top_logprobs.append(
                {(x.decoded_token or ""): _clamp(x.logprob) for x in d.values()} if d else None
            )
            res.text_offset.append(offset)
            offset += len(tok)
        return res

    def render_prompt_logprobs(plps: Any) -> list[dict[str, PromptLogprob] | None] | None:
        if plps is None:
            return None
        return [
            None
            if d is None
            else {
                str(t): PromptLogprob(
                    logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
                )
                for t, lp in d.items()
            }
            for d in plps
        ]

    def body_wants_prompt_logprobs(params: SamplingParams) -> bool:
        return params.prompt_logprobs is not None

    def chat_logprobs(lps: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
        """OpenAI's chat logprobs: the sampled token, and the ``num_top`` most likely."""
        content = []
        for d in lps:
            chosen = next(iter(d.values()))
            tok = chosen.decoded_token or ""
            tops = sorted(
                (lp for lp in d.values() if lp.rank is not None and lp.rank <= num_top),
                key=lambda lp: lp.rank,
            )[:num_top]
            content.append(
                TokenLogprob(
                    token=tok,
                    logprob=_clamp(chosen.logprob),
                    bytes=list(tok.encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=lp.decoded_token or "",
                            logprob=_clamp(lp.logprob),
                            bytes=list((lp.decoded_token or "").encode()),
                        )
                        for lp in tops
                    ],
                )
            )
        return ChatLogprobs(content=content)

    # -- endpoints ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params(engine.default_sampling_params)
        params.output_kind = RequestOutputKind.DELTA  # the engine sends only what is new
        prompts = body.prompts()
        check_params(params, len(prompts))
        rid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        created = int(time.time())
        streams = await add_all(prompts, params, rid, body.priority, body.add_special_tokens)
        echo = [p if isinstance(p, str) else "" for p in prompts] if body.echo else None
        if body.stream:
            gen = completion_stream(body, params, streams, rid, created, echo)
            return _SSEResponse(gen, on_close=abort_all(streams))
        try:
            outs = await _until_disconnect(request, final_outputs(streams))
        finally:
            abort_all(streams)()  # a no-op for finished streams
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
                        lps = echo_logprobs(out, streams[i].prompt_token_ids).extend(lps)
                choices.append(
                    CompletionChoice(
                        index=i * params.n + c.index,
                        text=prefix + c.text,
                        logprobs=lps,
                        prompt_logprobs=render_prompt_logprobs(out.prompt_logprobs)
                        if body_wants_prompt_logprobs(params)
                        else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        resp = CompletionResponse(
            id=rid,
            created=created,
            model=model_name,
            choices=choices,
            usage=_usage(outs, [len(s.prompt_token_ids) for s in streams]),
        )
        return JSONResponse(resp.model_dump())

    async def completion_stream(
        body: CompletionRequest,
        params: SamplingParams,
        streams: list[RequestStream],
        rid: str,
        created: int,
        echo: list[str] | None,
    ) -> AsyncIterator[str]:
        deltas: dict[int, _Delta] = {}
        last: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in _merged(streams):
                last[i] = out
                for c in out.outputs:
                    index = i * params.n + c.index
                    d = deltas.get(index)
                    if d is None:
                        d = deltas[index] = _Delta()
                        if echo and echo[i]:
                            lps = None
                            if params.logprobs is not None:
                                lps = echo_logprobs(out, streams[i].prompt_token_ids)
                            yield _sse(
                                CompletionResponse(
                                    id=rid,
                                    created=created,
                                    model=model_name,
                                    choices=[
                                        CompletionChoice(index=index, text=echo[i], logprobs=lps)
                                    ],
                                )
                            )
                    step = _advance(d, c)
                    if step is None:
                        continue
                    text, offset, finished = step
                    lps = None
                    if c.logprobs is not None:
                        lps = completion_logprobs(c.logprobs, offset + len(echo[i] if echo else ""))
                    yield _sse(
                        CompletionResponse(
                            id=rid,
                            created=created,
                            model=model_name,
                            choices=[
                                CompletionChoice(
                                    index=index,
                                    text=text,
                                    logprobs=lps,
                                    finish_reason=c.finish_reason if finished else None,
                                    stop_reason=c.stop_reason if finished else None,
                                )
                            ],
                        )
                    )
            if body.include_usage:
                usage = _usage(last, [len(s.prompt_token_ids) for s in streams])
                yield _sse(
                    CompletionResponse(
                        id=rid, created=created, model=model_name, choices=[], usage=usage
                    )
                )
        except (EngineDeadError, KVLedgerError) as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error")))
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params(engine.default_sampling_params)
        params.output_kind = RequestOutputKind.DELTA  # the engine sends only what is new
        check_params(params)
        if len(body.messages) > _MAX_MESSAGES:
            raise APIError(400, f"at most {_MAX_MESSAGES} messages", param="messages")
        prompt = render_chat(
            body.conversation(),
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs,
        )
        add_special = body.add_special_tokens
        if add_special is None:
            bos = getattr(tokenizer, "bos_token", None)
            add_special = not (bos and prompt.startswith(bos))  # the template wrote BOS itself
        rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        created = int(time.time())
        streams = await add_all([prompt], params, rid, body.priority, add_special)
        if body.stream:
            gen = chat_stream(body, params, streams[0], rid, created)
            return _SSEResponse(gen, on_close=abort_all(streams))
        try:
            outs = await _until_disconnect(request, final_outputs(streams))
        finally:
            abort_all(streams)()
        if outs is None:
            return Response(status_code=499)
        (out,) = outs
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=chat_logprobs(c.logprobs, params.logprobs or 0)
                if c.logprobs is not None
                else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        resp = ChatCompletionResponse(
            id=rid,
            created=created,
            model=model_name,
            choices=choices,
            usage=_usage([out], [len(streams[0].prompt_token_ids)]),
        )
        return JSONResponse(resp.model_dump())

    def render_chat(
        conversation: list[dict[str, str]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> str:
        """The conversation through the chat template; every failure is the client's 400."""
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so chat is not available")
        if not chat_template:
            raise APIError(
                400,
                "this model's tokenizer has no chat template; start the server with "
                "--chat-template FILE_OR_STRING, or use /v1/completions",
                param="messages",
                code="chat_template_missing",
            )
        extra = dict(chat_template_kwargs or {})
        taken = sorted(set(extra) & _RESERVED_TEMPLATE_ARGS)
        if taken:
            raise APIError(
                400, f"chat_template_kwargs may not set {', '.join(taken)}",
                param="chat_template_kwargs",
            )  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **extra,
            )
        except KVLedgerError:
            raise
        except Exception as e:  # the template runs on the client's messages: their error
            raise APIError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from None
        if not isinstance(text, str) or not text:
            raise APIError(400, "the chat template rendered an empty prompt", param="messages")
        return text

    async def chat_stream(
        body: ChatCompletionRequest,
        params: SamplingParams,
        stream: RequestStream,
        rid: str,
        created: int,
    ) -> AsyncIterator[str]:
        def chunk(index: int, delta: DeltaMessage, **kw: Any) -> str:
            choice = ChatStreamChoice(index=index, delta=delta, **kw)
            return _sse(
                ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[choice])
            )

        deltas: dict[int, _Delta] = {}
        last: RequestOutput | None = None
        try:
            for i in range(params.n):
                yield chunk(i, DeltaMessage(role="assistant", content=""))
            async for _, out in _merged([stream]):
                last = out
                for c in out.outputs:
                    d = deltas.setdefault(c.index, _Delta())
                    step = _advance(d, c)
                    if step is None:
                        continue
                    text, _, finished = step
                    lps = (
                        chat_logprobs(c.logprobs, params.logprobs or 0)
                        if c.logprobs is not None
                        else None
                    )
                    yield chunk(
                        c.index,
                        DeltaMessage(content=text),
                        logprobs=lps,
                        finish_reason=c.finish_reason if finished else None,
                    )
            if body.include_usage:
                usage = _usage([last], [len(stream.prompt_token_ids)])
                yield _sse(
                    ChatCompletionChunk(
                        id=rid, created=created, model=model_name, choices=[], usage=usage
                    )
                )
        except (EngineDeadError, KVLedgerError) as e:
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(e), type="server_error")))
        yield "data: [DONE]\n\n"

    from kvledger.server.ops import mount_ops

    mount_ops(app, aengine, config, metrics, check_model, render_chat)
    return app
