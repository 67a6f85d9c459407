"""POST /classify and /pooling: a classifier's label probabilities, and the raw pooled output
of any pooling model (vLLM's shapes and names).

/classify answers each input with its ``probs`` (the model's activation over its ``score``
logits; ``use_activation: false`` gives the logits), ``label`` (id2label of the largest) and
``num_classes``. /pooling returns what the model pools for its task (``task``: by default the
model's first: ``embed`` or ``classify``): the vector, or the probabilities, as floats or base64.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import FastAPI

from kvledger.pooling.params import PoolingParams
from kvledger.server.pooling_inputs import (
    PoolingInputRequest,
    check_params,
    require_task,
    run_pooled,
)
from kvledger.server.protocol import UsageInfo, _Response
from kvledger.server.serving import ServingContext
from kvledger.server.serving_embedding import encode_base64


class ClassificationRequest(PoolingInputRequest):
    use_activation: bool | None = None


class ClassificationData(_Response):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Response):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class PoolingRequest(PoolingInputRequest):
    task: Literal["embed", "classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    use_activation: bool | None = None
    normalize: bool | None = None  # embed


class PoolingData(_Response):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(_Response):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: UsageInfo


def _usage(prompts: list[list[int]]) -> UsageInfo:
    n = sum(map(len, prompts))
    return UsageInfo(prompt_tokens=n, total_tokens=n)


def mount_classify(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/classify")
    async def classify(body: ClassificationRequest) -> ClassificationResponse:
        ctx.check_model(body.model)
        pooler = require_task(ctx, "classify")
        params = PoolingParams(task="classify", use_activation=body.use_activation)
        check_params(pooler, params)
        prompts = body.prompts(ctx)
        rid = f"classify-{body.request_id or uuid.uuid4().hex}"
        outs = await run_pooled(ctx, prompts, params, rid, body.priority)
        labels = pooler.classifier.labels
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=labels[best], probs=probs, num_classes=len(probs)))
        return ClassificationResponse(
            id=rid, created=int(time.time()), model=ctx.model_name, data=data, usage=_usage(prompts)
        )

    @app.post("/pooling")
    async def pooling(body: PoolingRequest) -> PoolingResponse:
        ctx.check_model(body.model)
        info = ctx.aengine.info
        task = body.task or (info.pooler_config.tasks[0] if info.pooler_config is not None else "embed")
        pooler = require_task(ctx, task, "Pooling")
        params = PoolingParams(task=task, use_activation=body.use_activation, normalize=body.normalize)
        check_params(pooler, params)
        prompts = body.prompts(ctx)
        rid = f"pool-{body.request_id or uuid.uuid4().hex}"
        outs = await run_pooled(ctx, prompts, params, rid, body.priority)
        b64 = body.encoding_format == "base64"
        data = [
            PoolingData(index=i, data=encode_base64(o.outputs.data) if b64 else o.outputs.data)
            for i, o in enumerate(outs)
        ]
        return PoolingResponse(id=rid, created=int(time.time()), model=ctx.model_name, data=data, usage=_usage(prompts))
