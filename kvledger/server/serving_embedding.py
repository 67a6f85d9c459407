"""POST /v1/embeddings: OpenAI's embeddings API over the pooling runner (vLLM's shape).

``input`` is a string, a list of strings, a list of token ids or a list of them; each is one
pooling request (a prefill through the shared scheduler, KV pool and prefix cache). Vectors
come back as JSON floats or, with ``encoding_format="base64"`` (what the ``openai`` client asks
for by default), as little-endian float32 bytes in base64. ``dimensions`` is Matryoshka
truncation, refused by name for models that do not declare it.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import Field, model_validator

from kvledger.errors import InvalidRequestError
from kvledger.pooling.params import PoolingParams
from kvledger.server.errors import APIError
from kvledger.server.fields import FieldError, refuse_extra_fields
from kvledger.server.protocol import INT64_MAX, TokenId, UsageInfo, _Request, _Response
from kvledger.server.serving import ServingContext
from kvledger.server.streaming import merged

MAX_INPUTS = 2048  # OpenAI's cap on inputs per request


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, le=INT64_MAX)
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**63), le=INT64_MAX)
    normalize: bool | None = None
    request_id: str | None = None
    truncate_prompt_tokens: None = None  # vLLM's; not supported: only null is accepted

    @model_validator(mode="after")
    def _no_extra(self) -> EmbeddingRequest:
        refuse_extra_fields(self.model_extra or {})
        return self

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        items: list[Any] = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        if not items:
            raise FieldError("input is empty", "input")
        if len(items) > MAX_INPUTS:
            raise FieldError(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
        if any(not q for q in items):
            raise FieldError("input holds an empty string or token list", "input")
        return items


class EmbeddingData(_Response):
    object: str = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingResponse(_Response):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def encode_base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def pooling_params(ctx: ServingContext, body: EmbeddingRequest) -> PoolingParams:
    """The request's PoolingParams, checked against the served model here so that a client's
    mistake is a 400 naming its field (the engine checks again)."""
    info = ctx.aengine.info
    if getattr(info, "runner", "generate") != "pooling":
        raise APIError(
            400,
            "this server runs the generate runner; embeddings need the pooling runner "
            "(kvledger serve MODEL --runner pooling)",
            param="model",
        )
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    try:
        info.pooler_config.resolve(params)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="dimensions" if "dimensions" in str(e) else None) from None
    return params


def mount_embeddings(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        ctx.check_model(body.model)
        params = pooling_params(ctx, body)
        inputs = body.inputs()
        rid = f"embd-{body.request_id or uuid.uuid4().hex}"
        streams = await ctx.add_all(inputs, params, rid, body.priority, body.add_special_tokens)  # type: ignore[arg-type]
        outs: list[Any] = [None] * len(streams)
        try:
            async for i, out in merged(streams):  # one final output per input (FINAL_ONLY)
                outs[i] = out
        finally:
            ctx.abort_all(streams)()  # a client gone mid-batch: the rest stop too
        data, tokens = [], 0
        for i, (s, out) in enumerate(zip(streams, outs)):
            if out is None or not out.outputs.data:
                raise APIError(500, f"input {i} was not embedded (aborted)", type="server_error")
            vec = out.outputs.data
            emb = encode_base64(vec) if body.encoding_format == "base64" else vec
            data.append(EmbeddingData(embedding=emb, index=i))
            tokens += len(s.prompt_token_ids)
        return EmbeddingResponse(
            id=rid, created=int(time.time()), model=ctx.model_name, data=data,
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip
