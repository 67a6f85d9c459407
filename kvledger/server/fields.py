"""The request-field policy: every OpenAI / vLLM field the request models do not declare is
either forwarded to SamplingParams or refused here, never silently dropped.

One table per decision, so that a later feature (structured outputs, tools) replaces a refusal
by deleting its row and declaring the field where it is honoured.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvledger.errors import InvalidRequestError
from kvledger.sampling_params import SamplingParams

logger = logging.getLogger("kvledger.server")


class FieldError(InvalidRequestError):
    """A request field that cannot be honoured; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# vLLM's SamplingParams names a request may carry, with the JSON type each must have. They are
# forwarded under the same name when kvledger's SamplingParams has a field of that name, and
# refused ("not supported") otherwise, so each lands as soon as the sampler implements it.
SAMPLING_FIELDS: dict[str, Any] = {
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "logit_bias": dict[str, float],
    "allowed_token_ids": list[int],
    "bad_words": list[str],
    "prompt_logprobs": int,
    "truncate_prompt_tokens": int,
    "logprob_token_ids": list[int],
}

# Neutral values of the forwarded fields: sending one is the same as not sending the field.
SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "logprob_token_ids": (None, []),
}

_CHAT_ONLY = "tool calling is served by /v1/chat/completions"
_TOOLS = "the legacy functions / function_call fields are not served; use tools / tool_choice"
_MULTIMODAL = "this server serves text-only models"
_REASONING = "reasoning effort is not implemented (--reasoning-parser separates the thinking; thinking_token_budget bounds it)"
_DISAGG = "this server has no KV transfer between instances"

# Field -> (values that mean "off", why any other value is refused).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    # tools: served by /v1/chat/completions (which declares them); refused on completions
    "tools": ((None, []), _CHAT_ONLY),
    "tool_choice": ((None, "none"), _CHAT_ONLY),
    "parallel_tool_calls": ((None, True, False), _CHAT_ONLY),
    "functions": ((None, []), _TOOLS),
    "function_call": ((None, "none", "auto"), _TOOLS),
    # decoding modes kvledger does not have
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search only"),
    "watermarking": ((None,), "watermarking is not implemented"),
    "repetition_detection": ((None,), "repetition detection is not implemented"),
    "reasoning_effort": ((None,), _REASONING),
    "thinking_token_budget": ((None,), "thinking budgets are served by /v1/chat/completions (--reasoning-parser)"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "truncation_side": ((None,), "prompt truncation is not implemented"),
    # inputs kvledger does not take
    "prompt_embeds": ((None,), "prompt embeddings are not accepted; send text or token ids"),
    "media_io_kwargs": ((None, {}), _MULTIMODAL),
    "mm_processor_kwargs": ((None, {}), _MULTIMODAL),
    "mm_payload": ((None, "tensors"), _MULTIMODAL),
    "return_mm_kwargs": ((None, False), _MULTIMODAL),
    "modalities": ((None, ["text"]), _MULTIMODAL),
    "audio": ((None,), _MULTIMODAL),
    "documents": ((None, []), "documents for RAG chat templates are not accepted"),
    "chat_template": (
        (None,),
        "per-request chat templates are not accepted; start the server with --chat-template",
    ),
    "web_search_options": ((None,), "web search is not available"),
    # response extras kvledger does not produce
    "return_tokens_as_token_ids": ((None, False), "not implemented"),
    "return_token_ids": ((None, False), "not implemented"),
    "return_token_offsets": ((None, False), "not implemented"),
    "return_prompt_text": ((None, False), "not implemented"),
    "routed_experts_prompt_start": ((None, 0), "not implemented"),
    "top_logprobs_of": ((None,), "not implemented"),
    # serving features of vLLM's deployment
    "kv_transfer_params": ((None,), _DISAGG),
    "ec_transfer_params": ((None,), _DISAGG),
    "cache_salt": ((None,), "cache_salt is taken by /v1/completions and /v1/chat/completions"),
    "vllm_xargs": ((None, {}), "no extension takes extra arguments"),
    "stream_interval": ((None, 1), "every step's output is streamed"),
    "session_id": ((None,), "sessions are not implemented"),
    # SGLang's extensions, which sglang-router writes into every request it forwards, at these
    # values unless its client set them: accepted there, refused otherwise.
    "no_stop_trim": ((None, False), "stop strings are always trimmed"),
    "return_hidden_states": ((None, False), "hidden states are not returned"),
    "separate_reasoning": ((None, True, False), "there is no reasoning parser"),
    "stream_reasoning": ((None, True, False), "there is no reasoning parser"),
    "lora_path": ((None,), "LoRA is not implemented"),
    "session_params": ((None,), "sessions are not implemented"),
}

