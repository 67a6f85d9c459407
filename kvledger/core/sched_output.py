"""What one scheduler step hands to the runner(s): plain data, the same message for every rank.

vLLM v1's shape: a request's prompt ids and sampling parameters cross once
(``NewRequestData``), then each step carries the batch (ids, new tokens per request, tokens
already computed), the tokens appended since the runner last saw each request, block-table
deltas, block copies, and the ids of requests that finished. Lists, ints and dataclasses only
(no ``Request``, no tensors), so the in-process worker and every tensor-parallel rank consume
the very same object, and a rank in another process needs nothing else to run the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.cache.kv_tier_messages import TierLoad, TierStore
from kvledger.cache.table_delta import TableDeltas
from kvledger.pooling.params import PoolingParams
from kvledger.sampling_params import SamplingParams
from kvledger.structured.bitmask import GrammarBitmask


@dataclass(slots=True)
class NewRequestData:
    """Sent once, at a request's first step: what the runner keeps about it until it finishes.
    ``children``: an n > 1 request's other sequences (id, index), sampled from its last prompt
    row at its first sample and forked afterwards; the runner knows them from here on."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    index: int = 0  # n > 1: this sequence's index (seeds its generator)
    children: list[tuple[str, int]] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled


@dataclass
class SchedulerOutput:
    step: int
    # The batch, in order: each request's id, its new tokens this step, and how many of its
    # tokens were computed before them.
    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # What the runner learns of the requests: new ones (once), and the tokens each request
    # gained since the runner last saw it (the engine's accepted tokens; absent: none).
    new_reqs: list[NewRequestData] = field(default_factory=list)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests that finished since the last step (the runner drops what it keeps of them).
    finished_req_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # COW (src, dst)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # The tiered prefix cache (kvledger.cache.kv_tiers): evicted blocks to copy out before
    # this step writes them, tier blocks to load into fresh blocks, disk files to delete.
    kv_stores: list[TierStore] = field(default_factory=list)
    kv_loads: list[TierLoad] = field(default_factory=list)
    kv_deletes: list[int] = field(default_factory=list)
    # Block-table changes since the previous step's output (the runner's only view of them).
    table_deltas: TableDeltas = field(default_factory=TableDeltas)
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: each speculating request's draft tokens. Its scheduled tokens are
    # 1 + len(drafts): the last accepted token and the drafts, verified in one forward.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Those whose drafts are a token tree: each draft's parent (kvledger.spec_decode.tree).
    spec_tree_parents: dict[str, list[int]] = field(default_factory=dict)
    # The scheduler's decisions, for the engine and the simulator (ids only).
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request id, mode)
    admitted: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # finished by the scheduler itself

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def has_block_ops(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids and not self.ended

    def batch(self) -> zip:
        """(request id, new tokens, computed tokens) of each scheduled request, in order."""
        return zip(self.req_ids, self.num_scheduled_tokens, self.num_computed_tokens, strict=True)
