"""``<think>…</think>`` reasoning parsers (vLLM's ``deepseek_r1`` and ``qwen3``), on text.

The chat templates of these models open the thinking in the prompt (``<think>\\n``), so the
output usually holds only the end tag; older templates let the model write ``<think>`` itself,
which is dropped. Text before ``</think>`` is reasoning, text after it the answer; an output
that never closes its thinking is all reasoning (cut by max_tokens), as vLLM reads it. A prompt
that ends by closing the thinking (Qwen3's template with ``enable_thinking: false`` writes
``<think>\\n\\n</think>\\n\\n``) makes the whole output the answer; ``qwen3`` also takes
``enable_thinking: false`` itself to mean that, as vLLM's parser does.

One splitter serves streamed and whole outputs alike (the whole text is one final step), so a
stream's reasoning and content deltas always add up to the non-streamed split: it holds back
text that may be the start of a tag until the next step tells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's output, step by step, into (reasoning delta, content delta)."""

    def __init__(self, start: str, end: str, in_reasoning: bool) -> None:
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._at_start = in_reasoning  # the model may still write its own start tag
        self._held = ""

    def step(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content this text completes; ``final`` releases what was held."""
        if not self.in_reasoning:
            return "", text
        buf, self._held = self._held + text, ""
        if self._at_start:
            stripped = buf.lstrip()
            if stripped.startswith(self.start):
                buf, self._at_start = stripped[len(self.start) :], False
            elif self.start.startswith(stripped) and not final:
                self._held = buf  # whitespace or a partial start tag: wait
                return "", ""
            else:
                self._at_start = False
        i = buf.find(self.end)
        if i >= 0:
            self.in_reasoning = False
            return buf[:i], buf[i + len(self.end) :]
        k = 0 if final else _held_suffix(buf, self.end)
        self._held = buf[len(buf) - k :] if k else ""
        return buf[: len(buf) - k], ""


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    honours_enable_thinking: bool = False  # qwen3: enable_thinking false -> no reasoning

    def starts_in_reasoning(self, prompt: str, chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        """Whether the output begins inside the thinking: not when the request turned thinking
        off (qwen3) or the prompt ends by closing it (an empty ``<think></think>`` the template
        wrote; earlier turns' tags do not count)."""
        if self.honours_enable_thinking and (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return False
        return not prompt.rstrip().endswith(self.end)

    def splitter(self, in_reasoning: bool) -> ReasoningSplitter:
        return ReasoningSplitter(self.start, self.end, in_reasoning)

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part, as vLLM answers."""
        reasoning, content = self.splitter(in_reasoning).step(text, final=True)
        return reasoning or None, content or None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1"),
    "qwen3": ReasoningParser("qwen3", honours_enable_thinking=True),
}
