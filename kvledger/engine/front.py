"""What the engine fronts share, and what crosses from a front end into an engine: the
per-request output streams, the observer hooks, prompt tokenization, the server's admission
rule, settling futures from other threads.

Two fronts use it: ``AsyncEngine`` (kvledger/engine/async_engine.py: the engine in this process,
stepped by a thread) and ``AsyncCoreEngine`` (kvledger/engine/async_core_engine.py: engine core
processes). This module imports neither the engine nor torch, so a front end that runs no model
(``kvledger serve``'s, over engine core processes) does not load them; ``add_served_request``
runs where the engine is (the engine thread, or the engine core process) and takes the engine
as an argument.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from kvledger.errors import InvalidRequestError
from kvledger.outputs import RequestOutput
from kvledger.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvledger.core.engine import LLMEngine


class EngineObserver(Protocol):
    """Hooks called in the engine thread (metrics); they must be cheap and never raise."""

    def on_request_added(self, num_prompt_tokens: int, engine_index: int = 0) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], engine_index: int = 0) -> None: ...


def tokenize_prompt(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer; send token ids")
    return tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids


def add_served_request(
    eng: LLMEngine,
    request_id: str,
    ids: list[int],
    text: str | None,
    params: SamplingParams,
    arrival: float,
    priority: int,
    cache_salt: str | None = None,
) -> None:
    """Admit a server's request into the engine (the engine thread, or an engine core).

    Unlike the offline API, a request whose prompt plus ``max_tokens`` exceeds the context
    is refused (as OpenAI and vLLM do) instead of being cut short silently.
    """
    eng.validate_prompt(ids)
    max_tokens = getattr(params, "max_tokens", None)  # PoolingParams: none
    if max_tokens is not None and len(ids) + max_tokens > eng.max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {eng.max_model_len} tokens, but "
            f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, "
            f"{max_tokens} for the completion); reduce the prompt or max_tokens"
        )
    eng.add_request(ids, params, request_id, arrival_time=arrival, priority=priority, cache_salt=cache_salt)
    if text is not None:
        eng.groups[request_id].prompt = text


class RequestStream:
    """The outputs of one request, newest first-come: iterate until ``finished``."""

    def __init__(self, owner: StreamingFront, request_id: str, delta: bool = False) -> None:
        self.request_id = request_id
        self.delta = delta  # outputs are deltas: merge them, never drop one
        self.prompt_token_ids: list[int] = []
        self.prompt: str | None = None
        self.finished = False
        self._owner = owner
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    # Called on the event loop by the owner.
    def put(self, out: RequestOutput) -> None:
        if self.delta and self._latest is not None:
            self._latest.add(out, aggregate=True)
        else:
            self._latest = out
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._latest is None:
            self.finished = True
            raise self._error  # type: ignore[misc]
        out, self._latest = self._latest, None
        if out.finished:
            self.finished = True
            self._owner.streams.pop(self.request_id, None)
        return out

    def abort(self) -> None:
        """Stop generating (idempotent); the request's blocks return to the pool at once."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class StreamingFront:
    """What both engine fronts share (``AsyncEngine`` and ``AsyncCoreEngine``): a request's
    updates as an async iterator over its ``RequestStream``, and ending that stream on abort."""

    streams: dict[str, RequestStream]

    async def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> RequestStream:
        raise NotImplementedError

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Every update of one request until it finishes; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort without waiting (each front's own way to reach its engine)."""
        raise NotImplementedError

    def _end_stream(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True


def resolve_threadsafe(loop: asyncio.AbstractEventLoop | None, fut: asyncio.Future | None,
                       result: Any, error: BaseException | None) -> None:
    """Settle ``fut`` (unless already done) on its event loop, from any thread; nothing
    when there is no future or the loop is gone."""
    if fut is None or loop is None or loop.is_closed():
        return

    def set_() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(set_)
    except RuntimeError:  # the loop closed meanwhile
        pass
