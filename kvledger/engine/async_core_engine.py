"""``AsyncEngine``'s API over engine core processes: the server's front end in the split.

The front end tokenizes, keeps the per-request streams, feeds the metrics observer and hands
outputs to the SSE loop; each engine core process (``core_proc``) schedules, computes and
detokenizes. A core's outputs arrive on its client's reader thread, which runs the observer
and posts them to the event loop. Several cores (data parallelism) sit behind one front end:
``choose_engine`` picks the core of each new request (here: fewest requests in flight; a
cache-aware router overrides it), aborts follow the request to its core, and ``query`` takes
the core's index. A dead core fails its own requests with ``EngineDeadError`` (503) and makes
``is_running`` false (``/health`` answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvledger.engine.core_client import EngineCoreClient
from kvledger.engine.engine_info import EngineInfo
from kvledger.engine.front import (
    EngineObserver,
    RequestStream,
    StreamingFront,
    tokenize_prompt,
)
from kvledger.errors import EngineDeadError, InvalidRequestError
from kvledger.outputs import RequestOutput
from kvledger.sampling_params import RequestOutputKind, SamplingParams


class AsyncCoreEngine(StreamingFront):
    def __init__(
        self,
        clients: list[EngineCoreClient],
        tokenizer: Any,
        observer: EngineObserver | None = None,
    ) -> None:
        if not clients or any(c.info is None for c in clients):
            raise ValueError("AsyncCoreEngine needs started engine cores (wait_ready first)")
        self.clients = clients
        self.info: EngineInfo = clients[0].info  # type: ignore[assignment]
        self.tokenizer = tokenizer
        self.observer = observer
        self.streams: dict[str, RequestStream] = {}
        self._engine_of: dict[str, int] = {}  # request id -> its core's index
        self._in_flight = [0] * len(clients)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: BaseException | None = None

    @classmethod
    def launch(
        cls,
        config: Any,
        num_engines: int = 1,
        torch_threads: int | None = None,
        observer: EngineObserver | None = None,
    ) -> AsyncCoreEngine:
        """Start ``num_engines`` cores on ``config`` and load the front end's tokenizer while
        they build their engines; raises a core's start-up error (e.g. ``ConfigError``)."""
        clients, tokenizer = start_cores([config] * num_engines, torch_threads)
        return cls(clients, tokenizer, observer)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start receiving outputs; call from the event loop that will consume them."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        for c in self.clients:
            c.start(self._loop, self._on_outputs, self._on_dead)

    def mark_stopping(self) -> None:
        """The server was asked to stop: the cores' exits that follow are not crashes."""
        for c in self.clients:
            c.mark_stopping()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every core (each aborts its requests), end every stream."""
        for c in self.clients:
            c.shutdown(timeout)
        self._fail(EngineDeadError("the server is shutting down"), None)

    @property
    def is_running(self) -> bool:
        return self._loop is not None and all(c.is_alive for c in self.clients)

    # -- requests -------------------------------------------------------------------------------
    def choose_engine(self, prompt_token_ids: list[int], request_id: str | None = None, params: Any = None) -> int:
        """The core for a new request: the one with the fewest requests in flight."""
        loads = self._in_flight
        return min(range(len(loads)), key=loads.__getitem__)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Tokenize here, send to a core, return once it accepted the request (or raise the
        core's InvalidRequestError: the checks are the engine's own, ``add_served_request``)."""
        if self._loop is None:
            self.start()
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC)
        if isinstance(prompt, str):
            ids, text = tokenize_prompt(self.tokenizer, prompt, add_special_tokens), prompt
        else:
            ids, text = list(prompt), None
        idx = self.choose_engine(ids, request_id, params)
        stream = RequestStream(self, request_id, getattr(params, "output_kind", None) is RequestOutputKind.DELTA)  # type: ignore[arg-type]
        stream.prompt_token_ids, stream.prompt = ids, text
        self.streams[request_id] = stream
        self._engine_of[request_id] = idx
        self._in_flight[idx] += 1
        try:
            await self.clients[idx].add_request(request_id, ids, text, params, arrival, priority, cache_salt)
        except BaseException:
            self.abort(request_id)
            raise
        if self.observer is not None:
            self.observer.on_request_added(len(ids), idx)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort without waiting: its core drops it before its next step."""
        self._end_stream(request_id)
        idx = self._release(request_id)
        if idx is not None:
            self.clients[idx].abort([request_id])

    async def query(self, name: str, *args: Any, engine_index: int = 0) -> Any:
        """A named read (``engine_info.ENGINE_QUERIES``) of one core, between its steps."""
        return await self.clients[engine_index].query(name, *args)

    async def ledger(self, engine_index: int = 0) -> dict[str, Any]:
        return await self.query("ledger", engine_index=engine_index)

    async def run_in_engine(self, fn: Any) -> Any:
        raise TypeError(
            "the engine runs in another process: closures cannot reach it; "
            "use query(name) with a function registered in kvledger.engine.engine_info"
        )

    # -- plumbing -------------------------------------------------------------------------------
    def _release(self, request_id: str) -> int | None:
        idx = self._engine_of.pop(request_id, None)
        if idx is not None:
            self._in_flight[idx] -= 1
        return idx

    def _on_outputs(self, index: int, outs: list[RequestOutput]) -> None:  # reader thread
        if self.observer is not None:
            self.observer.on_outputs(outs, index)
        self._post(self._dispatch, outs)

    def _on_dead(self, index: int, error: BaseException) -> None:  # reader thread
        self.dead = error
        self._post(self._fail, error, index)

    def _post(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        streams = self.streams
        for out in outs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            out.prompt_token_ids, out.prompt = stream.prompt_token_ids, stream.prompt
            if out.finished:
                self._release(out.request_id)
            stream.put(out)

    def _fail(self, error: BaseException, index: int | None) -> None:
        """End the streams of core ``index`` (None: all) with ``error``."""
        for rid, stream in list(self.streams.items()):
            if index is None or self._engine_of.get(rid) == index:
                self.streams.pop(rid, None)
                self._release(rid)
                stream.fail(error)


def start_cores(configs: list[Any], torch_threads: int | None) -> tuple[list[EngineCoreClient], Any]:
    """One engine core per config (core i gets index i), and the front end's tokenizer loaded
    while they build their engines; on any failure every core started so far is closed."""
    from kvledger.hf.tokenizer import maybe_tokenizer

    clients: list[EngineCoreClient] = []
    try:
        for i, config in enumerate(configs):
            clients.append(EngineCoreClient(config, i, torch_threads))
        with ThreadPoolExecutor(1) as pool:  # forked first: no thread exists at fork time
            tok = pool.submit(maybe_tokenizer, str(configs[0].tokenizer or configs[0].model))
            for c in clients:
                c.wait_ready()
            return clients, tok.result()
    except BaseException:
        for c in clients:
            c.close()
        raise
