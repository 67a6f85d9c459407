"""Prompt shapes the offline API accepts, as vLLM names them (``vllm.inputs``)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as they are."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, echoed back in RequestOutput.prompt
    cache_salt: NotRequired[str]


SingletonPrompt = str | TextPrompt | TokensPrompt
PromptType = SingletonPrompt
