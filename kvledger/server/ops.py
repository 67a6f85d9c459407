"""The operations endpoints beside the OpenAI API: health, version, models, the ledger,
Prometheus metrics, and vLLM's /tokenize and /detokenize (same request and response shapes)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvledger.errors import InvalidRequestError
from kvledger.server.errors import error_response
from kvledger.server.metrics import ServerMetrics
from kvledger.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvledger.server.serving import ServingContext
from kvledger.version import __version__


def mount_ops(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics) -> None:
    aengine, config = ctx.aengine, ctx.config
    info = aengine.info
    model_name = ctx.model_name
    check_model, render_chat = ctx.check_model, ctx.render_chat

    async def health() -> Response:
        if not aengine.is_running:
            return error_response(503, "the engine is not running", type="server_error")
        return JSONResponse({"status": "ok"})

    app.get("/health")(health)
    # SageMaker's health check, as vLLM serves it: GET or POST
    app.api_route("/ping", methods=["GET", "POST"])(health)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=n,
                    created=config.created,
                    root=config.model_path,
                    max_model_len=info.max_model_len,
                )
                for n in config.served_model_names
            ]
        )

    @app.get("/v1/ledger")
    async def ledger() -> JSONResponse:
        d = await aengine.ledger()
        d["model"] = model_name
        d["max_model_len"] = info.max_model_len
        return JSONResponse(d)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        state = await aengine.query("metrics_state")
        return Response(
            metrics.render(state), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    tokenizer = aengine.tokenizer

    def need_tokenizer() -> Any:
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        return tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(body.model)
        tok = need_tokenizer()
        if body.messages is not None:
            text = render_chat(
                [m.model_dump(exclude_none=True) | {"content": m.text()} for m in body.messages],
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
            )
            add_special = False  # vLLM: the chat template writes the special tokens
        else:
            text, add_special = body.prompt or "", body.add_special_tokens
        ids = tok(text, add_special_tokens=add_special).input_ids
        resp = TokenizeResponse(
            count=len(ids),
            max_model_len=info.max_model_len,
            tokens=ids,
            token_strs=tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        )
        return JSONResponse(resp.model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        check_model(body.model)
        tok = need_tokenizer()
        vocab = info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return JSONResponse(DetokenizeResponse(prompt=tok.decode(body.tokens)).model_dump())
