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

from kvledger import envs

logger = logging.getLogger("kvledger")


@dataclass(eq=False)
class GrammarState:
    future: Future  # of the xgrammar CompiledGrammar
    matcher: object | None = None  # xgrammar.GrammarMatcher, made once the grammar is compiled
    # A reasoning model's output: the grammar starts after these token ids (its end-of-thinking
    # tag, ``StructuredOutputsParams.reasoning_end_ids``), as vLLM's structured outputs wait
    # for the reasoning parser's end; until then the row is unconstrained.
    reasoning_end: tuple[int, ...] = ()
    in_reasoning: bool = False
    _tail: tuple[int, ...] = ()  # the last tokens, while in reasoning
    # thinking_token_budget: thinking tokens allowed before the end ids are forced, one a step
    budget: int | None = None
    _thought: int = 0
    _forced: int = -1  # the position in reasoning_end being forced; -1: not forcing

    def __post_init__(self) -> None:
        if self.in_reasoning and self.budget == 0:
            self._forced = 0

    @property
    def forced_token(self) -> int | None:
        """The one token this step may take (the budget is spent), or None."""
        return self.reasoning_end[self._forced] if self.in_reasoning and self._forced >= 0 else None

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
        matcher = self.matcher.fork() if self.matcher is not None else None
        other = GrammarState(self.future, matcher, self.reasoning_end, self.in_reasoning, self._tail, self.budget)
        other._thought, other._forced = self._thought, self._forced
        return other

    def accept(self, token: int) -> bool:
        """Advance on an accepted token; True when the grammar has reached its end."""
        if self.in_reasoning:  # the grammar has not started: watch for the end of the thinking
            if self._forced >= 0:  # the budget is spent: this was the next forced end token
                self._forced += 1
                if self._forced == len(self.reasoning_end):
                    self.in_reasoning, self._forced = False, -1
                return False
            self._thought += 1
            self._tail = (*self._tail, token)[-len(self.reasoning_end) :]
            if self._tail == self.reasoning_end:
                self.in_reasoning = False
            elif self.budget is not None and self._thought >= self.budget:
                self._forced = 0
            return False
        m = self.matcher
        if not m.accept_token(token):
            # Only a token the mask allowed can be sampled; this would be a bug, not bad input.
            logger.error("grammar rejected sampled token %d; ending the request", token)
            return True
        return m.is_terminated()


# KVLEDGER_MASK_THREADS=n: at most n threads for the step's grammar-mask work (the batched
# fill and the greedy rows' fused masked argmax); default 1, all on the calling thread.
MASK_THREADS_ENV = "KVLEDGER_MASK_THREADS"
# xgrammar's batched fill starts its threads at each call (tens of us): worth it only when each
# thread gets a few rows of ~20-40 us.
MIN_ROWS_PER_THREAD = 4


def mask_threads() -> int:
    """Threads for the step's mask work: KVLEDGER_MASK_THREADS, else 1.

    One by default: measured end to end on 2 cores with 2 torch threads (batch 16, 32k vocab),
    the 2-thread mask work made constrained decoding 15-19 % slower than unconstrained, the
    serial one 2-4 % (xgrammar's batched fill starts new threads on every call, and each
    OpenMP region waits for its slowest thread); more threads may pay on larger machines."""
    return envs.KVLEDGER_MASK_THREADS  # a ConfigError naming it when it is not a positive integer


class MaskBuffer:
    """The step's packed bitmask, filled into a buffer kept across steps.

    xgrammar rows are filled in one call of xgrammar's BatchGrammarMatcher, which splits them
    over up to ``threads`` C++ threads (``mask_threads()``: one unless told otherwise);
    llguidance rows keep their own per-row fill. Both write only their own rows
    of the same buffer, so the mask does not depend on the thread count or the mix.

    Not in a helper thread overlapping the forward pass: xgrammar 0.2.9's fills hold the GIL
    (measured: a Python loop beside a filling thread slows by the whole fill time), so a helper
    only adds GIL hand-offs (up to the 5 ms switch interval each) to the step.
    """

    def __init__(self, threads: int | None = None) -> None:
        mask_threads()  # a bad KVLEDGER_MASK_THREADS fails at start-up, not in a step
        self._buf: torch.Tensor | None = None
        self.threads = threads  # None: mask_threads() at each fill
        self._batch: dict[int, object] = {}  # thread count -> xgrammar.BatchGrammarMatcher

    def fill_threads(self, num_rows: int) -> int:
        """Threads for a batched fill of ``num_rows`` xgrammar rows."""
        want = self.threads if self.threads is not None else mask_threads()
        return max(1, min(want, num_rows // MIN_ROWS_PER_THREAD))

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
        xrows, xmatchers = [], []
        for i in rows:
            forced = states[i].forced_token
            if forced is not None:  # a spent thinking budget: only the next end token
                mask[i].zero_()
                bit = forced & 31
                mask[i, forced >> 5] = (1 << bit) if bit < 31 else -(1 << 31)
                continue
            m = states[i].matcher
            if isinstance(m, xgr.GrammarMatcher):
                xrows.append(i)
                xmatchers.append(m)
            else:  # llguidance
                m.fill_next_token_bitmask(mask, i)
        if len(xrows) == 1:
            xmatchers[0].fill_next_token_bitmask(mask, xrows[0])
        elif xrows:
            n = self.fill_threads(len(xrows))
            batch = self._batch.get(n)
            if batch is None:
                batch = self._batch[n] = xgr.BatchGrammarMatcher(max_threads=n)
            batch.batch_fill_next_token_bitmask(xmatchers, mask, xrows)
        return mask, rows


def fill_bitmask(states: list[GrammarState | None], vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """One packed bitmask [rows, ceil(vocab/32)] int32 for ``states``, and its constrained rows
    (rows without a grammar are not listed: the application leaves them unmasked). One row at
    a time on the calling thread: the reference MaskBuffer.fill's batched fill must equal."""
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
