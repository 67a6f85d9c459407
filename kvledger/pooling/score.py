"""Scoring text pairs, shared by ``LLM.score`` and the HTTP ``/score`` and ``/rerank`` (vLLM's
rules): ``text_1`` is one text or as many as ``text_2``; a classifier (cross-encoder) reads each
pair as one prompt, the tokenizer's pair encoding (``tokenizer(text_1, text_pair=text_2)``); an
embedding model (bi-encoder) embeds both sides and scores the cosine of the two vectors.

Also prompt truncation (``truncate_prompt_tokens``), vLLM's meaning: keep the last k tokens of a
prompt (-1: the model's context length); a pair is truncated by the tokenizer to k tokens
(``truncation=True, max_length=k``), as vLLM's score path does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvledger.errors import InvalidRequestError


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str], names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score: one text_1 against each text_2, or side by side."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, side in zip(names, (left, right)):
        if not side:
            raise InvalidRequestError(f"{name} is empty: give at least one text")
        if not all(isinstance(t, str) for t in side):
            raise InvalidRequestError(f"{name} must be a string or a list of strings")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise InvalidRequestError(
            f"{names[0]} has {len(left)} texts and {names[1]} {len(right)}: give one {names[0]} "
            f"or as many as {names[1]}"
        )
    return list(zip(left, right))


def check_truncation(k: int | None) -> None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")


def truncation_length(k: int | None, max_model_len: int) -> int | None:
    """The number of tokens a prompt keeps (None: all of them)."""
    check_truncation(k)
    return max_model_len if k == -1 else k


def truncate(ids: list[int], k: int | None) -> list[int]:
    """The last ``k`` tokens (vLLM's truncate_prompt_tokens keeps the end of a prompt)."""
    return ids if k is None or len(ids) <= k else ids[-k:]


def encode_pair(tokenizer: Any, a: str, b: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
    """One cross-encoder prompt: the tokenizer's pair encoding of (a, b)."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: text pairs cannot be encoded")
    kw: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length is not None else {}
    return list(tokenizer(text=a, text_pair=b, add_special_tokens=add_special_tokens, **kw).input_ids)


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    """Cosine similarity of two embeddings (torch's ``cosine_similarity``, eps 1e-8)."""
    dot = math.fsum(x * y for x, y in zip(u, v))
    nu = math.sqrt(math.fsum(x * x for x in u))
    nv = math.sqrt(math.fsum(y * y for y in v))
    return dot / max(nu * nv, 1e-8)
