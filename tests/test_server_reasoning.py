"""--reasoning-parser qwen3 on a real `kvledger serve` (stories260k) with a Qwen3-style chat
template: the prompt opens ``<think>`` (or, with ``enable_thinking: false``, writes an empty
``<think>\\n\\n</think>``). The tiny model never closes its thinking, so a thinking answer is all
reasoning and a grammar (which starts after ``</think>``) never constrains it; with thinking off
the whole output is the answer and the grammar holds from the first token."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.test_server import running_stories

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_stories(tmp_path_factory, "--chat-template", TEMPLATE, "--reasoning-parser", "qwen3") as srv:
        yield srv.client("none")


def _chat(client, stream=False, **kw):
    """(reasoning, reasoning_content, content, finish_reason): the message, or a stream's deltas joined."""
    kw = {"model": client.models.list().data[0].id, "messages": MESSAGES, "temperature": 0, "max_tokens": 20, **kw}
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        extra = c.message.model_extra or {}
        return extra.get("reasoning"), extra.get("reasoning_content"), c.message.content, c.finish_reason
    parts: dict[str, list[str]] = {"reasoning": [], "reasoning_content": [], "content": []}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            for k in parts:
                if d.get(k):
                    parts[k].append(d[k])
            finish = ch.finish_reason or finish
    return (*("".join(parts[k]) or None for k in ("reasoning", "reasoning_content", "content")), finish)


def test_thinking_is_reasoning_streamed_and_not(client):
    model = client.models.list().data[0].id
    raw = client.completions.create(model=model, prompt="Once upon a time\n<think>\n", temperature=0, max_tokens=20)
    whole = _chat(client)
    assert whole == (raw.choices[0].text, raw.choices[0].text, None, "length")
    assert _chat(client, stream=True) == whole
    # include_reasoning false: the thinking is dropped, not turned into content
    assert _chat(client, extra_body={"include_reasoning": False}) == (None, None, None, "length")


def test_thinking_off_is_all_answer(client):
    model = client.models.list().data[0].id
    raw = client.completions.create(model=model, prompt="Once upon a time\n<think>\n\n</think>\n\n", temperature=0,
                                    max_tokens=20)  # fmt: skip
    whole = _chat(client, extra_body=OFF)
    assert whole == (None, None, raw.choices[0].text, "length")
    assert _chat(client, stream=True, extra_body=OFF) == whole


def test_the_grammar_applies_to_the_answer_after_the_thinking(client):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    # Thinking: the model never writes </think> in 20 tokens, so the grammar never starts and the
    # reasoning is the unconstrained greedy text.
    thinking = _chat(client, response_format=rf)
    assert thinking == _chat(client)
    assert _chat(client, stream=True, response_format=rf) == thinking
    # Thinking off: the answer is constrained from its first token.
    reasoning, _, content, finish = _chat(client, response_format=rf, extra_body=OFF, max_tokens=60)
    assert reasoning is None and finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)


def test_responses_and_messages_carry_the_thinking(client):
    import anthropic

    model = client.models.list().data[0].id
    reasoning = _chat(client)[0]
    r = client.responses.create(model=model, input="Once upon a time", temperature=0, max_output_tokens=20)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text == reasoning
    with client.responses.stream(model=model, input="Once upon a time", temperature=0, max_output_tokens=20) as s:
        events = list(s)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning and events[-1].type == "response.incomplete"
    assert [o.type for o in events[-1].response.output] == ["reasoning"]

    claude = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="none", max_retries=0)
    kw = dict(model=model, max_tokens=20, messages=MESSAGES, extra_body={"temperature": 0})
    m = claude.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert [(b.type, b.thinking) for b in m.content] == [("thinking", reasoning)]
    with claude.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", reasoning)]
    hidden = claude.messages.create(**kw)  # thinking not asked for: not shown
    assert [(b.type, b.text) for b in hidden.content] == [("text", "")]


def test_a_thinking_budget_forces_the_model_through_the_tags(client):
    """thinking_token_budget (vLLM's field): after 4 thinking tokens `</think>` is forced, so the
    tiny model, which never closes its thinking, is taken through the tags; the answer after them
    is free, or held to a schema."""
    model = client.models.list().data[0].id
    first4 = client.completions.create(model=model, prompt="Once upon a time\n<think>\n", temperature=0,
                                       max_tokens=4).choices[0].text  # fmt: skip
    free = _chat(client, max_tokens=30, extra_body={"thinking_token_budget": 4})
    reasoning, alias, content, finish = free
    assert reasoning.strip() == first4.strip() and alias == reasoning and content and finish == "length"
    assert _chat(client, stream=True, max_tokens=30, extra_body={"thinking_token_budget": 4}) == free
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    schema_kw = dict(max_tokens=80, response_format=rf, extra_body={"thinking_token_budget": 4})
    reasoning, _, content, finish = _chat(client, **schema_kw)
    assert reasoning.strip() == first4.strip() and finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)
    assert _chat(client, stream=True, **schema_kw) == (reasoning, reasoning, content, finish)
