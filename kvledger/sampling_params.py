"""Per-request decoding options, validated once at the edge (vLLM's SamplingParams shape)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvledger.errors import InvalidRequestError
from kvledger.structured.params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a stream carries (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far: text, token ids and logprobs
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once if the token is in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # transformers' / vLLM's, over prompt + output
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k alternatives beside the sampled token; -1: all
    prompt_logprobs: int | None = None  # the engine caps both at max_logprobs (default 20)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (vLLM's rule, over the output)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # kvledger.structured

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:  # JSON keys arrive as strings
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise InvalidRequestError(
                    "logit_bias must map token ids (integers) to numbers"
                ) from None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < -1):
                bad(f"{name} must be an integer >= 0, or -1 for the whole vocabulary; got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and -2.0 <= v <= 2.0):
                bad(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not (isinstance(rp, int | float) and 0.0 < rp < float("inf")):
            bad(f"repetition_penalty must be > 0, got {rp!r}")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            bad("logit_bias values must be finite numbers")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids must be a non-empty list of token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words must be a list of non-empty strings")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            bad(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
