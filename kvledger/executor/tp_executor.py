"""The driver's side of tensor parallelism: start (or wait for) the ranks, send each step's
``SchedulerOutput`` to all of them, collect the results, and notice a rank that dies or hangs.

The driver is not a rank (as vLLM v1's multiprocess executor): it runs the scheduler, the block
manager and detokenisation, and no weights; every rank is a ``kvledger.worker`` process running
the same ``Worker`` as the in-process executor (rank 0 samples), so a rank's failure never takes
the driver's state with it. Messages go over one authenticated ``multiprocessing.connection``
per rank (the step pickled once for all; ``kvledger.worker.messages``); the tensors between
ranks go through torch.distributed.

Faults: a step waits at most ``step_timeout_s`` for every rank; a rank that closes its
connection, exits, reports an error (a collective that timed out on its side) or stays silent
past the deadline makes ``execute_model`` raise ``WorkerFailedError`` naming the rank and the cause,
and every worker is stopped: the executor is dead from then on.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from kvledger import envs
from kvledger.cache.kv_tier_messages import TierReport
from kvledger.cache.kv_tier_ranks import RankTierReports
from kvledger.core.sched_output import SchedulerOutput
from kvledger.errors import ConfigError
from kvledger.executor.base import Executor
from kvledger.worker.messages import (
    FlushKVTiers,
    Shutdown,
    StepResult,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
    WorkerStats,
)
from kvledger.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("kvledger")


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine cannot take another step."""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"tp_driver_address must be HOST:PORT, got {address!r}")
    return host, int(port)


