"""The front end's handle on one engine core process (``core_proc``): start it, talk to it.

The interface a front end (``AsyncCoreEngine``, or a data-parallel router over several cores)
uses, all from one asyncio event loop:

- ``EngineCoreClient(config, index)`` forks the core process and binds its two sockets;
  ``wait_ready()`` blocks until the engine is built and returns its ``EngineInfo`` (or raises
  the engine's own start-up error); ``index`` is the core's rank among its siblings.
- ``start(loop, on_outputs, on_dead)``: a reader thread receives the core's messages;
  ``on_outputs(index, outputs)`` and ``on_dead(index, error)`` run in that thread (keep them
  cheap; hop to the loop with ``call_soon_threadsafe``).
- ``add_request(...)`` (awaitable: resolves once the core accepted the request, or raises its
  ``InvalidRequestError``), ``abort(request_ids)``, ``query(name, *args)`` (a named read of
  ``engine_info.ENGINE_QUERIES``), ``is_alive``, ``shutdown()``.

Every pending ack and query fails with ``EngineDeadError`` when the core dies, however it
dies: its own error message, or its process ending (the reader polls the process sentinel).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import zmq

from kvledger import envs
from kvledger.engine import core_protocol as wire
from kvledger.engine.core_proc import run_engine_core
from kvledger.engine.engine_info import EngineInfo
from kvledger.engine.front import resolve_threadsafe
from kvledger.errors import EngineDeadError, KVLedgerError
from kvledger.outputs import RequestOutput

logger = logging.getLogger("kvledger")
# How long a core's clean exit waits for the server's own stop to be seen before it is
# reported as a core stopped alone.
STOP_GRACE_S = 3.0


def _start_method() -> str:
    """fork unless asked otherwise: the core starts from the front end's few (torch-free)
    modules and imports torch and the engine itself (tests/test_layers.py); the front end never
    touches CUDA, so forking is safe as vLLM does it."""
    return envs.KVLEDGER_ENGINE_START_METHOD


class EngineCoreClient:
    """One engine core process and the two ZMQ sockets to it (PUSH in, PULL out, over ipc)."""

    def __init__(self, config: Any, index: int = 0, torch_threads: int | None = None) -> None:
        self.index = index
        self.info: EngineInfo | None = None
        self.dead: BaseException | None = None
        self._dir = tempfile.mkdtemp(prefix="kvledger-core-")
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        in_addr = f"ipc://{self._dir}/in"
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        out_addr = f"ipc://{self._dir}/out"
        self._out.bind(out_addr)
        mp = multiprocessing.get_context(_start_method())
        self.proc = mp.Process(
            target=run_engine_core,
            args=(config, index, in_addr, out_addr, os.getpid(), torch_threads),
            name=f"kvledger-engine-core-{index}",
            daemon=True,
        )
        self.proc.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stop_reader = threading.Event()
        # Set when the server was asked to stop (a signal to the front end, or shutdown()): a
        # core that exits then is the requested stop, logged at INFO, not a crash.
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # pending acks and queries: loop thread vs reader
        self._acks: dict[str, asyncio.Future] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._qids = itertools.count()
        self._on_outputs: Callable[[int, list[RequestOutput]], None] | None = None
        self._on_dead: Callable[[int, BaseException], None] | None = None

    # -- start-up -----------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Block until the core has built its engine; raise its error if it could not."""
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        events = dict(poller.poll(None if timeout is None else timeout * 1000))
        if self._out in events:
            kind, body = self._out.recv_multipart()
            if kind == wire.READY:
                self.info = wire.load(body)
                return self.info
            if kind == wire.DEAD:
                err = wire.load(body)
                self.close()
                if isinstance(err, KVLedgerError):
                    raise err
                raise EngineDeadError(f"the engine core failed to start: {err}") from err
        self.close()
        if not events:
            raise EngineDeadError(f"the engine core did not start within {timeout} s")
        raise EngineDeadError(f"the engine core exited with code {self.proc.exitcode} at start-up")

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[int, list[RequestOutput]], None],
        on_dead: Callable[[int, BaseException], None],
    ) -> None:
        """Start receiving: callbacks run in the reader thread."""
        if self._reader is not None:
            return
        self._loop, self._on_outputs, self._on_dead = loop, on_outputs, on_dead
        self._reader = threading.Thread(
            target=self._read, name=f"kvledger-core-reader-{self.index}", daemon=True
        )
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self.proc.is_alive()

    # -- requests (event loop) ------------------------------------------------------------------
    def add_request(
        self, rid: str, ids: list[int], text: str | None, params: Any, arrival: float, priority: int,
        cache_salt: str | None = None,
    ) -> asyncio.Future:  # fmt: skip
        """Send a request; the future resolves when the core accepted it (or holds its error)."""
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            if self.dead is not None:
                fut.set_exception(EngineDeadError(f"engine is not running: {self.dead}"))
                return fut
            self._acks[rid] = fut
        self._in.send_multipart(
            [wire.ADD, wire.encode_add(rid, ids, text, params, arrival, priority, cache_salt)]
        )
        return fut

    def abort(self, rids: list[str]) -> None:
        if self.dead is None and rids:
            self._in.send_multipart([wire.ABORT, wire.encode_abort(rids)])

    async def query(self, name: str, *args: Any) -> Any:
        """A named read of the live engine, between two of its steps."""
        qid = next(self._qids)
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(f"engine is not running: {self.dead}")
            self._queries[qid] = fut
        self._in.send_multipart([wire.QUERY, wire.dump((qid, name, args))])
        return await fut

    # -- shutdown -------------------------------------------------------------------------------
    def mark_stopping(self) -> None:
        """The server is stopping: the core's exit from now on is expected (the front end's
        signal handler calls this before the core, in the same process group, may exit)."""
        self._stopping.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to abort everything and exit; kill it if it does not."""
        self._stopping.set()
        if self.proc.is_alive() and self.dead is None:
            with contextlib.suppress(zmq.ZMQError):
                self._in.send_multipart([wire.SHUTDOWN, b""])
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._mark_dead(EngineDeadError("the server is shutting down"))
        self._stop_reader.set()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        self.close()

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for s in (self._in, self._out):
            s.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- the reader thread ----------------------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        try:
            while not self._stop_reader.is_set():
                events = dict(poller.poll(200))
                if self._out in events:
                    while True:  # drain what is there before looking at the process
                        try:
                            kind, body = self._out.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._dispatch(kind.bytes, body.buffer)
                elif self.proc.sentinel in events:
                    if not self._stop_reader.is_set():
                        self.proc.join(1)  # reap it, for its exit code
                        self._core_exited(self.proc.exitcode)
                    return
        except zmq.ZMQError:  # closed under us at shutdown
            return

    def _dispatch(self, kind: bytes, body: Any) -> None:
        if kind == wire.OUTPUTS:
            self._on_outputs(self.index, wire.decode_outputs(body))  # type: ignore[misc]
        elif kind == wire.ACK:
            rid, err = wire.load(body)
            with self._lock:
                fut = self._acks.pop(rid, None)
            self._resolve(fut, None, err)
        elif kind == wire.RESULT:
            qid, ok, result = wire.load(body)
            with self._lock:
                fut = self._queries.pop(qid, None)
            self._resolve(fut, result if ok else None, None if ok else result)
        elif kind == wire.DEAD:
            err = wire.load(body)
            self._died(EngineDeadError(f"engine is not running: {err}"))

    def _core_exited(self, code: int | None) -> None:
        """The core process ended. Its requests fail at once; the log line says whether that was
        the requested stop (INFO: the server is stopping, e.g. Ctrl-C or systemd's SIGTERM to the
        process group, where the core may exit a moment before the front end's handler runs),
        a stop from outside of the core alone (WARNING), or a crash (ERROR)."""
        signalled = code is not None and -code in (signal.SIGTERM, signal.SIGINT)
        if signalled:
            err = EngineDeadError(f"the engine core process was stopped by {signal.Signals(-code).name}")
        else:
            err = EngineDeadError(f"the engine core process exited (code {code})")
        self._fail(err)
        # None: shutdown() reaped the process first (its join runs in another thread).
        if (signalled or code in (0, None)) and self._stopping.wait(STOP_GRACE_S):
            logger.info("engine core %d stopped with the server", self.index)
        else:
            level = logging.WARNING if signalled else logging.ERROR
            logger.log(level, "engine core %d is dead: %s", self.index, err)

    def _died(self, err: BaseException) -> None:
        logger.error("engine core %d is dead: %s", self.index, err)
        self._fail(err)

    def _fail(self, err: BaseException) -> None:
        """Every pending ack and query fails with ``err``, and the front end hears of it."""
        self._mark_dead(err)
        if self._on_dead is not None:
            self._on_dead(self.index, err)

    def _mark_dead(self, err: BaseException) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = err
            pending = [*self._acks.values(), *self._queries.values()]
            self._acks.clear()
            self._queries.clear()
        for fut in pending:
            self._resolve(fut, None, EngineDeadError(f"engine is not running: {self.dead}"))

    def _resolve(
        self, fut: asyncio.Future | None, result: Any, error: BaseException | None
    ) -> None:
        resolve_threadsafe(self._loop, fut, result, error)
