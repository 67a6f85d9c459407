"""The engine core process: owns one ``LLMEngine`` and runs its step loop (vLLM v1's split).

The front end (HTTP, tokenization, SSE) lives in the parent; this process only schedules,
computes and detokenizes. Between steps it drains its input socket (adds, aborts, named
queries), then steps while work remains and pushes each step's outputs. A failed step is
fatal: the error goes to the front end (``DEAD``) and the process exits, so the server
answers 503 instead of hanging. It exits too when its parent dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Any

import zmq

from kvledger.engine import core_protocol as wire

logger = logging.getLogger("kvledger")

IDLE_POLL_MS = 500  # an idle core wakes this often to check that its parent lives


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the parent that started it exits."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_up(engine: Any, index: int, torch_threads: int | None) -> Any:
    """What a built engine does before it says READY: its thread count (unless the user chose
    one), its start-up heap frozen; returns the EngineInfo to send."""
    from kvledger.engine.engine_info import EngineInfo
    from kvledger.engine.gc_heap import freeze_gc_heap

    engine.stream_outputs = True
    worker = getattr(engine.executor, "worker", None)  # the in-process worker, if any
    if not torch_threads and worker is not None and worker.device.type == "cpu":
        import torch

        from kvledger.engine.core_threads import MIN_WORK_S, choose_core_threads

        n = torch.get_num_threads()
        threads, work = choose_core_threads(worker.model, n)
        logger.info(
            "engine core %d: %d torch thread(s): a decode step's matmuls take %.2f ms on one"
            " (%d threads from %.1f ms; --torch-threads N to choose)",
            index, threads, work * 1e3, n, MIN_WORK_S * 1e3,
        )  # fmt: skip
    frozen = freeze_gc_heap()  # its start-up heap, out of the collector's walks
    logger.info("engine core %d: %d start-up objects frozen out of the garbage collector", index, frozen)
    return EngineInfo.from_engine(engine)


def run_engine_core(
    config: Any,
    index: int,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    torch_threads: int | None = None,
) -> None:
    """Process entry point: build the engine, say READY (or DEAD), serve until SHUTDOWN."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    _die_with_parent()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    code = 0
    try:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        from kvledger.engine.builder import build_engine

        try:
            engine = build_engine(config)
            info = _start_up(engine, index, torch_threads)
        except BaseException as e:  # reported by the front end, one line (never a silent exit 0)
            out.send_multipart([wire.DEAD, wire.dump(e)])
            code = 1
            return
        out.send_multipart([wire.READY, wire.dump(info)])
        try:
            EngineCore(engine, inp, out, parent_pid, index).run()
        except BaseException as e:
            logger.exception("engine core %d failed; it is stopped", index)
            out.send_multipart([wire.DEAD, wire.dump(e)])
            code = 1
        finally:
            with contextlib.suppress(Exception):
                engine.shutdown()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no atexit handlers inherited from the front end (fork)


class EngineCore:
    """The loop: inputs between steps, one step while work remains, outputs after each."""

    def __init__(self, engine: Any, inp: zmq.Socket, out: zmq.Socket, parent_pid: int, index: int):
        self.engine = engine
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self.index = index
        self.stopping = False

    def run(self) -> None:
        eng = self.engine
        stalled = False  # the last step gave no output: wait a little for input first
        while not self.stopping:
            if eng.has_unfinished_requests():
                timeout = 1 if stalled else 0
            else:
                timeout = IDLE_POLL_MS
                if os.getppid() != self.parent_pid:
                    logger.warning("engine core %d: the front end is gone; exiting", self.index)
                    return
            outs: list = []
            while self.inp.poll(timeout):
                self._handle(self.inp.recv_multipart(copy=False), outs)
                timeout = 0
                if self.stopping:
                    return
            if eng.has_unfinished_requests():
                step_outs = eng.step()
                stalled = not step_outs
                outs.extend(step_outs)
            if outs:
                self._send_outputs(outs)

    def _send_outputs(self, outs: list) -> None:
        for o in outs:  # the front end has the prompt; do not send it back every step
            o.prompt_token_ids = []
            o.prompt = None
        self.out.send_multipart([wire.OUTPUTS, wire.encode_outputs(outs)], copy=False)

    def _handle(self, frames: list, outs: list) -> None:
        from kvledger.engine.front import add_served_request

        kind, body = frames[0].bytes, frames[1].buffer if len(frames) > 1 else b""
        eng = self.engine
        if kind == wire.ADD:
            rid, ids, text, raw_params, arrival, priority, salt = wire.decode_add_envelope(body)
            err = None
            try:  # a request that fails to unpickle is its own error, never the core's
                params = wire.load(raw_params)
                add_served_request(eng, rid, ids, text, params, arrival, priority, salt)
            except Exception as e:  # the caller's error (bad request): theirs alone
                err = e
            self.out.send_multipart([wire.ACK, wire.dump((rid, err))])
        elif kind == wire.ABORT:
            for rid in wire.decode_abort(body):
                group = eng.groups.get(rid)
                if group is None:
                    continue
                eng.abort_request(rid)
                outs.append(eng.make_output(group))  # for the front end's metrics
        elif kind == wire.QUERY:
            from kvledger.engine.engine_info import run_query

            qid, name, args = wire.load(body)
            try:
                result, ok = run_query(eng, name, args), True
            except Exception as e:
                result, ok = e, False
            self.out.send_multipart([wire.RESULT, wire.dump((qid, ok, result))])
        elif kind == wire.SHUTDOWN:
            for rid in list(eng.groups):
                eng.abort_request(rid)
            self.stopping = True
        else:
            logger.error("engine core %d: unknown message kind %r", self.index, kind)
