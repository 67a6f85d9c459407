"""What the pooling endpoints share (/v1/embeddings, /classify, /pooling, /score, /rerank):
their prompt fields (``input`` as text, texts or token ids, or chat ``messages``, vLLM's), the
prompts' tokenization and truncation, the check that the served model does the task, and the
run of one pooling request per prompt through the engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from kvledger.errors import InvalidRequestError
from kvledger.pooling.params import PoolingParams
from kvledger.pooling.score import check_truncation, truncate
from kvledger.server.errors import APIError
from kvledger.server.fields import FieldError, refuse_extra_fields
from kvledger.server.protocol import INT64_MAX, TokenId, _Request
from kvledger.server.serving import ServingContext
from kvledger.server.streaming import merged

MAX_INPUTS = 2048  # OpenAI's cap on inputs per request

# vLLM's API names for its "does not support" errors, by pooling task.
API_NAMES = {"embed": "Embeddings", "classify": "Classification", "score": "Score"}


class PoolingInputRequest(_Request):
    """``input`` (OpenAI's shapes) or ``messages`` (a conversation through the chat template,
    vLLM's chat-style pooling request); unknown fields are refused by name."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    messages: list[dict[str, Any]] | None = None
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool | None = None  # None: True for input, False for messages (vLLM)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = Field(0, ge=-(2**63), le=INT64_MAX)
    request_id: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)

    @model_validator(mode="after")
    def _no_extra(self) -> PoolingInputRequest:
        refuse_extra_fields(self.model_extra or {})
        check_truncation(self.truncate_prompt_tokens)
        if (self.input is None) == (self.messages is None):
            raise FieldError("give exactly one of input and messages", "input")
        return self

    def prompts(self, ctx: ServingContext) -> list[list[int]]:
        """Each prompt's token ids (truncated as asked); a 400 naming the field otherwise."""
        keep = ctx.aengine.info.max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if self.messages is not None:
            text = ctx.render_chat(
                self.messages, self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
            )
            special = bool(self.add_special_tokens)
            return [truncate(tokenize(ctx, text, special), keep)]
        x = self.input
        items: list[Any] = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x or [])
        if not items:
            raise FieldError("input is empty", "input")
        if len(items) > MAX_INPUTS:
            raise FieldError(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
        if any(not q for q in items):
            raise FieldError("input holds an empty string or token list", "input")
        special = self.add_special_tokens is not False
        return [truncate(tokenize(ctx, q, special) if isinstance(q, str) else list(q), keep) for q in items]


def tokenize(ctx: ServingContext, text: str, add_special_tokens: bool) -> list[int]:
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send token ids", param="input")
    return list(ctx.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def require_task(ctx: ServingContext, task: str, api: str | None = None) -> Any:
    """The served model's PoolerConfig if it does ``task``; else vLLM's 400 "The model does not
    support ... API", saying what the server does instead."""
    info = ctx.aengine.info
    name = api or API_NAMES[task]
    if getattr(info, "runner", "generate") != "pooling":
        raise APIError(
            400,
            f"The model does not support {name} API: this server runs the generate runner; "
            "serve a pooling model with the pooling runner (--runner pooling)",
            param="model",
        )
    pooler = info.pooler_config
    if task not in pooler.tasks:
        raise APIError(
            400,
            f"The model does not support {name} API: it supports the pooling task(s) "
            f"{', '.join(pooler.tasks)}",
            param="model",
        )
    return pooler


def check_params(pooler: Any, params: PoolingParams, param: str | None = None) -> None:
    """The engine's own check, here, so that a client's mistake is a 400 naming its field."""
    try:
        pooler.resolve(params)
    except InvalidRequestError as e:  # its message names the field
        raise APIError(400, str(e), param=param) from None


async def run_pooled(
    ctx: ServingContext, prompts: list[list[int]], params: PoolingParams, rid: str, priority: int
) -> list[Any]:
    """One pooling request per prompt, all to the end; their PoolingRequestOutputs in order.
    A client gone mid-batch stops the rest."""
    streams = await ctx.add_all(prompts, params, rid, priority)  # type: ignore[arg-type]
    outs: list[Any] = [None] * len(streams)
    try:
        async for i, out in merged(streams):  # one final output per prompt (FINAL_ONLY)
            outs[i] = out
    finally:
        ctx.abort_all(streams)()
    for i, out in enumerate(outs):
        if out is None or not out.outputs.data:
            raise APIError(500, f"prompt {i} was not pooled (aborted)", type="server_error")
    return outs
