"""Property-based fuzz of the request models: any JSON body either becomes SamplingParams or
fails with a client error (pydantic's ValidationError or a KVLedgerError, both 400s in the
server), never another exception (a 500); and an accepted body dropped nothing it asked for."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvledger.errors import KVLedgerError
from kvledger.sampling_params import SamplingParams
from kvledger.server.fields import (
    ACCEPTED_NO_EFFECT,
    REFUSED,
    SAMPLING_FIELDS,
    SAMPLING_NEUTRAL,
    _is_neutral,
)
from kvledger.server.protocol import ChatCompletionRequest, CompletionRequest

_EDGE_INTS = st.sampled_from([0, 1, -1, 2, 511, 512, 2**31, 2**63 - 1, 2**63, 2**64, 2**70,
                              -(2**63), -(2**70)])  # fmt: skip
_EDGE_TEXT = st.sampled_from(["", "Once", "\ud800", "a\x00b", "\udfff\ud800", "x" * 300])
_TEXT = st.text(st.characters(exclude_categories=()), max_size=12) | _EDGE_TEXT
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | _EDGE_INTS
    | st.floats(allow_nan=True, allow_infinity=True)
    | _TEXT
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=10,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | _JSON},
    optional={"content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                 "text": _TEXT}), max_size=3)
              | _JSON, "name": _JSON},
)  # fmt: skip


def _fields(model) -> list[str]:
    return sorted(set(model.model_fields) | set(SAMPLING_FIELDS) | set(REFUSED)
                  | ACCEPTED_NO_EFFECT | {"unknown_thing"})  # fmt: skip


def _bodies(model, required: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        required, optional={k: _JSON for k in _fields(model) if k not in required}
    )


def _check_nothing_dropped(body: dict, model, params: SamplingParams) -> None:
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    for key, value in body.items():
        if key in model.model_fields or key in ACCEPTED_NO_EFFECT or value is None:
            continue
        if key in SAMPLING_FIELDS:
            assert key in have or _is_neutral(value, SAMPLING_NEUTRAL[key]), key
        elif key in REFUSED:
            assert _is_neutral(value, REFUSED[key][0]), (key, value)
        else:
            pytest.fail(f"unknown field {key!r}={value!r} was accepted")


_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_SETTINGS
@given(body=_bodies(CompletionRequest, {"prompt": _JSON | _TEXT | st.lists(_EDGE_INTS)}))
def test_completion_bodies_fail_only_as_client_errors(body):
    try:
        req = CompletionRequest.model_validate(body)
        req.prompts()
        params = req.to_sampling_params()
    except (ValidationError, KVLedgerError):
        return
    _check_nothing_dropped(body, CompletionRequest, params)
    for p in req.prompts():
        if isinstance(p, str):
            p.encode("utf-8")  # no lone surrogate got through
        else:
            assert p and all(0 <= t < 2**63 and not isinstance(t, bool) for t in p)
    assert params.seed is None or -(2**63) <= params.seed < 2**63
    assert not any(isinstance(getattr(params, f), bool) for f in ("n", "max_tokens", "seed", "top_k"))


@_SETTINGS
@given(body=_bodies(ChatCompletionRequest, {"messages": st.lists(_MESSAGE, max_size=3) | _JSON}))
def test_chat_bodies_fail_only_as_client_errors(body):
    try:
        req = ChatCompletionRequest.model_validate(body)
        conv = req.conversation()
        params = req.to_sampling_params()
    except (ValidationError, KVLedgerError):
        return
    _check_nothing_dropped(body, ChatCompletionRequest, params)
    for m in conv:
        m["content"].encode("utf-8")
