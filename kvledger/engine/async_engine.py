"""asyncio front end over LLMEngine: requests arrive and leave between steps.

A step is blocking torch compute, so one background thread owns the engine: it applies the
calls queued by the event loop (add, abort, reads) and runs ``step()`` while work remains,
all under one lock, since the engine is not thread-safe. Outputs go back to per-request
streams through ``loop.call_soon_threadsafe``. A stream holds one pending output however far
behind its reader falls: a cumulative output replaces the pending one (the reader skips
states), a delta output (``RequestOutputKind.DELTA``) is merged into it, so nothing is lost
and the reader gets everything new since its last read in one piece (the streams, and what
this front shares with ``AsyncCoreEngine``, are in kvledger/engine/front.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvledger.core.engine import LLMEngine
from kvledger.engine.engine_info import EngineInfo, run_query
from kvledger.engine.front import (
    EngineObserver,
    RequestStream,
    StreamingFront,
    add_served_request,
    resolve_threadsafe,
    tokenize_prompt,
)
from kvledger.errors import EngineDeadError, InvalidRequestError
from kvledger.outputs import RequestOutput
from kvledger.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kvledger")

T = TypeVar("T")


class AsyncEngine(StreamingFront):
    """The engine in this process, stepped by a background thread.

    ``AsyncCoreEngine`` (kvledger/engine/async_core_engine.py) has the same API over engine
    core processes; the server uses either through ``info``, ``tokenizer``, ``add_request``,
    ``abort``, ``query`` and ``is_running``.
    """

    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        engine.stream_outputs = True
        self.info = EngineInfo.from_engine(engine)
        self.tokenizer = engine.tokenizer
        self.observer = observer
        self._lock = threading.Lock()  # held around every engine call
        self._cond = threading.Condition()  # guards _ops and wakes the engine thread
        self._ops: list[tuple[Callable[[], Any], asyncio.Future | None]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, RequestStream] = {}
        self.dead: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvledger-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step, abort everything, end every stream."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            for rid in list(self.engine.groups):
                self.engine.abort_request(rid)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self.engine.shutdown()  # closes the KV-event sockets

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # -- requests -------------------------------------------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Tokenize, validate and queue a request; raises InvalidRequestError before queueing
        (``add_served_request``)."""
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic()
        stream = RequestStream(self, request_id, getattr(params, "output_kind", None) is RequestOutputKind.DELTA)
        self.streams[request_id] = stream

        def add() -> list[int]:
            eng = self.engine
            if isinstance(prompt, str):
                ids = tokenize_prompt(eng.tokenizer, prompt, add_special_tokens)
                text: str | None = prompt
            else:
                ids, text = list(prompt), None
            add_served_request(eng, request_id, ids, text, params, arrival, priority, cache_salt)
            if self.observer is not None:
                self.observer.on_request_added(len(ids))
            return ids

        try:
            stream.prompt_token_ids = await self._call(add)
        except BaseException:
            self.abort(request_id)  # queued after the add: a no-op unless the caller went away
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort without waiting: the engine drops it before its next step."""
        self._end_stream(request_id)

        def abort() -> None:
            eng = self.engine
            group = eng.groups.get(request_id)
            if group is None:
                return
            eng.abort_request(request_id)
            if self.observer is not None:
                self.observer.on_outputs([eng.make_output(group)])

        self._submit(abort, None)

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the engine thread between steps: a consistent read."""
        return await self._call(lambda: fn(self.engine))

    async def query(self, name: str, *args: Any) -> Any:
        """A named read of the live engine (``engine_info.ENGINE_QUERIES``), between steps."""
        return await self._call(lambda: run_query(self.engine, name, args))

    async def ledger(self) -> dict[str, Any]:
        """The live ledger (``LedgerSnapshot.to_dict()``) plus the scheduler's queue sizes."""
        return await self.query("ledger")

    # -- plumbing -------------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], T]) -> T:
        if self._thread is None:
            self.start()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._submit(fn, fut)
        return await fut

    def _submit(self, fn: Callable[[], Any], fut: asyncio.Future | None) -> None:
        with self._cond:
            if self.dead is not None or self._stopping:
                if fut is not None:
                    fut.set_exception(
                        EngineDeadError(f"engine is not running: {self.dead or 'stopped'}")
                    )
                return
            self._ops.append((fn, fut))
            self._cond.notify()

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._ops or self._stopping or eng.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    ops, self._ops = self._ops, []
                with self._lock:
                    for fn, fut in ops:
                        try:
                            result = fn()
                        except Exception as e:  # a caller's error (bad request): theirs alone
                            self._resolve(fut, None, e)
                        else:
                            self._resolve(fut, result, None)
                    outs = eng.step() if eng.has_unfinished_requests() else []
                    if outs and self.observer is not None:
                        self.observer.on_outputs(outs)
                if outs:
                    self._post(self._dispatch, outs)
                else:  # a prefill chunk, or no progress at all: never spin hot
                    with self._cond:
                        if not self._ops and not self._stopping:
                            self._cond.wait(0.001)
        except BaseException as e:  # a bug in a step: fail everyone loudly, keep serving errors
            logger.exception("engine step failed; the engine is stopped")
            self.dead = e
        finally:
            with self._cond:
                ops, self._ops = self._ops, []
                self._stopping = True
            err = EngineDeadError(f"engine is not running: {self.dead or 'stopped'}")
            for _, fut in ops:
                self._resolve(fut, None, err)
            self._post(self._fail_all, err)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _resolve(
        self, fut: asyncio.Future | None, result: Any, error: BaseException | None
    ) -> None:
        resolve_threadsafe(self._loop, fut, result, error)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self.streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, error: BaseException) -> None:
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.fail(error)
