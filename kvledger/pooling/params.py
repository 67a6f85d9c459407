"""PoolingParams: what a pooling request asks for (vLLM's ``PoolingParams``, plain data).

The engine fills ``pooling_type`` from the model's pooler config when the request is added, so
the runner pools each request as its own parameters say and never reads the model folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import InvalidRequestError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's pooling tasks served here: a vector (embed), a classifier's label probabilities
# (classify), or a cross-encoder's one relevance score for a text pair (score).
POOLING_TASKS = ("embed", "classify", "score")
ACTIVATIONS = ("softmax", "sigmoid", "identity")  # what a classifier's logits go through


@dataclass(slots=True)
class PoolingParams:
    """``dimensions``: Matryoshka truncation (models that support it only); ``normalize``: L2
    normalise the pooled vector (None: the model's pooler config decides); ``use_activation``:
    classify / score through the model's activation (None: yes, vLLM's default)."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    pooling_type: str | None = None  # LAST | MEAN | CLS; None until the engine resolves it
    use_activation: bool | None = None
    activation: str | None = None  # ACTIVATIONS; set by the engine for classify / score

    def verify(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(
                f"pooling task {self.task!r} is not supported; one of {', '.join(POOLING_TASKS)}"
            )
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidRequestError(f"use_activation must be true or false, got {self.use_activation!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}"
            )

    @property
    def needs_all_rows(self) -> bool:
        """Mean and CLS pooling read hidden states of the first prompt rows, which a prefix
        cache hit would skip computing: such requests take no prefix hits (LAST pooling does)."""
        return self.pooling_type in ("MEAN", "CLS")
