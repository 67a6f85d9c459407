"""What the runner keeps about each request: built from the step messages alone.

A request's prompt and parameters arrive once (``NewRequestData``); every later step adds the
tokens the engine accepted since (``SchedulerOutput.new_token_ids``), and the request is
dropped when its id is in ``finished_req_ids``. The runner never sees the scheduler's
``Request``: this copy is all it reads (token ids for inputs, prompt logprobs and sink keys;
sampling parameters, the seeded generator and the penalties' state for sampling), so a
tensor-parallel rank in another process holds exactly the same state as the local runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvledger.core.sched_output import NewRequestData, SchedulerOutput
from kvledger.sampling_params import SamplingParams


@dataclass(eq=False, slots=True)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None = None  # seeded sampling: the request's own draws
    bad_words_token_ids: list[list[int]] | None = None
    # n > 1: the children sampled with this request at its first sample (ids), then forked.
    children: list[str] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    sampling_state: object | None = None  # sample.logits_processor.SamplingState
    pooling_params: object | None = None  # kvledger.pooling.params.PoolingParams: pooled, not sampled

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy (the penalties and bad words read it for the rows that need them)."""
        return self.all_token_ids[len(self.prompt_token_ids) :]


def _generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """A seeded request's generator; an n > 1 sequence i draws from seed + 1,000,003 i."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed + 1_000_003 * index)


class RequestStates(dict[str, CachedRequestState]):
    """Request id -> its state, updated from each step's message before the step runs."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.eos_token_ids = tuple(eos_token_ids)

    def update(self, so: SchedulerOutput) -> None:  # type: ignore[override]
        """Drop the finished (and a finished parent's unforked children), add the new, then
        append the tokens each request gained."""
        for rid in so.finished_req_ids:
            st = self.pop(rid, None)
            if st is not None:
                for child in st.children:
                    self.pop(child, None)
        for new in so.new_reqs:
            self._add(new)
        for rid, tokens in so.new_token_ids.items():
            self[rid].all_token_ids.extend(tokens)

    def _add(self, new: NewRequestData) -> None:
        params = new.sampling_params
        st = CachedRequestState(
            new.req_id, new.prompt_token_ids, params, self.eos_token_ids,
            _generator(params, new.index), new.bad_words_token_ids,
            children=[cid for cid, _ in new.children], pooling_params=new.pooling_params,
        )  # fmt: skip
        self[new.req_id] = st
        for cid, index in new.children:
            self[cid] = CachedRequestState(
                cid, new.prompt_token_ids, params, self.eos_token_ids,
                _generator(params, index), new.bad_words_token_ids,
            )  # fmt: skip

    def forked(self, parent: CachedRequestState) -> list[CachedRequestState]:
        """The parent's children, sampled with it once (its first sample), then on their own."""
        children = [self[c] for c in parent.children if c in self]
        parent.children = []
        return children
