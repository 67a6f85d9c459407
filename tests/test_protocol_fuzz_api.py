"""Property-based fuzz of the Anthropic Messages and Responses API request models and their
translation into a chat request: any JSON body either becomes a chat request with sampling
params and a conversation, or fails with a client error (pydantic's ValidationError or a
KVLedgerError, both 400s in the server), never another exception (a 500); and the same bodies
sent to a live server (stories260k, tools, a reasoning parser) are never answered with a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvledger.errors import KVLedgerError
from kvledger.server.chat_run import chat_request
from kvledger.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from kvledger.server.protocol_responses import ResponsesRequest
from tests.test_protocol_fuzz import _JSON, _SETTINGS, _TEXT

_BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", "nope"]) | _JSON},
    optional={"text": _TEXT | _JSON, "id": _TEXT, "name": _TEXT, "input": _JSON, "tool_use_id": _TEXT,
              "content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2)
              | _JSON},
)  # fmt: skip
_A_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]) | _JSON,
     "content": _TEXT | st.lists(_BLOCK, max_size=3) | _JSON},
)  # fmt: skip
_A_FIELDS = ["system", "stop_sequences", "stream", "temperature", "top_p", "top_k", "tools", "tool_choice",
             "metadata", "thinking", "output_config", "speed", "container", "unknown_thing"]  # fmt: skip
_ITEM = st.fixed_dictionaries(
    {},
    optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]) | _JSON,
              "role": st.sampled_from(["user", "assistant", "system", "developer"]) | _JSON,
              "content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                  "input_image"]), "text": _TEXT}), max_size=2) | _JSON,
              "call_id": _TEXT | _JSON, "name": _TEXT | _JSON, "arguments": _TEXT | _JSON, "output": _TEXT | _JSON},
)  # fmt: skip
_R_FIELDS = ["instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
             "parallel_tool_calls", "text", "stream", "store", "background", "truncation", "reasoning", "include",
             "seed", "top_k", "stop", "metadata", "unknown_thing"]  # fmt: skip


def _to_chat(fields: dict) -> None:
    req = chat_request(fields)
    req.to_sampling_params()
    for m in req.conversation():
        m["content"].encode("utf-8")


@_SETTINGS
@given(body=st.fixed_dictionaries(
    {"model": _TEXT, "max_tokens": st.integers(-2, 2**64) | _JSON, "messages": st.lists(_A_MESSAGE, max_size=3) | _JSON},
    optional={k: _JSON for k in _A_FIELDS},
))  # fmt: skip
def test_messages_bodies_fail_only_as_client_errors(body):
    try:
        req = MessagesRequest.model_validate(body)
        _to_chat(req.to_chat())
        count = CountTokensRequest.model_validate({k: v for k, v in body.items() if k != "max_tokens"})
        _to_chat({**count.chat_fields(), "max_tokens": 1})
    except (ValidationError, KVLedgerError):
        return


@_SETTINGS
@given(body=st.fixed_dictionaries(
    {"input": _TEXT | st.lists(_ITEM, max_size=3) | _JSON},
    optional={k: _JSON for k in _R_FIELDS},
))  # fmt: skip
def test_responses_bodies_fail_only_as_client_errors(body):
    try:
        req = ResponsesRequest.model_validate(body)
        _to_chat(req.chat_fields([]))
    except (ValidationError, KVLedgerError):
        return


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from tests.test_server import running_stories
    from tests.test_server_structured import TEMPLATE

    with running_stories(tmp_path_factory, "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1") as srv:  # fmt: skip
        yield srv


def _post(live, path: str, body: dict) -> None:
    try:
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        return
    r = httpx.post(f"{live.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"], r.text  # the problem is named


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries(
    {"model": _TEXT, "max_tokens": st.integers(-1, 40) | _JSON, "messages": st.lists(_A_MESSAGE, max_size=3) | _JSON},
    optional={k: _JSON for k in _A_FIELDS},
))  # fmt: skip
def test_live_messages_bodies_are_never_5xx(live, body):
    _post(live, "/v1/messages", body)
    _post(live, "/v1/messages/count_tokens", body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries(
    {"input": _TEXT | st.lists(_ITEM, max_size=3) | _JSON, "max_output_tokens": st.integers(-1, 40) | _JSON},
    optional={k: _JSON for k in _R_FIELDS if k != "max_output_tokens"},
))  # fmt: skip
def test_live_responses_bodies_are_never_5xx(live, body):
    _post(live, "/v1/responses", body)