# Accepted and deliberately without effect on the output (OpenAI's own semantics).
ACCEPTED_NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key"})

# OpenAI fields a client library may send with every request that change nothing generated
# here: accepted, with one warning per field and process (vLLM accepts such fields and logs
# them as ignored), so that such a client works; the value's type is still checked.
ACCEPTED_WITH_WARNING: dict[str, tuple[type | tuple[type, ...], str]] = {
    "store": (bool, "this server stores no completions"),
    "metadata": (dict, "this server stores no completions"),
    "service_tier": (str, "this server has one service tier"),
    "verbosity": (str, "the output's length is set by max_tokens and the model"),
}
_warned: set[str] = set()
# The response header naming the fields accepted and ignored in that request (besides the log
# line, which is written once per field and process).
WARNING_HEADER = "x-kvledger-warning"


def ignored_fields(extra: dict[str, Any]) -> list[str]:
    """The fields of ``extra`` accepted with a warning and ignored (set, not null)."""
    return sorted(n for n, v in extra.items() if n in ACCEPTED_WITH_WARNING and v is not None)


def warning_headers(extra: dict[str, Any]) -> dict[str, str]:
    """``{WARNING_HEADER: ...}`` when the request set a field accepted and ignored, else {}."""
    names = ignored_fields(extra)
    if not names:
        return {}
    return {WARNING_HEADER: "accepted and ignored (no effect on this server): " + ", ".join(names)}


def is_numeric(annotation: Any) -> bool:
    """An int or float field (or a list of them) that pydantic would fill from a boolean."""
    text = str(annotation)
    return ("int" in text or "float" in text) and "bool" not in text


def has_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list):
        return any(has_bool(v) for v in value)
    if isinstance(value, dict):
        return any(has_bool(v) for v in value.values())
    return False


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


def check_extra_fields(extra: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields to forward, after refusing anything this server cannot honour.

    Unknown fields pass only as null (a client that sets a field to "nothing" loses nothing).
    """
    forward: dict[str, Any] = {}
    params = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, value in extra.items():
        if name in SAMPLING_FIELDS:
            if _is_neutral(value, SAMPLING_NEUTRAL[name]):
                continue
            if name not in params:
                raise FieldError(f"{name} is not supported by this server", param=name)
            if is_numeric(SAMPLING_FIELDS[name]) and has_bool(value):
                raise FieldError(f"{name} must be a number, not a boolean", param=name)
            try:
                forward[name] = TypeAdapter(SAMPLING_FIELDS[name]).validate_python(value)
            except ValidationError as e:
                msg = e.errors()[0].get("msg", "invalid")
                raise FieldError(f"{name}: {msg}", param=name) from None
        elif name in REFUSED:
            neutral, why = REFUSED[name]
            if not _is_neutral(value, neutral):
                raise FieldError(f"{name} is not supported: {why}", param=name)
        elif name in ACCEPTED_WITH_WARNING:
            kind, why = ACCEPTED_WITH_WARNING[name]
            if value is not None and not isinstance(value, kind):
                raise FieldError(f"{name} must be of type {kind.__name__}", param=name)
            if value is not None and name not in _warned:
                _warned.add(name)
                logger.warning("request field %r accepted and ignored: %s", name, why)
        elif name in ACCEPTED_NO_EFFECT:
            if value is not None and not isinstance(value, str):
                raise FieldError(f"{name} must be a string", param=name)
        elif value is not None:
            raise FieldError(f"unknown field {name!r}", param=name)
    return forward


def refuse_extra_fields(extra: dict[str, Any]) -> None:
    """For endpoints without sampling (tokenize, detokenize): any non-null extra field is a 400."""
    for name, value in extra.items():
        if value is not None:
            raise FieldError(f"unknown field {name!r}", param=name)
