"""StructuredOutputsParams: what a request's output must match (vLLM's names and rules).

Exactly one constraint: ``json`` (a JSON schema: dict, JSON text or a pydantic model class),
``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF / GBNF), ``json_object`` (any
JSON object) or ``structural_tag``. The constraint is parsed into an xgrammar ``Grammar`` when
the request is made, so a bad schema, regex or grammar is refused at the edge with xgrammar's
own message; the expensive part (the token-mask cache over the vocabulary) is compiled later,
off the step loop (kvledger.structured.compiler).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvledger.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Whitespace characters allowed in one gap of a JSON grammar (between keys, values and
# separators; never inside strings) unless the request or server says otherwise. Unbounded (as
# xgrammar's default), a model that prefers whitespace may emit it until max_tokens: on
# stories260k every json_schema answer did. 4 still fits a newline plus a small indent
# (docs/server_notes.md, "JSON whitespace"; benchmarks/json_whitespace.py measured it).
DEFAULT_MAX_WHITESPACE_CNT = 4
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its source-location prefix."""
    msg = str(exc).strip()
    msg = _XGR_PREFIX.sub("", msg)
    return _CHECK_FAILED.sub("", msg).strip()


class XGrammarRefusal(InvalidRequestError):
    """xgrammar cannot take this (valid-looking) constraint; llguidance may."""


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # "auto" backend: do not fall back to llguidance
    whitespace_pattern: str | None = None  # the guidance backend's (xgrammar has none)
    # JSON grammars: at most this many whitespace characters per gap; None: unbounded
    max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT
    _grammar: Any = field(default=None, init=False, repr=False, compare=False)
    _xgrammar_error: str | None = field(default=None, init=False, repr=False, compare=False)
    guidance_grammar: str | None = field(default=None, init=False, repr=False, compare=False)
    resolved_backend: str | None = field(default=None, init=False, repr=False, compare=False)
    # A reasoning model's end-of-thinking tag as token ids: the grammar applies after them
    # (set by the server's --reasoning-parser; kvledger.structured.state.GrammarState)
    reasoning_end_ids: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)
    # vLLM's thinking_token_budget: after this many thinking tokens the end ids are forced
    thinking_budget: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.json is not None and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        cnt = self.max_whitespace_cnt
        if cnt is not None and (isinstance(cnt, bool) or not isinstance(cnt, int) or cnt < 1):
            raise InvalidRequestError(
                f"max_whitespace_cnt must be a positive integer or null (unbounded), got {cnt!r}"
            )
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, regex, choice, grammar, "
                f"json_object or structural_tag; got {set_kinds or 'none'}"
            )
        try:
            if self.whitespace_pattern is not None:
                raise XGrammarRefusal(
                    "whitespace_pattern is not supported by the xgrammar backend "
                    "(the guidance backend supports it)"
                )
            self._grammar = self._parse()
        except XGrammarRefusal as e:
            # Refused now unless llguidance takes it ("guidance" / "auto" backends; the
            # engine's backend choice, kvledger.structured.backends.resolve_backend, decides).
            from kvledger.structured.backends import guidance_available, guidance_grammar

            if not guidance_available():
                raise
            self._xgrammar_error = str(e)
            try:
                guidance_grammar(self)
            except InvalidRequestError:
                raise e from None

    @property
    def xgrammar_error(self) -> str | None:
        """Why xgrammar refuses this constraint (llguidance accepts it), or None."""
        return self._xgrammar_error

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the parsed grammar (a native object): an engine core process
        parses the source again when the request reaches it."""
        state = dict(self.__dict__)
        state["_grammar"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._xgrammar_error is None:  # xgrammar took it (else llguidance's text travelled)
            self._grammar = self._parse()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> dict | bool:
        """The JSON schema of a ``json`` constraint, checked (disable_additional_properties applied)."""
        return self._schema()

    def key(self) -> tuple:
        """A hashable identity of the constraint: the compiled-grammar cache's key."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            spec = tuple(self.choice)
        return (kind, spec, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern, self.max_whitespace_cnt)

    @property
    def parsed_grammar(self):
        """The xgrammar Grammar, parsed and checked when the params were made."""
        return self._grammar

    def _parse(self):
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind == "json":
                schema = self._schema()
                return xgr.Grammar.from_json_schema(
                    json.dumps(schema), any_whitespace=not self.disable_any_whitespace,
                    max_whitespace_cnt=self.max_whitespace_cnt,
                )
            if kind == "regex":
                if not isinstance(self.regex, str) or not self.regex:
                    raise InvalidRequestError("regex must be a non-empty string")
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                choices = self.choice
                if (
                    not isinstance(choices, list | tuple)
                    or not choices
                    or not all(isinstance(c, str) and c for c in choices)
                ):
                    raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
                self.choice = list(choices)
                # A JSON string literal is also a valid EBNF literal (same escapes).
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
            if kind == "grammar":
                if not isinstance(self.grammar, str) or not self.grammar.strip():
                    raise InvalidRequestError("grammar must be a non-empty EBNF (GBNF) string")
                return xgr.Grammar.from_ebnf(self.grammar)
            if kind == "json_object":  # any JSON object (not any JSON value), as vLLM
                return xgr.Grammar.from_json_schema(
                    '{"type": "object"}', any_whitespace=not self.disable_any_whitespace, strict_mode=False,
                    max_whitespace_cnt=self.max_whitespace_cnt,
                )
            tag = self.structural_tag
            return xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar reports bad input as RuntimeError / ValueError
            raise XGrammarRefusal(f"invalid {_NAMES[kind]}: {xgrammar_message(e)}") from None

    def _schema(self) -> dict | bool:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("invalid JSON schema: a schema is a JSON object")
        if self.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        return schema


_NAMES = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural tag",
}


def _no_additional_properties(schema: Any) -> Any:
    """Every object in the schema that does not say otherwise gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
