"""kvledger's version, in a module of its own: the package's modules read it from here, never
from ``kvledger/__init__.py`` (which re-exports ``LLM`` for users, and so the whole engine)."""

__version__ = "0.1.0"
