"""A constrained request's grammar state, and the step's packed token bitmask.

The matcher lives on the Request, so it survives preemption untouched: a swapped or
recomputed request resumes with the tokens it has accepted, and the matcher only ever sees
accepted (appended) tokens. n > 1 children fork the parent's matcher before any token.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
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
        from kvledger.structured.backends import new_matcher

        if self.matcher is None:
            self.matcher = new_matcher(self.future.result())

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


class MaskBuffer:
    """The step's packed bitmask, filled on the main thread into a buffer kept across steps.

    Not in a helper thread overlapping the forward pass: xgrammar 0.2.9's
    fill_next_token_bitmask holds the GIL (measured: a Python loop beside a filling thread
    slows by the whole fill time), so a helper only adds GIL hand-offs (up to the 5 ms switch
    interval each) to the step, while the fill itself is ~20 us per row.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def fill(self, owners: list) -> tuple[torch.Tensor, list[int]] | None:
        """One row per sampled request (``owners``, in sampling order); None: none constrained."""
        states = [r.grammar for r in owners]
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        import xgrammar as xgr

        from kvledger.structured.backends import vocab_size_of

        vocab = vocab_size_of(states[rows[0]].future.result())
        words = (vocab + 31) // 32
        buf = self._buf
        if buf is None or buf.shape[0] < len(states) or buf.shape[1] != words:
            buf = self._buf = xgr.allocate_token_bitmask(max(len(states), 16), vocab)
        mask = buf[: len(states)]
        for i in rows:
            states[i].matcher.fill_next_token_bitmask(mask, i)
        return mask, rows


def fill_bitmask(states: list[GrammarState | None], vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """One packed bitmask [rows, ceil(vocab/32)] int32 for ``states``, and its constrained rows
    (rows without a grammar are not listed: the application leaves them unmasked)."""
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


def disallowed_rows(mask: torch.Tensor, rows: list[int], tokens: torch.Tensor) -> list[int]:
    """Those of ``rows`` whose token (``tokens[row]``) the packed bitmask forbids. A token past
    the mask's width is listed too (masking leaves it as it is, so redoing it changes nothing)."""
    words = mask.numpy()
    width = words.shape[1]
    toks = tokens.tolist()
    return [i for i in rows if (t := toks[i]) >> 5 >= width or not (int(words[i, t >> 5]) >> (t & 31)) & 1]
