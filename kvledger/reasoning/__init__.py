"""Reasoning parsers: a reasoning model's thinking (``<think>…</think>``) apart from its answer,
as vLLM's ``--reasoning-parser`` separates them (kvledger/reasoning/parsers.py)."""

from kvledger.reasoning.parsers import REASONING_PARSERS, ReasoningParser, ReasoningSplitter

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplitter"]
