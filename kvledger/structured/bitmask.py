"""The step's grammar mask as it travels in the step message (torch-free: the scheduler's
output module imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GrammarBitmask:
    """Structured outputs: one packed row per constrained request due a token this step
    (int32 [rows, ceil(vocab / 32)], xgrammar's layout), filled by the engine."""

    mask: Any  # torch.Tensor
    rows: dict[str, int]  # request id -> row of ``mask`` (a speculating request: its first row,
    # the others follow it, one per draft)
