"""The runner's pooler: hidden rows of a pooling request's prefill chunks -> one vector.

A pooling request is prefill only, and chunked prefill may split its prompt over steps, so
what a pool needs is kept between them, per request: LAST needs only the final chunk's last
row; MEAN a running float32 sum over every chunk's rows; CLS the first chunk's first row. A
chunk starting at position 0 (a first admission, or a recompute after preemption) starts the
request afresh. The vector is then cut to ``dimensions`` (Matryoshka) and L2-normalised, or,
for classify / score, goes through the model's ``score`` head and its activation; it leaves as a
list of floats (plain data, like the sampled tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from kvledger.pooling.params import PoolingParams


class PoolingAccumulator:
    """Partial pools of requests whose prompts are still being computed (request id -> row)."""

    def __init__(self) -> None:
        self.partial: dict[str, torch.Tensor] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        """Finished or aborted requests leave nothing behind."""
        for rid in request_ids:
            self.partial.pop(rid, None)

    def pool_step(
        self,
        hidden: torch.Tensor,
        batch: Sequence[tuple[str, PoolingParams, int, int, int, int]],
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, list[float]]:
        """``batch``: (request id, params, first flat row, rows this step, rows computed
        before, prompt length) of each pooling request in the step; it is done when its last
        prompt row is among them. ``head``: a classifier's ``score``. Returns the finished
        requests' vectors."""
        done: dict[str, list[float]] = {}
        for rid, params, first, count, start, prompt_len in batch:
            rows = hidden[first : first + count]
            if start == 0:
                self.partial.pop(rid, None)
            kind = params.pooling_type
            if kind == "MEAN":
                acc = rows.float().sum(dim=0)
                prev = self.partial.get(rid)
                self.partial[rid] = acc if prev is None else prev + acc
            elif kind == "CLS" and start == 0:
                self.partial[rid] = rows[0].float()
            if start + count < prompt_len:
                continue
            if kind == "LAST":
                vec = rows[-1].float()
            elif kind == "MEAN":
                vec = self.partial.pop(rid) / prompt_len
            else:
                vec = self.partial.pop(rid)
            done[rid] = finish_vector(vec, params, head)
        return done


def finish_vector(
    vec: torch.Tensor, params: PoolingParams, head: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[float]:
    """Matryoshka truncation, then normalisation (vLLM's order: truncate, then normalise); a
    classifier's logits through its activation."""
    if params.task != "embed":
        assert head is not None, "classify / score on a model without a score head"
        logits = head(vec.to(head.weight.dtype)).float()  # type: ignore[attr-defined]
        if params.activation == "softmax":
            logits = logits.softmax(dim=-1)
        elif params.activation == "sigmoid":
            logits = logits.sigmoid()
        return logits.cpu().tolist()
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = F.normalize(vec, p=2, dim=-1)
    return vec.cpu().tolist()
