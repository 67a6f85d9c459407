"""A caller's prompt and parameters -> checked ``Request``s (vLLM v1's Processor).

Everything a request can be refused for is checked here, before it touches the scheduler:
an empty or too long prompt, token ids outside the vocabulary, logprob counts over
``max_logprobs``, bad words without a tokenizer. Errors are ``InvalidRequestError`` with a
message naming what is wrong (HTTP 400 in the server).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.core.detokenizer import IncrementalDetokenizer
from kvledger.core.request import Request
from kvledger.errors import InvalidRequestError
from kvledger.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        max_logprobs: int,
        check_prompt: Callable[[int], str | None],
    ) -> None:
        """``check_prompt``: the scheduler's "why can a prompt this long never run here"."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.check_prompt = check_prompt

    def tokenize(self, prompt: str) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if self.tokenizer is None:
            raise InvalidRequestError("this model folder has no tokenizer; pass prompts as token ids")
        return self.tokenizer(prompt).input_ids

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        v = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < v for t in token_ids):
            bad = next(t for t in token_ids if not (isinstance(t, int) and 0 <= t < v))
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {v})")
        why = self.check_prompt(len(token_ids))
        if why is not None:
            raise InvalidRequestError(why)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary, the
        logprob cap, and that bad_words have a tokenizer."""
        self.check_logprobs(params)
        v = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if not 0 <= t < v), None)
            if bad is not None:
                raise InvalidRequestError(f"{name} has token id {bad}, outside the vocabulary [0, {v})")
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer, and this model folder has none")

    def check_logprobs(self, params: SamplingParams) -> None:
        """Logprob counts within ``max_logprobs`` (-1: no cap); -1 asks for the whole vocabulary."""
        cap = self.max_logprobs
        for what, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is None:
                continue
            n = self.vocab_size if k == -1 else k
            if cap != -1 and n > cap:
                raise InvalidRequestError(
                    f"Requested {what} logprobs of {n}"
                    + (" (-1: the whole vocabulary)" if k == -1 else "")
                    + f", which is greater than max allowed: {cap} (max_logprobs)"
                )

    def make_sequences(
        self,
        rid: str,
        token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        priority: int,
        cache_salt: str | None,
    ) -> list[Request]:
        """The request's sequences: itself, then its n - 1 children (forked once its prompt is
        computed), each with its own detokenizer."""
        parent = self._new_seq(rid, token_ids, params, arrival, priority, 0)
        children = [
            self._new_seq(f"{rid}#{i}", token_ids, params, arrival, priority, i)
            for i in range(1, params.n)
        ]
        parent.children = children
        for c in children:
            c.parent_id = rid
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else None
        for seq in (parent, *children):
            seq.cache_salt = cache_salt
            seq.bad_words_token_ids = bad_words
        return [parent, *children]

    def _new_seq(
        self, rid: str, token_ids: list[int], params: SamplingParams, arrival: float, prio: int, i: int
    ) -> Request:
        req = Request(
            request_id=rid,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival,
            priority=prio,
            max_total_tokens=self.max_model_len,
            index=i,
        )
        req.detokenizer = IncrementalDetokenizer.new(self.tokenizer, token_ids, params)
        return req

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word as tokenized at the start of the text and, if that gives
        another first token of the same length, after a space (mid-text)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return [ids for ids in out if ids]
