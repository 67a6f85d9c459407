"""The OpenAI wire format: pydantic request and response models for /v1/completions,
/v1/chat/completions, /tokenize and /detokenize, and their mapping onto SamplingParams.

No field is silently dropped: a field these models do not declare is forwarded to
SamplingParams or refused with a 400 naming it (kvledger/server/fields.py). Strings with lone
surrogates, non-finite numbers, booleans where numbers belong and integers beyond 64 bits are
400s here, before any of them reaches the tokenizer or the sampler. NUL (U+0000) is valid text
(a byte-fallback token; vLLM's random benchmark prompts hold it) except in the fields compiled
into grammars.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvledger.errors import InvalidRequestError
from kvledger.sampling_params import SamplingParams
from kvledger.server.fields import (
    FieldError,
    check_extra_fields,
    has_bool,
    is_numeric,
    refuse_extra_fields,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
_MAX_DEPTH = 32  # nesting a request can need (a chat message's content parts is 4 deep)


# Fields whose text is compiled into a grammar or schema by a C/C++ library: no NUL there.
_GRAMMAR_FIELDS = ("guided_", "structured_outputs", "response_format", "tools", "tool_choice")


def _check_strings(value: Any, path: str, depth: int = 0) -> None:
    """Refuse text no tokenizer can take (lone UTF-16 surrogates: invalid Unicode), and NUL
    in grammar fields."""
    if depth > _MAX_DEPTH:
        raise FieldError(f"{path or 'body'} is nested too deeply", param=path or None)
    if isinstance(value, str):
        if "\x00" in value and path.startswith(_GRAMMAR_FIELDS):
            raise FieldError(f"{path} contains a NUL character (not allowed in a grammar)", param=path)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise FieldError(
                f"{path} contains a lone UTF-16 surrogate (not valid Unicode)", param=path
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path, depth + 1)
            _check_strings(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}[{i}]", depth + 1)


class _Request(BaseModel):
    """Extra fields are kept so that the policy can refuse or forward each of them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _check_strings(data, "")
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is not None and is_numeric(field.annotation) and has_bool(value):
                    raise FieldError(f"{name} must be a number, not a boolean", param=name)
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's per-chunk usage: not implemented


class _SamplingFields(_Request):
    """Fields common to both endpoints, including vLLM's extras (top_k, min_p, ...)."""

    model: str | None = None
    n: int = Field(1, le=INT64_MAX)  # SamplingParams says why n < 1 is wrong
    temperature: float | None = None  # OpenAI's default: 1.0
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extras, as in vLLM.
    top_k: Int64 | None = None
    min_p: float | None = None
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int64 = 0  # lower runs first under --victim-policy priority
    request_id: str | None = Field(None, max_length=128)
    # vLLM's tenant isolation: enters the first KV block's hash, so requests with another salt
    # (or none) never share a cached block with this one, in any tier (cache/kv_tiers.py).
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # Structured outputs (kvledger/server/structured_fields.py): OpenAI's and vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None
    ) -> SamplingParams:
        """Unset options take the model's generation_config.json defaults (``defaults``, as
        vLLM's server does), then OpenAI's."""
        d = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed when stream is true", "stream_options")
        forwarded = check_extra_fields(self.model_extra or {})
        if "logit_bias" in forwarded:
            forwarded["logit_bias"] = _logit_bias(forwarded["logit_bias"])
        if "repetition_penalty" in d and "repetition_penalty" in _PARAM_FIELDS:
            forwarded.setdefault("repetition_penalty", d["repetition_penalty"])
        try:
            return SamplingParams(
                n=self.n,
                temperature=pick(self.temperature, "temperature", 1.0),
                top_p=pick(self.top_p, "top_p", 1.0),
                top_k=pick(self.top_k, "top_k", 0),
                min_p=pick(self.min_p, "min_p", 0.0),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=[] if self.stop is None else self.stop,  # "" is [""]: refused, as vLLM
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                **forwarded,
            )
        except (TypeError, OverflowError) as e:  # a value of a forwarded field
            raise InvalidRequestError(f"invalid sampling parameters: {e}") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as strings; vLLM clamps each bias to [-100, 100]."""
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except ValueError:
            raise FieldError(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not 0 <= tid <= INT64_MAX:
            raise FieldError(f"logit_bias token id {tid} is out of range", "logit_bias")
        if isinstance(v, bool) or not math.isfinite(v):  # NaN would clamp to -100 silently
            raise FieldError(f"logit_bias[{k!r}] must be a finite number, got {v!r}", "logit_bias")
        out[tid] = min(100.0, max(-100.0, v))
    return out


Prompt = str | list[TokenId] | list[str] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=INT64_MAX)
    suffix: str | None = None
    add_special_tokens: bool = True
    return_token_ids: bool | None = None  # vLLM's extension: token ids beside the text

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            if not p:
                raise FieldError("prompt is empty", "prompt")
            return [p]  # type: ignore[list-item]
        if not p:
            raise FieldError("prompt is empty", "prompt")
        if any(not q for q in p):
            raise FieldError("prompt holds an empty prompt", "prompt")
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of is not supported (only best_of == n)", "best_of")
        if self.suffix:
            raise FieldError("suffix is not supported (no fill-in-the-middle)", "suffix")
        if self.echo and not all(isinstance(p, str) for p in self.prompts()):
            raise FieldError("echo needs text prompts, not token ids", "echo")
        params = self._sampling_params(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # vLLM: echo's prompt carries logprobs too
        return params


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this result answers

    def text(self) -> str:
        """vLLM's string content format: text parts joined by newlines."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if not isinstance(part, TextContentPart):
                kind = part.get("type", "?") if isinstance(part, dict) else "?"
                raise FieldError(
                    f"message content of type {kind!r} is not supported (text only)", "messages"
                )
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: BOS unless the template wrote it
    chat_template_kwargs: dict[str, Any] | None = None
    echo: Literal[False] = False  # vLLM's echo of the last message: not implemented
    tools: list[dict[str, Any]] | None = None  # kvledger/server/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # with --reasoning-parser: false drops the thinking
    thinking_token_budget: int | None = Field(None, ge=0, le=INT64_MAX)  # then </think> is forced

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false)",
                "continue_final_message",
            )
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
            if m.tool_calls:
                d["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        refuse_extra_fields(self.model_extra or {})
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]

    @model_validator(mode="after")
    def _no_extra(self) -> DetokenizeRequest:
        refuse_extra_fields(self.model_extra or {})
        return self


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
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: a first prompt token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, other: CompletionLogprobs) -> CompletionLogprobs:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset
        return self


class PromptLogprob(_Response):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # vLLM's extension (return_token_ids): streamed, token_ids is each chunk's delta and
    # prompt_token_ids comes in a choice's first chunk only.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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


def _unset(v: Any) -> bool:
    return v is None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    # --reasoning-parser: the thinking, under vLLM's current name and its former one (which
    # many clients still read); absent otherwise
    reasoning: str | None = Field(None, exclude_if=_unset)
    reasoning_content: str | None = Field(None, exclude_if=_unset)
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # OpenAI's shape


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
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class DeltaMessage(_Response):
    role: str | None = None
    reasoning: str | None = Field(None, exclude_if=_unset)
    reasoning_content: str | None = Field(None, exclude_if=_unset)
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # fragments with an "index"


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
