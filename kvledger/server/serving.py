"""What the OpenAI endpoints share: the serving context (engine, served names, tokenizer, chat
template) with its checks and request submission, and the logprob renderers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.chat_utils import apply_chat_template
from kvledger.engine.front import RequestStream
from kvledger.errors import KVLedgerError
from kvledger.logprobs import Logprob
from kvledger.outputs import RequestOutput, merge_deltas
from kvledger.sampling_params import SamplingParams
from kvledger.server.errors import APIError
from kvledger.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
)
from kvledger.server.streaming import merged

logger = logging.getLogger("kvledger.server")

_MIN_LOGPROB = -9999.0  # JSON has no -inf
# apply_chat_template's own arguments, which chat_template_kwargs must not override
_RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
     "tools", "documents", "return_dict", "return_tensors", "padding", "truncation", "max_length",
     "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


def _clamp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


@dataclass
class ServingContext:
    """One served model: what every endpoint reads and the checks they all make."""

    aengine: Any  # AsyncEngine (engine in this process) or AsyncCoreEngine (core processes)
    config: Any  # ServerConfig
    tokenizer: Any = field(init=False)
    chat_template: str | None = field(init=False)

    def __post_init__(self) -> None:
        info = self.aengine.info
        self.tokenizer = self.aengine.tokenizer
        self.chat_template = self.config.chat_template or (
            getattr(self.tokenizer, "chat_template", None) if self.tokenizer else None
        )
        self.model_name: str = self.config.served_model_names[0]
        self.max_n: int = info.max_num_seqs
        self.vocab: int = info.vocab_size
        # generation_config.json's sampling defaults for unset options, as vLLM's server
        self.sampling_defaults: dict[str, Any] = info.default_sampling_params

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_params(self, params: SamplingParams, num_prompts: int = 1) -> None:
        """What only the server can judge: sequences per request (the engine checks token ids)."""
        if params.n > self.max_n:
            raise APIError(400, f"n must be <= {self.max_n} (--max-num-seqs)", param="n")
        if params.n * num_prompts > self.max_n:
            raise APIError(
                400,
                f"{num_prompts} prompts x n={params.n} is over {self.max_n} sequences "
                "(--max-num-seqs)",
                param="prompt",
            )
        if params.top_k >= self.vocab:
            params.top_k = 0  # every token: the same as no top-k

    async def add_all(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        rid: str,
        priority: int,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                sub = rid if len(prompts) == 1 else f"{rid}-{i}"
                streams.append(
                    await self.aengine.add_request(
                        p, params, sub, priority, add_special_tokens, cache_salt=cache_salt
                    )
                )
        except BaseException:
            for s in streams:
                s.abort()
            raise
        if self.config.log_requests:
            for s in streams:
                logger.info(
                    "request %s: %d prompt tokens, %s",
                    s.request_id, len(s.prompt_token_ids), params,
                )  # fmt: skip
        return streams

    @staticmethod
    def abort_all(streams: list[RequestStream]) -> Callable[[], None]:
        def close() -> None:
            for s in streams:
                s.abort()

        return close

    @staticmethod
    async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
        parts: list[list[RequestOutput]] = [[] for _ in streams]
        async for i, out in merged(streams):
            parts[i].append(out)
        return [merge_deltas(p) if p else None for p in parts]  # type: ignore[misc]

    def render_chat(
        self,
        conversation: list[dict[str, str]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation through the chat template; every failure is the client's 400."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so chat is not available")
        if not self.chat_template:
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
            if tools:
                extra["tools"] = tools
            text = apply_chat_template(
                self.tokenizer, conversation, self.chat_template, add_generation_prompt,
                continue_final_message, **extra,
            )  # fmt: skip
        except KVLedgerError:
            raise
        except Exception as e:  # the template runs on the client's messages: their error
            raise APIError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from None
        if not isinstance(text, str) or not text:
            raise APIError(400, "the chat template rendered an empty prompt", param="messages")
        return text


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


def echo_logprobs(out: RequestOutput, prompt_ids: list[int], tokenizer: Any) -> CompletionLogprobs:
    """The prompt's tokens as vLLM echoes them: the first has no logprob (nothing precedes
    it), the rest their prompt logprobs."""
    res = CompletionLogprobs()
    offset = 0
    plps = out.prompt_logprobs or [None] * len(prompt_ids)
    for tid, d in zip(prompt_ids, plps):
        lp = d.get(tid) if d else None
        if lp is not None and lp.decoded_token is not None:
            tok = lp.decoded_token
        else:
            tok = tokenizer.decode([tid]) if tokenizer is not None else ""
        res.tokens.append(tok)
        res.token_logprobs.append(_clamp(lp.logprob) if lp is not None else None)
        res.top_logprobs.append(
            {(x.decoded_token or ""): _clamp(x.logprob) for x in d.values()} if d else None
        )
        res.text_offset.append(offset)
        offset += len(tok)
    return res


def render_prompt_logprobs(plps: Any) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token {token id: Logprob}, the first None."""
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