class TPExecutor(Executor):
    def __init__(
        self,
        spec: WorkerSpec,
        world_size: int,
        backend: str = "mp",
        address: str | None = None,
        step_timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.num_ranks = world_size
        self.step_timeout_s = step_timeout_s
        self.dead: str | None = None
        self.procs: list[subprocess.Popen] = []
        self._logs: list[str] = []
        self.conns: list[Connection] = []
        self.ranks: list[WorkerReady] = []
        self._stats = WorkerStats()  # rank 0's, from its last step
        self._tier_reports = RankTierReports(world_size)  # one agreed answer from every rank's
        # Totals over steps, for the benchmark: the driver's round trip per step, and each
        # rank's compute and time inside collectives (all-reduce / all-gather).
        self.timings = {"steps": 0, "round_trip_s": 0.0, "compute_s": [0.0] * world_size,
                      "collective_s": [0.0] * world_size, "collectives": [0] * world_size}
        if backend == "mp":
            authkey = secrets.token_hex(16).encode()
            host, port = "127.0.0.1", 0
        else:
            key = envs.KVLEDGER_TP_AUTHKEY
            if not key:
                raise ConfigError(
                    "distributed_executor_backend='external' needs KVLEDGER_TP_AUTHKEY set (the "
                    "secret the workers present)"
                )
            authkey = key.encode()
            host, port = _parse(address or "127.0.0.1:29600")
        self._listener = Listener((host, port), authkey=authkey)
        self.address = self._listener.address
        try:
            if backend == "mp":
                self._spawn(spec, authkey)
            self._accept(start_timeout_s)
            for c in self.conns:
                c.send(spec)
            self.ranks = [self._receive(r, start_timeout_s, "start") for r in range(world_size)]
        except BaseException:
            self.close()
            raise
        finally:
            self._listener.close()

    # -- start-up ---------------------------------------------------------------------------------
    def _spawn(self, spec: WorkerSpec, authkey: bytes) -> None:
        master_port = _free_port()
        host, port = self.address
        for rank in range(self.num_ranks):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.num_ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                KVLEDGER_TP_AUTHKEY=authkey.decode(),
                OMP_NUM_THREADS=str(spec.num_threads),
            )
            fd, log = tempfile.mkstemp(prefix=f"kvledger-tp-rank{rank}-", suffix=".log")
            self._logs.append(log)
            with os.fdopen(fd, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "kvledger.worker", "--driver", f"{host}:{port}"],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )

    def _accept(self, timeout_s: float) -> None:
        """Every rank connects and says hello; spawned ones that exit first fail at once."""
        got: dict[int, Connection] = {}
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(got) < self.num_ranks:
                    c = self._listener.accept()
                    _, rank, world = c.recv()
                    if world != self.num_ranks:
                        c.close()
                        raise ConfigError(
                            f"a worker of a {world}-rank group connected to a "
                            f"{self.num_ranks}-rank driver"
                        )
                    got[rank] = c
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)

        t = threading.Thread(target=accept, daemon=True, name="kvledger-tp-accept")
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            t.join(0.1)
            self._check_procs("start")
            if time.monotonic() > deadline:
                raise WorkerFailedError(
                    f"only {len(got)} of {self.num_ranks} tensor-parallel workers connected to "
                    f"{self.address[0]}:{self.address[1]} within {timeout_s:.0f} s"
                )
        if errors:
            raise errors[0]
        self.conns = [got[r] for r in range(self.num_ranks)]

    def _receive(self, rank: int, timeout_s: float, what: str):
        c = self.conns[rank]
        deadline = time.monotonic() + timeout_s
        while not c.poll(0.1):
            self._check_procs(what)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"tensor-parallel rank {rank} did not {what} within {timeout_s:.0f} s")
        msg = self._recv(rank)
        if isinstance(msg, WorkerFailed):
            raise ConfigError(f"tensor-parallel rank {rank} could not start: {msg.reason}")
        return msg

    def _recv(self, rank: int):
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            time.sleep(0.2)  # let the exit be seen, so the message says how it ended
            self._check_procs("answer")
            raise WorkerFailedError(
                f"tensor-parallel rank {rank} closed its connection (the process died?)"
            ) from None

    def _check_procs(self, what: str) -> None:
        def exited() -> dict[int, int]:
            return {r: rc for r, p in enumerate(self.procs)
                    if (rc := p.poll()) is not None and (rc != 0 or what != "stop")}

        if not (gone := exited()):
            return
        # When one rank dies its peers' collectives fail and they abort (SIGABRT) moments
        # later, sometimes before the driver looks: wait for the dust, then blame the cause.
        time.sleep(0.3)
        gone = exited() or gone
        rank = min(gone, key=lambda r: (gone[r] == -signal.SIGABRT, r))
        others = ", ".join(f"rank {r} exited with code {rc}" for r, rc in sorted(gone.items()) if r != rank)
        raise WorkerFailedError(
            f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) exited with code "
            f"{gone[rank]} before it could {what}{self._log_tail(rank)}"
            + (f" (then {others})" if others else "")
        )

    def _log_tail(self, rank: int, lines: int = 6) -> str:
        if rank >= len(self._logs):
            return ""
        try:
            with open(self._logs[rank], errors="replace") as f:
                tail = f.read().strip().splitlines()[-lines:]
        except OSError:
            return ""
        return (": " + " | ".join(tail)) if tail else ""

    # -- steps ------------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to every rank (pickled once); rank 0's output, with the slowest
        rank's swap times."""
        if self.dead is not None:
            raise WorkerFailedError(self.dead)
        t0 = time.perf_counter()
        data = pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank, c in enumerate(self.conns):
                try:
                    c.send_bytes(data)
                except (OSError, EOFError):
                    self._check_procs("take a step")
                    raise WorkerFailedError(
                        f"tensor-parallel rank {rank} cannot be reached (connection closed)"
                    ) from None
            results = self._gather()
        except WorkerFailedError as e:
            self._fail(str(e))
            raise
        st = self.timings
        st["steps"] += 1
        st["round_trip_s"] += time.perf_counter() - t0
        for r in results:
            st["compute_s"][r.rank] += r.compute_seconds
            st["collective_s"][r.rank] += r.collective_seconds
            st["collectives"][r.rank] += r.num_collectives
        self.last_results = results
        self._stats = results[0].stats
        out = results[0].output
        out.swap_out_seconds = max(r.output.swap_out_seconds for r in results)
        out.swap_in_seconds = max(r.output.swap_in_seconds for r in results)
        out.kv_tiers = self._tier_reports.merge([r.output.kv_tiers for r in results], so.finished_req_ids)
        return out

    def flush_kv_tiers(self) -> TierReport | None:
        """Every rank waits for its disk writes; the writes count once every rank's is done."""
        if self.dead is not None:
            return None
        for c in self.conns:
            c.send(FlushKVTiers())
        reports = [self._receive(r, self.step_timeout_s, "flush its KV tier writes") for r in range(self.num_ranks)]
        return self._tier_reports.merge(reports)

    def stats(self) -> WorkerStats:
        return self._stats

    def shutdown(self) -> None:
        self.close()

    def _gather(self) -> list[StepResult]:
        results: dict[int, StepResult] = {}
        rank_of = {id(c): r for r, c in enumerate(self.conns)}
        deadline = time.monotonic() + self.step_timeout_s
        while len(results) < self.num_ranks:
            pending = [c for r, c in enumerate(self.conns) if r not in results]
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(rank_of[id(c)] for c in pending)
                raise WorkerFailedError(
                    f"tensor-parallel rank(s) {ranks} did not finish a step within "
                    f"{self.step_timeout_s:g} s (step_timeout): hung or too slow"
                )
            for c in wait(pending, timeout=min(left, 0.5)):
                rank = rank_of[id(c)]
                msg = self._recv(rank)
                if isinstance(msg, WorkerFailed):
                    # A collective fails on every rank when one dies: blame the dead one.
                    time.sleep(0.2)
                    self._check_procs("finish the step")
                    raise WorkerFailedError(f"tensor-parallel rank {rank} failed: {msg.reason}")
                results[rank] = msg
            self._check_procs("finish the step")
        return [results[r] for r in range(self.num_ranks)]

    def _fail(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            logger.error("tensor-parallel engine failed: %s", reason)
        self.close(graceful=False)

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self, graceful: bool = True, timeout_s: float = 5.0) -> None:
        """Stop every worker (Shutdown, then terminate, then kill) and remove their logs."""
        if graceful and self.dead is None:
            for c in self.conns:
                try:
                    c.send(Shutdown())
                except (OSError, EOFError):
                    pass
        for c in self.conns:
            c.close()
        self.conns = []
        deadline = time.monotonic() + (timeout_s if graceful else 0.5)
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        for log in self._logs:
            try:
                os.unlink(log)
            except OSError:
                pass
        self._logs = []
        if self.dead is None:
            self.dead = "the tensor-parallel workers were shut down"
