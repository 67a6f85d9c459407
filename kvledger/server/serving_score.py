"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank): text pairs scored by a
cross-encoder, or by the cosine of two embeddings on an embedding model (vLLM's rules and
shapes; pooling/score.py).

/score takes ``text_1`` (one text or as many as ``text_2``) and ``text_2``; /rerank a ``query``
and ``documents`` (strings, or Jina/Cohere's ``{"text": ...}`` objects), ``top_n`` (0: all) and
``return_documents`` (Jina/Cohere's; vLLM always returns them), and answers with the
results sorted by ``relevance_score``, best first.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field, model_validator

from kvledger.errors import InvalidRequestError
from kvledger.pooling.params import PoolingParams
from kvledger.pooling.score import check_truncation, cosine, encode_pair, pair_up, truncate
from kvledger.server.errors import APIError
from kvledger.server.fields import FieldError, refuse_extra_fields
from kvledger.server.pooling_inputs import check_params, require_task, run_pooled, tokenize
from kvledger.server.protocol import INT64_MAX, UsageInfo, _Request, _Response
from kvledger.server.serving import ServingContext

MAX_PAIRS = 2048  # as many as /v1/embeddings takes inputs


class _ScoreBase(_Request):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    priority: int = Field(0, ge=-(2**63), le=INT64_MAX)
    use_activation: bool | None = None
    request_id: str | None = None

    @model_validator(mode="after")
    def _no_extra(self) -> _ScoreBase:
        refuse_extra_fields(self.model_extra or {})
        check_truncation(self.truncate_prompt_tokens)
        return self


class ScoreRequest(_ScoreBase):
    text_1: str | list[str]
    text_2: str | list[str]


class TextDocument(BaseModel):
    text: str


class RerankRequest(_ScoreBase):
    query: str
    documents: list[str | TextDocument]
    top_n: int = Field(0, ge=0, le=INT64_MAX)
    return_documents: bool = True


class ScoreData(_Response):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_Response):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


async def score_pairs(
    ctx: ServingContext, pairs: list[tuple[str, str]], body: _ScoreBase, rid: str, api: str
) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens it took: one cross-encoder prompt per pair, or
    (an embedding model) one embedding per distinct text and the cosine of each pair's two."""
    info = ctx.aengine.info
    pooler = require_task(ctx, "score" if _is_classifier(info) else "embed", api)
    if len(pairs) > MAX_PAIRS:
        raise APIError(400, f"{len(pairs)} pairs to score; at most {MAX_PAIRS} per request")
    keep = info.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
    if pooler.classifier is None:  # bi-encoder
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = [truncate(tokenize(ctx, t, True), keep) for t in texts]
        params = PoolingParams(task="embed")
        outs = await run_pooled(ctx, prompts, params, rid, body.priority)
        vecs = {t: o.outputs.data for t, o in zip(texts, outs)}
        return [cosine(vecs[a], vecs[b]) for a, b in pairs], sum(map(len, prompts))
    params = PoolingParams(task="score", use_activation=body.use_activation)
    check_params(pooler, params)
    try:
        prompts = [encode_pair(ctx.tokenizer, a, b, max_length=keep) for a, b in pairs]
    except InvalidRequestError as e:
        raise APIError(400, str(e)) from None
    outs = await run_pooled(ctx, prompts, params, rid, body.priority)
    return [o.outputs.data[0] for o in outs], sum(map(len, prompts))


def _is_classifier(info: Any) -> bool:
    pooler = getattr(info, "pooler_config", None)
    return pooler is not None and pooler.classifier is not None


def mount_score(app: FastAPI, ctx: ServingContext) -> None:
    async def score(body: ScoreRequest) -> ScoreResponse:
        ctx.check_model(body.model)
        try:
            pairs = pair_up(body.text_1, body.text_2)
        except InvalidRequestError as e:
            raise FieldError(str(e), "text_1" if "text_1" in str(e).split(" ")[0] else "text_2") from None
        rid = f"score-{body.request_id or uuid.uuid4().hex}"
        scores, tokens = await score_pairs(ctx, pairs, body, rid, "Score")
        return ScoreResponse(
            id=rid, created=int(time.time()), model=ctx.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip

    async def rerank(body: RerankRequest) -> RerankResponse:
        ctx.check_model(body.model)
        if not body.documents:
            raise FieldError("documents is empty: give at least one document", "documents")
        if not body.query:
            raise FieldError("query is empty", "query")
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        rid = f"rerank-{body.request_id or uuid.uuid4().hex}"
        scores, tokens = await score_pairs(ctx, pair_up(body.query, docs), body, rid, "Rerank (Score)")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = [
            RerankResult(
                index=i, relevance_score=scores[i],
                document=RerankDocument(text=docs[i]) if body.return_documents else None,
            )
            for i in order
        ]  # fmt: skip
        return RerankResponse(
            id=rid, model=ctx.model_name, results=results,
            usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        )  # fmt: skip

    for path in ("/score", "/v1/score"):
        app.post(path, response_model_exclude_none=False)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, response_model_exclude_none=True)(rerank)
