"""``speculative_config`` (vLLM's keys and meaning), validated once at the edge.

``LLM(..., speculative_config={...})`` and ``kvledger serve --speculative-config '{json}'`` take
the same keys as vLLM; a key vLLM has that kvledger does not implement (EAGLE, a draft under
tensor parallelism, a tree) is refused by name rather than ignored, so a config never silently
means something else.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import ConfigError
from kvledger.json_config import json_object, refuse_unknown

METHODS = ("ngram", "suffix", "draft_model")
# Running requests above which no request speculates, when disable_by_batch_size is unset.
# Measured on stories260k on a 2-core AMD EPYC (docs/benchmarks.md, "Speculative decoding"):
# a step verifying 1 + 8 rows per request cost 1.15-1.4x a decode step at 1-16 requests, 2.2-2.4x
# at 32-64, more than the 1.7-1.8 tokens per verification stories260k's drafts bring.
DEFAULT_MAX_BATCH = 16
# Method suffix's tree_nodes when unset. stories260k, 1 stream, 2-core EPYC (docs/benchmarks.md,
# "Speculative decoding"): 8 nodes 1.74x / 1.81x speculation off (tried / held-out prompts), 16
# nodes 1.58x / 2.04x, a chain of 8 1.53x / 1.59x: a row costs ~2 % of a step of this model, so
# the wider tree's extra accepted tokens (2.17 against 2.06 per step) did not pay for its rows.
TREE_NODES = 8
# vLLM keys refused with a reason (not silently ignored).
_NOT_IMPLEMENTED = {
    "draft_tensor_parallel_size": "the draft model runs in the engine's one worker (no tensor parallelism)",
    "revision": "models are local folders (no hub revisions)",
    "code_revision": "models are local folders (no hub revisions)",
    "speculative_token_tree": "tree speculation is not implemented",
}


@dataclass
class SpeculativeConfig:
    """vLLM's SpeculativeConfig for the draft-free methods, plus the adaptive gate's knobs.

    ``disable_by_batch_size`` (vLLM's key): no request speculates in a step where more than
    this many requests run. Unlike vLLM (no limit unless set), unset means
    ``DEFAULT_MAX_BATCH``: decoding a large batch is compute-bound, so a verification's extra
    rows cost about their share of the step while a draft only saves steps. ``adaptive``
    (kvledger's): a request whose drafts keep missing stops proposing and probes again later
    (``kvledger.spec_decode.adaptive``)."""

    # None: "draft_model" when ``model`` is given, else "ngram" (vLLM infers the method from
    # ``model`` the same way).
    method: str | None = None
    num_speculative_tokens: int | None = None
    # method "draft_model" (vLLM's keys): the draft's HF folder (same vocabulary as the target)
    # and its on-the-fly weight quantization (kvledger.config.QUANTIZATION_METHODS; None: as
    # stored). kvledger.worker.drafter.
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    # kvledger's: draft tokens a verification may spread over a token tree of candidate
    # continuations (kvledger.spec_decode.tree), each at most num_speculative_tokens long; 0: one
    # chain (vLLM's drafts). Method "suffix" only (default TREE_NODES there); on an engine that
    # cannot verify trees (tensor parallelism, quantised or windowed KV, GPU attention) its
    # requests draft one chain.
    tree_nodes: int | None = None
    # method "suffix" (vLLM's keys; kvledger.spec_decode.suffix). The depth is that of the
    # n-gram tables (vLLM's default 24 is a tree's; each level here costs a table entry per
    # token, so kvledger's default is 8), the cache holds fewer requests than vLLM's 10,000
    # for the same reason.
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict or its JSON text (the CLI flag); names the bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            if value is not None:
                value.validate()
            return value
        value = json_object("speculative_config", value)
        for key, why in _NOT_IMPLEMENTED.items():
            if value.get(key) is not None:
                raise ConfigError(f"speculative_config.{key}: {why}")
        value = {k: v for k, v in value.items() if k not in _NOT_IMPLEMENTED}
        refuse_unknown("speculative_config", value, cls, tuple(_NOT_IMPLEMENTED))
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.model in ("ngram", "[ngram]") and self.method is None:  # vLLM's older spelling
            self.method, self.model = "ngram", None
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method == "[ngram]":  # vLLM's older spelling
            self.method = "ngram"
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config.method must be one of {', '.join(METHODS)}; got {self.method!r}"
            )
        if self.method == "suffix":
            self._validate_suffix()
        self._validate_draft()
        if self.num_speculative_tokens is None:
            raise ConfigError("speculative_config.num_speculative_tokens is required")
        _int_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        # vLLM's defaults: both 5 when neither is given, else the given one for both.
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        _int_at_least("prompt_lookup_min", lo, 1)
        _int_at_least("prompt_lookup_max", hi, 1)
        if lo > hi:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        if self.disable_by_batch_size is None:
            self.disable_by_batch_size = DEFAULT_MAX_BATCH
        _int_at_least("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.tree_nodes is None:
            self.tree_nodes = TREE_NODES if self.method == "suffix" else 0
        _int_at_least("tree_nodes", self.tree_nodes, 0)
        if self.tree_nodes and self.method != "suffix":
            raise ConfigError(
                f"speculative_config.tree_nodes is for method suffix; method {self.method} drafts one chain"
            )
        if not isinstance(self.adaptive, bool):
            raise ConfigError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}"
            )

    def _validate_draft(self) -> None:
        """(``quantization``'s value is checked by EngineConfig, with the target's.)"""
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(
                    "speculative_config.model (the draft model's folder) is required for method draft_model"
                )
        elif self.model is not None or self.quantization is not None:
            key = "model" if self.model is not None else "quantization"
            raise ConfigError(
                f"speculative_config.{key} is for method draft_model; method {self.method} has no draft model"
            )

    def _validate_suffix(self) -> None:
        _int_at_least("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _int_at_least(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0
        )
        f = self.suffix_decoding_max_spec_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or f <= 0:
            raise ConfigError(
                f"speculative_config.suffix_decoding_max_spec_factor must be > 0, got {f!r}"
            )
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1:
            raise ConfigError(
                f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got {p!r}"
            )
        if self.num_speculative_tokens is None:  # vLLM's default: the tree's depth
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth


def _int_at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"speculative_config.{name} must be an integer >= {low}, got {value!r}")
