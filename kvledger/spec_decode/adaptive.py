"""Per-request adaptive speculation: stop proposing when drafts stop paying, probe later.

A draft that misses still costs its verification rows, so a request whose proposals keep
being rejected should stop making them. Each request keeps a slow moving average of the drafts
it gets accepted per verification; below ``MIN_ACCEPTED`` it pauses for ``backoff`` steps,
then probes with a few proposals: hits lift the average back, misses pause it again for twice
as long (up to ``MAX_BACKOFF``). Steps without a proposal (no n-gram match) cost
nothing and do not count.

Why accepted tokens and a slow average: on stories260k greedy continuations (replayed through
the proposer, 10 prompts x 300 tokens, k = 8, n-grams 1-3) hits come in bursts after runs of
misses; pausing after 3 misses in a row, or on a fast average, cut the tokens per step from
1.79 to 1.44-1.61, this average (weight 0.1, line 0.3) to 1.74. A request whose drafts never
hit pauses after 3 verifications (0.4 x 0.9^3 < 0.3), then probes twice after each pause:
13 verifications in 256 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA_WEIGHT = 0.1  # the newest verification's weight in the average
FIRST_AVERAGE = 0.4  # accepted drafts per verification assumed at the start
# Pause below this many accepted drafts per verification: about what the k extra rows of a
# verification cost in steps (measured on stories260k, 1-16 streams: a verification of 1 + 8
# rows per request cost 1.15-1.4 decode steps; docs/benchmarks.md, "Speculative decoding").
MIN_ACCEPTED = 0.3
PROBE_MARGIN = 0.05
# A draft model's proposal costs k forwards of the draft besides the verification: the line is
# raised by this many decode steps per drafted token (stories260k, 2-core EPYC: a forward of the
# target itself in int8, or of 3 of its 5 layers, cost 0.5-0.7 of a whole decode step, most of
# it per-call overhead; docs/benchmarks.md, "Speculative decoding").
DRAFT_FORWARD_COST = 0.5
FIRST_BACKOFF = 4
MAX_BACKOFF = 256


@dataclass(slots=True)
class AcceptanceGate:
    average: float = FIRST_AVERAGE  # moving average of accepted drafts per verification
    pause: int = 0  # steps left without proposing
    backoff: int = FIRST_BACKOFF
    min_accepted: float = MIN_ACCEPTED  # the line (raised for a draft model: ``for_draft_model``)

    @classmethod
    def for_draft_model(cls, k: int) -> AcceptanceGate:
        """A gate whose line includes the k draft forwards a proposal costs."""
        line = MIN_ACCEPTED + DRAFT_FORWARD_COST * k
        return cls(average=line + 2 * PROBE_MARGIN, min_accepted=line)

    def allow(self) -> bool:
        """Whether the request may propose this step (counts a paused step down)."""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A verified draft: update the average; pause when it falls too low."""
        self.average += EMA_WEIGHT * (num_accepted - self.average)
        if self.average < self.min_accepted:
            self.pause = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            # The probe gets two drafts (0.35 x 0.9^2 < 0.3): hits come in bursts, and a single
            # missed probe of a request that does hit would double its pause.
            self.average = self.min_accepted + PROBE_MARGIN
        elif num_accepted:
            self.backoff = FIRST_BACKOFF
