"""POST /v1/embeddings: OpenAI's embeddings API over the pooling runner (vLLM's shape).

``input`` is a string, a list of strings, a list of token ids or a list of them, or vLLM's
chat-style ``messages`` (one prompt through the chat template); each is one pooling request (a
prefill through the shared scheduler, KV pool and prefix cache). Vectors come back as JSON
floats or, with ``encoding_format="base64"`` (what the ``openai`` client asks for by default),
as little-endian float32 bytes in base64. ``dimensions`` is Matryoshka truncation, refused by
name for models that do not declare it; ``truncate_prompt_tokens`` keeps a prompt's last k
tokens (vLLM's meaning).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Literal

from fastapi import FastAPI
from pydantic import Field

from kvledger.pooling.params import PoolingParams
from kvledger.server.pooling_inputs import (
    PoolingInputRequest,
    check_params,
    require_task,
    run_pooled,
)
from kvledger.server.protocol import INT64_MAX, UsageInfo, _Response
from kvledger.server.serving import ServingContext


class EmbeddingRequest(PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, le=INT64_MAX)
    normalize: bool | None = None  # vLLM's extra


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


def mount_embeddings(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        ctx.check_model(body.model)
        pooler = require_task(ctx, "embed")
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        check_params(pooler, params, "dimensions" if body.dimensions is not None else None)
        prompts = body.prompts(ctx)
        rid = f"embd-{body.request_id or uuid.uuid4().hex}"
        outs = await run_pooled(ctx, prompts, params, rid, body.priority)
        data = [
            EmbeddingData(embedding=encode_base64(o.outputs.data) if body.encoding_format == "base64" else o.outputs.data, index=i)
            for i, o in enumerate(outs)
        ]
        tokens = sum(map(len, prompts))
        return EmbeddingResponse(
            id=rid, created=int(time.time()), model=ctx.model_name, data=data,
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip
