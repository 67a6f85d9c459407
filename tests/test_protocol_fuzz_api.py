"""Property-based fuzz of the Anthropic Messages and Responses API request models and their
translation into a chat request: any JSON body either becomes a chat request with sampling
params and a conversation, or fails with a client error (pydantic's ValidationError or a
KVLedgerError, both 400s in the server), never another exception (a 500)."""

from __future__ import annotations

from hypothesis import given
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
