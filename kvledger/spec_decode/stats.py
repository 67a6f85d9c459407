"""Speculation counters (vLLM's ``SpecDecodingStats`` names), kept by the scheduler and read by
``/metrics`` (``vllm:spec_decode_*``) and the live ledger."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int = 0  # the configured k (length of the per-position counts)
    num_drafts: int = 0  # proposals verified
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # The ledger: token slots the last step reserved for drafts, and the blocks (with the
    # running total) that rollbacks released in the step that rejected their tokens.
    last_step_draft_slots: int = 0
    last_step_released_blocks: int = 0
    released_blocks: int = 0

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def ledger_row(self, bytes_per_token: int, bytes_per_block: int) -> dict:
        """The live ledger's speculation entry (``/v1/ledger``)."""
        return {
            "num_speculative_tokens": self.num_spec_tokens,
            "last_step_draft_slots": self.last_step_draft_slots,
            "last_step_draft_bytes": self.last_step_draft_slots * bytes_per_token,
            "last_step_released_blocks": self.last_step_released_blocks,
            "released_blocks": self.released_blocks,
            "released_bytes": self.released_blocks * bytes_per_block,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1
