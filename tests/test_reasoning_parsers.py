"""Reasoning parsers on text fixtures: the whole-output split (vLLM's deepseek_r1 / qwen3
readings), and every way of cutting the same text into stream steps gives the same split."""

from __future__ import annotations

import pytest

from kvledger.reasoning.parsers import REASONING_PARSERS

R1, QWEN = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]

# (output text, (reasoning, content)) with the output starting inside the thinking.
FIXTURES = [
    ("Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    ("<think>Let me think.</think>\n\nFour.", ("Let me think.", "\n\nFour.")),
    ("\n<think>\nhmm\n</think>\n", ("\nhmm\n", "\n")),
    ("Still thinking when max_tokens ended", ("Still thinking when max_tokens ended", None)),
    ("</think>Straight to it.", (None, "Straight to it.")),
    ("a < b and </thin is not a tag</think>x</think>y", ("a < b and </thin is not a tag", "x</think>y")),
    ("ends with a partial tag </thi", ("ends with a partial tag </thi", None)),
    ("<thi", ("<thi", None)),
    ("", (None, None)),
    ('I will call it.</think><tool_call>{"name": "f", "arguments": {}}</tool_call>',
     ("I will call it.", '<tool_call>{"name": "f", "arguments": {}}</tool_call>')),
]


@pytest.mark.parametrize("parser", [R1, QWEN], ids=lambda p: p.name)
@pytest.mark.parametrize(("text", "expected"), FIXTURES)
def test_whole_outputs(parser, text, expected):
    assert parser.split(text, True) == expected


@pytest.mark.parametrize(("text", "expected"), FIXTURES)
def test_every_streamed_cut_adds_up_to_the_whole_split(text, expected):
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
        pieces, last = [], 0
        for c in cuts:
            pieces.append(text[last:c])
            last = c
        pieces.append(text[last:])
        sp = R1.splitter(True)
        steps = [sp.step(p) for p in pieces] + [sp.step("", final=True)]
        reasoning = "".join(r for r, _ in steps)
        content = "".join(c for _, c in steps)
        assert (reasoning or None, content or None) == expected, (cuts, steps)


def test_where_the_output_starts():
    thinking_prompt = "User: hi\nAssistant: <think>\n"
    closed_prompt = "User: hi\nAssistant: <think>\n\n</think>\n\n"
    history = "Assistant: <think>x</think>old answer\nUser: more\nAssistant:"
    for p in (R1, QWEN):
        assert p.starts_in_reasoning(thinking_prompt)
        assert not p.starts_in_reasoning(closed_prompt)  # the template closed it: all answer
        assert p.starts_in_reasoning(history)  # an earlier turn's tags do not count
    assert not QWEN.starts_in_reasoning(thinking_prompt, {"enable_thinking": False})
    assert R1.starts_in_reasoning(thinking_prompt, {"enable_thinking": False})  # deepseek_r1 ignores it
    assert QWEN.split("no tags at all", False) == (None, "no tags at all")
    assert QWEN.split("x</think>y", False) == (None, "x</think>y")


def test_the_grammar_starts_after_the_reasoning_end(stories_path):
    """Engine level: with reasoning_end_ids set, the tokens up to and including them are the
    unconstrained greedy ones; the grammar constrains only what follows (vLLM's order)."""
    import json

    import jsonschema

    from kvledger import LLM, SamplingParams
    from kvledger.structured.params import StructuredOutputsParams

    llm = LLM(str(stories_path))
    free = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    ids = list(free[0].outputs[0].token_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    so = StructuredOutputsParams(json=schema)
    so.reasoning_end_ids = tuple(ids[3:5])  # "the thinking ends" after the 5th greedy token
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert list(out.token_ids[:5]) == ids[:5] and out.finish_reason == "stop"
    answer = llm.get_tokenizer().decode(out.token_ids[5:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), schema)
    # Without it the grammar holds from the first token: a different output.
    plain = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60,
                         structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert plain.text.lstrip().startswith("{") and list(plain.token_ids[:5]) != ids[:5]


def test_a_spent_thinking_budget_forces_the_end_ids(stories_path):
    """thinking_token_budget: after that many free tokens the end ids are forced, one a step,
    then the grammar holds (budget 0: the thinking ends at once)."""
    import json

    import jsonschema

    from kvledger import LLM, SamplingParams
    from kvledger.structured.params import StructuredOutputsParams

    llm = LLM(str(stories_path))
    greedy = list(llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip
    end = (7, 11, 13)  # token ids the greedy text does not hold: only forcing writes them
    assert not set(end) & set(greedy)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for budget in (3, 0):
        so = StructuredOutputsParams(json=schema)
        so.reasoning_end_ids, so.thinking_budget = end, budget
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
        ids = list(out.token_ids)
        assert ids[:budget] == greedy[:budget] and tuple(ids[budget : budget + 3]) == end, ids
        answer = llm.get_tokenizer().decode(ids[budget + 3 :], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), schema)
