"""The explanations of claims 6-8 in docs/seed_claims.md, with this run's figures filled in."""

from __future__ import annotations

from typing import Any


def section4_text(details: dict[str, Any]) -> list[str]:
    return []
