"""The scheduler's side of speculative decoding: who may propose, how many drafts, and what a
verified step tells the adaptive gate and the counters. Torch-free, beside the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.spec_decode.adaptive import AcceptanceGate
from kvledger.spec_decode.config import SpeculativeConfig
from kvledger.spec_decode.ngram import NgramIndex
from kvledger.spec_decode.stats import SpecDecodingStats
from kvledger.spec_decode.suffix import SuffixCache, SuffixIndex
from kvledger.spec_decode.tree import MAX_TREE_ROWS, is_chain

# Method "draft_model": the scheduler reserves a draft's slots with this placeholder token; the
# runner's drafter (kvledger.worker.drafter) proposes the real tokens in the same step, before
# the target verifies them, and the engine hands them back to the request.
DRAFT_PLACEHOLDER = -1


@dataclass(slots=True)
class SpecState:
    """What a request keeps for speculation (on the Request: it survives preemption)."""

    index: NgramIndex | SuffixIndex | None  # the proposer's per-request part (None: a draft model)
    gate: AcceptanceGate | None


def can_speculate(req: Any) -> bool:
    """Whether a request's drafts can be verified row by row exactly as it would decode.

    Verification samples every draft row from the state before that step; processors whose
    result depends on the tokens just before the row (penalties, bad words, the min_tokens
    EOS ban still in force) would see a stale state, so those requests decode one token at a
    time."""
    p = req.sampling_params
    return not (
        p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or req.bad_words_token_ids
        or req.num_output_tokens < p.min_tokens
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, trees: bool = True) -> None:
        """``trees``: whether the engine's runner verifies token trees (engine/builder.py says;
        without, ``tree_nodes`` is ignored and every proposal is a chain)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.tree_nodes = min(config.tree_nodes, MAX_TREE_ROWS - 1) if trees else 0
        self.stats = SpecDecodingStats(num_spec_tokens=self.k)
        self.drafts_in_runner = config.method == "draft_model"
        self.shared: SuffixCache | None = None  # method "suffix": finished requests' counts
        if config.method == "suffix":
            self.shared = SuffixCache(
                config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
            )

    def enabled_for_batch(self, num_running: int) -> bool:
        """vLLM's ``disable_by_batch_size``: a large batch is compute-bound, drafts don't pay."""
        return num_running <= self.config.disable_by_batch_size

    def propose(
        self, req: Any, max_drafts: int, max_depth: int | None = None
    ) -> tuple[list[int], list[int] | None]:
        """Draft tokens for a decoding request, at most ``max_drafts`` of them and none more
        than ``max_depth`` past the last accepted token (default: ``max_drafts``); ([], None) to
        decode plainly. With the drafts, each one's parent when they form a token tree
        (kvledger.spec_decode.tree), None for a chain."""
        k = min(self.k, max_drafts, max_drafts if max_depth is None else max_depth)
        if k <= 0 or not can_speculate(req):
            return [], None
        if self.drafts_in_runner and req.grammar is not None:
            # A grammar's mask rows are built from the drafts before the step, and a draft
            # model's drafts only exist inside it: such requests decode one token at a time.
            return [], None
        st = req.spec_state
        if st is None:
            st = req.spec_state = self._new_state()
        if st.gate is not None and not st.gate.allow():
            return [], None
        if st.index is None:  # the draft model proposes in the runner
            return [DRAFT_PLACEHOLDER] * k, None
        if self.tree_nodes > 1 and req.grammar is None and max_drafts > 1:
            # (A grammar's mask rows are built along one chain of drafts: structured/manager.py.)
            drafts, parents = st.index.propose_tree(
                req.all_token_ids, min(self.tree_nodes, max_drafts), k
            )
            return drafts, (None if is_chain(parents) else parents)
        return st.index.propose(req.all_token_ids, k), None

    def _new_state(self) -> SpecState:
        c = self.config
        gate = AcceptanceGate() if c.adaptive else None
        if self.shared is not None:
            index = SuffixIndex(
                self.shared, c.suffix_decoding_min_token_prob, c.suffix_decoding_max_spec_factor
            )
            return SpecState(index, gate)
        if self.drafts_in_runner:
            return SpecState(None, AcceptanceGate.for_draft_model(self.k) if c.adaptive else None)
        return SpecState(NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max), gate)

    def on_finished(self, req: Any, num_running: int) -> None:
        """A request that ran to its end (not aborted): suffix decoding remembers its output
        (after the prompt's last tokens, as context; a new request's own prompt is in its own
        counts, as Arctic keeps a tree per prompt and one over responses). Not while the batch
        is over ``disable_by_batch_size``: then no request speculates, and counting a finished
        output (~6 us a token at depth 8) would only slow the large batch down."""
        if (
            self.shared is None
            or not req.num_output_tokens
            or not self.enabled_for_batch(num_running)
        ):
            return
        start = max(0, req.num_prompt_tokens - self.shared.depth)
        self.shared.add(req.all_token_ids[start:])

    def observe(self, req: Any, num_drafts: int, num_accepted: int) -> None:
        """A request's drafts were verified: count them, and feed its gate."""
        self.stats.observe(num_drafts, num_accepted)
        gate = req.spec_state.gate if req.spec_state is not None else None
        if gate is not None:
            gate.record(num_drafts, num_accepted)
