"""JSON-valued options (``--kv-events-config``, ``--speculative-config``): one reading of the
text, with the option's name in every error."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from kvledger.errors import ConfigError


def json_object(name: str, value: dict | str) -> dict:
    """``value`` as a dict: a dict as it is, a string parsed as a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def refuse_unknown(name: str, value: dict, cls: Any, also_known: tuple[str, ...] = ()) -> None:
    """A ConfigError naming the keys of ``value`` that are not fields of dataclass ``cls``."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known - set(also_known))
    if unknown:
        raise ConfigError(
            f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known | set(also_known)))}"
        )
