"""A constrained request's grammar state, and the step's packed token bitmask.

The matcher lives on the Request, so it survives preemption untouched: a swapped or
recomputed request resumes with the tokens it has accepted, and the matcher only ever sees
accepted (appended) tokens. n > 1 children fork the parent's matcher before any token.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger("kvledger")


@dataclass(eq=False)
class GrammarState:
    future: Future  # of the xgrammar CompiledGrammar
    matcher: object | None = None  # xgrammar.GrammarMatcher, made once the grammar is compiled

    @property
    def ready(self) -> bool:
        return self.future.done()

    def start(self) -> None:
        """Make the matcher (the future must be done; raises the compile error, if any)."""
        import xgrammar as xgr

        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.future.result())

    def fork(self) -> GrammarState:
        """A copy for an n > 1 child, in the same state as this one."""
        return GrammarState(self.future, self.matcher.fork() if self.matcher is not None else None)

    def accept(self, token: int) -> bool:
        """Advance on an accepted token; True when the grammar has reached its end."""
        m = self.matcher
        if not m.accept_token(token):
            # Only a token the mask allowed can be sampled; this would be a bug, not bad input.
            logger.error("grammar rejected sampled token %d; ending the request", token)
            return True
        return m.is_terminated()


class MaskFiller:
    """Fills the step's bitmask in a helper thread while the model's forward pass runs.

    The matchers' states for a step are final once the previous step's tokens are accepted,
    so the mask (xgrammar releases the GIL while filling) overlaps the forward pass instead
    of adding to the step; the sampler waits for it only when the logits are ready.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, owners: list) -> Future | None:
        states = [r.grammar for r in owners]
        if all(s is None for s in states):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvledger-mask")
        vocab = next(s for s in states if s is not None).future.result().tokenizer_info.vocab_size
        return self._pool.submit(fill_bitmask, states, vocab)


def fill_bitmask(states: list[GrammarState | None], vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """One packed bitmask [rows, ceil(vocab/32)] int32 for the step, and its constrained rows.

    Row i is filled by ``states[i]``'s matcher; rows without a grammar are not listed (the
    application leaves them unmasked). None when no row is constrained.
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(states), vocab_size)
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(mask, i)
    return mask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: tuple[torch.Tensor, list[int]]) -> None:
    """Disallowed tokens' logits -> -inf, in place, for the constrained rows only."""
    import xgrammar as xgr

    mask, rows = bitmask
    xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)
