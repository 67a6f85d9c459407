"""Chat helpers that the offline API (``LLM.chat``) and the HTTP server (``/v1/chat/
completions``) share, as vLLM's ``entrypoints/chat_utils.py``: a conversation through the
tokenizer's chat template. Neither side's module imports the other's; both import this.
"""

from __future__ import annotations

import json
from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History for a chat template: assistant tool_calls' JSON arguments become dicts (what
    HF templates iterate over), as vLLM does."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                c["function"] = fn
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def apply_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    **kwargs: Any,
) -> str:
    """The conversation rendered as prompt text by ``chat_template`` (tool-call arguments as
    dicts, ``template_messages``); the template's own errors propagate to the caller, whose
    message they are."""
    return tokenizer.apply_chat_template(
        template_messages(conversation),
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )
