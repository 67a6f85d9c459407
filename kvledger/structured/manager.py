"""The engine's side of structured outputs: requests wait here while their grammar compiles.

A constrained request is held back from the scheduler until its grammar is compiled (the
compile runs in a background thread), then its matcher is made and it enters the scheduler's
waiting queue like any other request; its n > 1 children fork the parent's fresh matcher.
The scheduler, the block manager and the simulator never see a grammar.

It knows a request only through ``ConstrainedRequest`` (what it reads and sets), not the
engine's ``Request`` class: structured outputs sit below the engine core, which uses them.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any, Protocol

from kvledger.errors import InvalidRequestError
from kvledger.structured.backends import resolve_backend
from kvledger.structured.bitmask import GrammarBitmask
from kvledger.structured.compiler import GrammarCompiler
from kvledger.structured.state import GrammarState, MaskBuffer

logger = logging.getLogger("kvledger")


class ConstrainedRequest(Protocol):
    """What the manager reads and sets of a request (kvledger.core.request.Request is one)."""

    sampling_params: Any  # its ``structured_outputs`` is the constraint
    grammar: Any  # set here: a GrammarState
    children: list[Any]  # n > 1: the requests that fork the parent's matcher
    # For the step's bitmask: the request's tokens, its id, its outputs so far.
    request_id: str
    all_token_ids: list[int]
    num_output_tokens: int


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], backend: str = "auto"
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: GrammarCompiler | None = None
        self.compiling: list[ConstrainedRequest] = []  # waiting for their grammar, oldest first
        self.backend = backend  # for params not resolved by the server (vLLM's default: auto)
        self.masks = MaskBuffer()  # the step's packed grammar mask, its buffer kept across steps
        self._constrained = False  # a constrained request was ever submitted

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer")
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    def resolve(self, params: Any) -> None:
        """Choose the params' backend now (InvalidRequestError if none can run them)."""
        resolve_backend(params, self.backend)

    def submit(self, parent: ConstrainedRequest) -> bool:
        """Start compiling ``parent``'s grammar; True when it is ready now (a cache hit)."""
        self._constrained = True
        fut = self.compiler.submit(parent.sampling_params.structured_outputs)
        so = parent.sampling_params.structured_outputs
        ends = tuple(getattr(so, "reasoning_end_ids", None) or ())
        budget = getattr(so, "thinking_budget", None) if ends else None
        parent.grammar = GrammarState(fut, reasoning_end=ends, in_reasoning=bool(ends), budget=budget)
        if fut.done() and fut.exception() is None:
            self._start(parent)
            return True
        self.compiling.append(parent)
        return False

    def take_ready(self) -> tuple[list[ConstrainedRequest], list[tuple[ConstrainedRequest, str]]]:
        """Parents whose grammar is compiled (matchers made), and those whose compile failed."""
        if not self.compiling:
            return [], []
        ready, failed, still = [], [], []
        for req in self.compiling:
            if not req.grammar.ready:
                still.append(req)
            elif req.grammar.future.exception() is not None:
                failed.append((req, str(req.grammar.future.exception())))
            else:
                self._start(req)
                ready.append(req)
        self.compiling = still
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a compile to finish (only when nothing else can run)."""
        if self.compiling:
            wait([r.grammar.future for r in self.compiling], timeout, FIRST_COMPLETED)

    def discard(self, req: ConstrainedRequest) -> None:
        if req in self.compiling:
            self.compiling.remove(req)

    def grammar_bitmask(self, so: Any, requests: dict[str, Any]) -> GrammarBitmask | None:
        """The step's packed mask: a row for each constrained request due a token, in the
        runner's sampling order (a due request, then at an n > 1 request's first sample its
        children, which sample from the same row); None when no such request runs."""
        if not self._constrained:
            return None
        owners: list[Any] = []
        spec = so.spec_token_ids
        for rid, n, computed in so.batch():
            req = requests[rid]
            if spec and rid in spec:
                owners += draft_rows(req, spec[rid])
                continue
            if computed + n != len(req.all_token_ids):
                continue  # a prefill chunk short of the prompt's end: no token this step
            if req.grammar is not None and req.grammar.in_reasoning and req.grammar.forced_token is None:
                continue  # still thinking (its n > 1 children too): the grammar has not started
            owners.append(req)
            if req.children and req.num_output_tokens == 0:
                owners += req.children
        filled = self.masks.fill(owners)
        if filled is None:
            return None
        mask, rows = filled
        first: dict[str, int] = {}
        for i in rows:
            first.setdefault(owners[i].request_id, i)
        return GrammarBitmask(mask, first)

    @staticmethod
    def _start(parent: ConstrainedRequest) -> None:
        parent.grammar.start()
        for child in parent.children:
            child.grammar = parent.grammar.fork()


@dataclass(slots=True)
class _DraftRow:
    """A verification row of a speculating request: the grammar as it stands after the drafts
    before the row."""

    request_id: str
    grammar: GrammarState | None


def draft_rows(req: ConstrainedRequest, drafts: list[int]) -> list[Any]:
    """The 1 + len(drafts) mask rows of a speculating request, consecutive. Each row's mask is
    the grammar after the drafts before it, advanced on copies (the request's matcher only
    ever sees accepted tokens). After a draft the grammar refuses, the rows repeat the last
    state: verification stops at that draft's row (its mask forbids the draft), so later rows'
    tokens are never used."""
    g = req.grammar
    rows: list[Any] = [req]
    for d in drafts:
        if g is not None:
            nxt = g.fork()
            if nxt.matcher.accept_token(d):
                g = nxt
        rows.append(_DraftRow(req.request_id, g))
    return rows
