"""The embedded default model (stories260K, shipped as package data) and the named models
kvledger knows without a path."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "stories260k"
TINY_MODEL_NAME = "kvledger-tiny"


def embedded_model_path() -> Path:
    """The folder of the shipped stories260K (real weights, MIT; see its README)."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_NAME


def resolve_named_model(model: str | None) -> str:
    """None or 'stories260k' -> the embedded default; 'kvledger-tiny' -> the random-weight test model (built on
    first use); anything else unchanged (a folder or a hub id)."""
    if model is None or (model == DEFAULT_MODEL_NAME and not Path(model).exists()):
        return str(embedded_model_path())  # the name it is served under works as a model too
    if model == TINY_MODEL_NAME:
        from kvledger.model.tiny import default_model_path

        return str(default_model_path())
    return model
