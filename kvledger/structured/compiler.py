"""Grammar compilation off the step loop, with a cache keyed by the constraint.

Compiling a grammar against a vocabulary (xgrammar precomputes which tokens each grammar
state accepts) takes milliseconds to seconds: doing it inside ``step()`` would stall every
running request. So it runs in one background thread; the request waits outside the
scheduler until its future is done (the engine checks at each step), and a second request
with the same constraint reuses the compiled grammar. The tokenizer's xgrammar view is built
in the same thread, on first use.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvledger.structured.backends import GuidanceGrammar, guidance_grammar
from kvledger.structured.params import StructuredOutputsParams


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; thread-safe, cached by ``params.key()``."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], max_cached: int = 256
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="kvledger-grammar", initializer=_lower_priority
        )
        self._cache: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._compiler = None  # xgrammar.GrammarCompiler, built in the worker
        self._ll_tokenizer = None  # llguidance.LLTokenizer, built in the worker
        self.num_compiled = 0
        self.num_cache_hits = 0

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (a done one when the constraint is cached), by the
        backend the params were resolved to (xgrammar when not resolved)."""
        key = (params.resolved_backend or "xgrammar", *params.key())
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self.num_cache_hits += 1
                self._cache[key] = self._cache.pop(key)  # most recently used last
                return fut
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > self.max_cached:
                self._cache.pop(next(iter(self._cache)))
            return fut

    def compile_now(self, params: StructuredOutputsParams):
        """Compile in the calling thread (references and tests)."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams):
        if params.resolved_backend == "guidance":
            return self._compile_guidance(params)
        if self._compiler is None:
            self._compiler = self._build()
        self.num_compiled += 1
        return self._compiler.compile_grammar(params.parsed_grammar)

    def _compile_guidance(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        """llguidance computes masks lazily: "compiling" is checking the grammar against the
        tokenizer's llguidance view (built once, in this thread)."""
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids
            )
        self.num_compiled += 1
        compiled = GuidanceGrammar(
            self._ll_tokenizer, guidance_grammar(params), self.vocab_size, frozenset(self.stop_token_ids)
        )
        compiled.new_matcher()  # a grammar llguidance cannot run fails here, not in the step loop
        return compiled

    def _build(self):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=1)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """The compile thread yields the CPU to the step loop when cores are contended."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: same priority
        pass
