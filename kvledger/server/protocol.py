"""The OpenAI wire format: pydantic request and response models for /v1/completions and
/v1/chat/completions, and their mapping onto SamplingParams.

Requests accept unknown fields (clients send options we do not model) but reject values we
model and cannot honour, so a client never silently gets something other than it asked for.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvledger.errors import InvalidRequestError
from kvledger.sampling_params import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields common to both endpoints, including vLLM's extras (top_k, min_p, ...)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # OpenAI's default: 1.0
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extras, as in vLLM.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0  # lower runs first under --victim-policy priority

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None
    ) -> SamplingParams:
        """Unset options take the model's generation_config.json defaults (``defaults``, as
        vLLM's server does), then OpenAI's."""
        d = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true")
        bias = None
        if self.logit_bias:
            try:  # OpenAI clamps biases to [-100, 100]
                bias = {int(k): min(100.0, max(-100.0, float(v))) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError("logit_bias keys must be token ids") from None
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise InvalidRequestError("prompt is empty")
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (only best_of == n)")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported")
        if self.echo and not all(isinstance(p, str) for p in self.prompts()):
            raise InvalidRequestError("echo needs text prompts, not token ids")
        return self._sampling_params(self.max_tokens, self.logprobs, defaults)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if not isinstance(part, TextContentPart):
                kind = part.get("type", "?") if isinstance(part, dict) else "?"
                raise InvalidRequestError(f"message content of type {kind!r} is not supported")
            parts.append(part.text)
        return "".join(parts)


class ResponseFormat(_Request):
    type: str = "text"


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise InvalidRequestError("tools are not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequestError("response_format must be {'type': 'text'}")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)

    def conversation(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out


# -- responses ------------------------------------------------------------------------------


class _Response(BaseModel):
    pass


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kvledger"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
