"""Grammar backends behind one small interface: xgrammar (the default, as in vLLM) and
llguidance ("guidance"), chosen by ``structured_outputs_config["backend"]`` with vLLM's names:
``"xgrammar"``, ``"guidance"`` or ``"auto"`` (xgrammar, falling back to llguidance for a
constraint xgrammar refuses, e.g. a ``whitespace_pattern``, unless ``disable_fallback``).

Both fill the same packed int32 token bitmask (bit j of word w allows token 32 w + j), so
the sampler, the fused masked argmax and preemption do not care which one made it. The
matcher interface the engine uses is xgrammar's: ``accept_token``, ``is_terminated``,
``fork``, ``fill_next_token_bitmask`` and ``reset``; ``GuidanceMatcher`` adapts llguidance's
LLMatcher to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvledger.errors import InvalidRequestError

BACKENDS = ("xgrammar", "guidance", "auto")


def guidance_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(params: Any, backend: str) -> str:
    """The backend that will run ``params`` under the configured ``backend``; raises
    InvalidRequestError (400) naming the problem when none can. Remembered on the params."""
    if backend not in BACKENDS:
        raise InvalidRequestError(f"structured outputs backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if params.resolved_backend is not None:
        return params.resolved_backend
    if backend == "xgrammar" or (backend == "auto" and (params.xgrammar_error is None or params.disable_fallback)):
        if params.xgrammar_error is not None:
            raise InvalidRequestError(params.xgrammar_error)
        chosen = "xgrammar"
    elif backend == "guidance":
        guidance_grammar(params)
        chosen = "guidance"
    else:  # auto, and xgrammar cannot take it: llguidance may
        try:
            guidance_grammar(params)
        except InvalidRequestError:
            raise InvalidRequestError(params.xgrammar_error) from None
        chosen = "guidance"
    params.resolved_backend = chosen
    return chosen


def guidance_grammar(params: Any) -> str:
    """The constraint as an llguidance grammar (checked; 400 naming the problem)."""
    if not guidance_available():
        raise InvalidRequestError("the guidance backend needs the llguidance package (pip install llguidance)")
    import llguidance

    if params.guidance_grammar is not None:
        return params.guidance_grammar
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.schema() if kind == "json" else {"type": "object"}
            defaults: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                defaults = {"whitespace_pattern": params.whitespace_pattern}
            elif not params.disable_any_whitespace and params.max_whitespace_cnt is not None:
                # llguidance's bound: its flexible whitespace as a pattern with a repeat limit
                defaults = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{params.max_whitespace_cnt}}}"}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
        elif kind == "regex":
            grammar = llguidance.grammar_from("regex", params.regex)
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(params.choice))
        elif kind == "grammar":
            grammar = llguidance.grammar_from("grammar", params.grammar)  # Lark or GBNF
        else:
            raise InvalidRequestError(f"{kind} needs the xgrammar backend")
    except InvalidRequestError:
        raise
    except Exception as e:  # a grammar llguidance cannot convert
        raise InvalidRequestError(f"invalid {kind} (guidance backend): {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"invalid {kind} (guidance backend): {error}")
    params.guidance_grammar = grammar
    return grammar


@dataclass
class GuidanceGrammar:
    """A checked llguidance grammar with the tokenizer it runs against (the "compiled" form:
    llguidance computes token masks lazily, so there is nothing more to precompute)."""

    tokenizer: Any  # llguidance.LLTokenizer
    grammar: str
    vocab_size: int
    stop_token_ids: frozenset[int]

    def new_matcher(self) -> GuidanceMatcher:
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"guidance backend: {m.get_error()}")
        return GuidanceMatcher(m, self.stop_token_ids)


class GuidanceMatcher:
    """llguidance's LLMatcher with xgrammar's GrammarMatcher method names and meaning: it is
    terminated once a stop token is accepted (llguidance stops one token earlier, when only a
    stop token is left; the engine drops a finishing stop token's text, so the end must be
    the stop token, as with xgrammar)."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stop_ids = stop_token_ids
        self._ended = False

    def accept_token(self, token: int) -> bool:
        ok = bool(self._m.consume_token(token))
        self._ended = ok and token in self._stop_ids
        return ok

    def is_terminated(self) -> bool:
        return self._ended

    def fork(self) -> GuidanceMatcher:
        other = GuidanceMatcher(self._m.deep_copy(), self._stop_ids)
        other._ended = self._ended
        return other

    def fill_next_token_bitmask(self, mask: Any, index: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, mask, index)

    def reset(self) -> None:
        self._m.reset()
        self._ended = False


def new_matcher(compiled: Any) -> Any:
    """A fresh matcher for a compiled grammar of either backend."""
    if isinstance(compiled, GuidanceGrammar):
        return compiled.new_matcher()
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def vocab_size_of(compiled: Any) -> int:
    if isinstance(compiled, GuidanceGrammar):
        return compiled.vocab_size
    return compiled.tokenizer_info.vocab_size
