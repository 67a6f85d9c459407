"""The model's pooler: how a folder says to pool (sentence-transformers files), or vLLM's default.

A sentence-transformers folder has ``modules.json`` naming its modules; its Pooling module's
``config.json`` (usually ``1_Pooling/config.json``) sets the mode (``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``) and a ``Normalize`` module turns on
L2 normalisation. Without one, vLLM's default for a decoder model applies: the last token's
final hidden state (after the final norm), normalised. Matryoshka support (``dimensions``) is
read from config.json's ``is_matryoshka`` / ``matryoshka_dimensions``, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.hf.config import model_head
from kvledger.pooling.classifier import ClassifierInfo, load_classifier
from kvledger.pooling.params import POOLING_TYPES, PoolingParams

_ST_MODES = {  # sentence-transformers' Pooling flags -> vLLM's pooling types
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_NORMALIZE = "sentence_transformers.models.Normalize"
_POOLING = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class PoolerConfig:
    """The served model's pooling (vLLM's ``PoolerConfig``); ``source`` says where it came from."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "vLLM's default for decoder models"
    classifier: ClassifierInfo | None = None  # a *ForSequenceClassification model's head

    @property
    def tasks(self) -> tuple[str, ...]:
        """vLLM's supported pooling tasks: a classifier classifies and scores pairs (one label);
        other models embed (their ``score`` is the cosine of two embeddings, by the front ends)."""
        return ("classify", "score") if self.classifier is not None else ("embed",)

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's parameters with the model's defaults filled in, or an error naming
        what this model cannot do."""
        params.verify()
        if params.task not in self.tasks:
            raise InvalidRequestError(
                f"pooling task {params.task!r} is not supported by this model; it supports "
                f"{', '.join(self.tasks)}"
            )
        if self.classifier is not None:
            return self._resolve_classify(params)
        if params.dimensions is not None:
            if not self.is_matryoshka:
                raise InvalidRequestError(
                    "dimensions is not supported by this model: it is not a Matryoshka model "
                    "(config.json has no is_matryoshka / matryoshka_dimensions)"
                )
            allowed = self.matryoshka_dimensions
            if allowed is not None and params.dimensions not in allowed:
                raise InvalidRequestError(
                    f"dimensions {params.dimensions} is not one of this model's Matryoshka "
                    f"dimensions {list(allowed)}"
                )
            if params.dimensions > self.hidden_size:
                raise InvalidRequestError(
                    f"dimensions {params.dimensions} is more than the model's hidden size {self.hidden_size}"
                )
        return PoolingParams(
            dimensions=params.dimensions,
            normalize=self.normalize if params.normalize is None else params.normalize,
            task=params.task,
            pooling_type=params.pooling_type or self.pooling_type,
        )

    def _resolve_classify(self, params: PoolingParams) -> PoolingParams:
        head = self.classifier
        assert head is not None
        if params.dimensions is not None:
            raise InvalidRequestError("dimensions is for embeddings; this model classifies")
        if params.task == "score" and head.num_labels != 1:
            raise InvalidRequestError(
                f"score needs a cross-encoder with one label; this model has {head.num_labels} "
                "(num_labels in config.json): use classify"
            )
        act = head.score_activation if params.task == "score" else head.classify_activation
        return PoolingParams(
            task=params.task,
            pooling_type=params.pooling_type or self.pooling_type,
            use_activation=params.use_activation,
            activation=act if params.use_activation is not False else "identity",
            normalize=False,
        )


def load_pooler_config(model_dir: str, hf_config: dict, override: dict | None = None) -> PoolerConfig:
    """The folder's pooler (sentence-transformers files), else vLLM's default; ``override``:
    vLLM's ``--pooler-config`` keys ``pooling_type`` and ``normalize``, which win."""
    folder = Path(model_dir)
    kind, normalize, source = "LAST", True, "vLLM's default for decoder models"
    st = _read_sentence_transformers(folder)
    if st is not None:
        kind, normalize = st
        source = f"{folder / 'modules.json'}"
    override = dict(override or {})
    unknown = set(override) - {"pooling_type", "normalize"}
    if unknown:
        raise ConfigError(f"pooler_config: unknown key(s) {sorted(unknown)}; known: pooling_type, normalize")
    if "pooling_type" in override:
        kind = str(override["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ConfigError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}; got {kind!r}")
        source = "pooler_config"
    if "normalize" in override:
        normalize = bool(override["normalize"])
    dims = hf_config.get("matryoshka_dimensions")
    classifier = load_classifier(hf_config) if model_head(hf_config) == "classify" else None
    return PoolerConfig(
        pooling_type=kind,
        normalize=normalize,
        hidden_size=int(hf_config.get("hidden_size", 0)),
        is_matryoshka=bool(hf_config.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        source=source,
        classifier=classifier,
    )


def _read_sentence_transformers(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json and its Pooling module, or None."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{modules_file}: not readable JSON ({e})") from None
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _POOLING), None)
    if pooling is None:
        return None
    cfg_file = folder / pooling.get("path", "1_Pooling") / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_file}: the Pooling module's config is not readable ({e})") from None
    modes = [kind for flag, kind in _ST_MODES.items() if cfg.get(flag)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(modes) != 1:
        raise ConfigError(
            f"{cfg_file}: pooling {sorted(others) or modes or 'none'} is not supported; "
            "exactly one of pooling_mode_lasttoken, pooling_mode_mean_tokens, pooling_mode_cls_token"
        )
    return modes[0], _NORMALIZE in types
