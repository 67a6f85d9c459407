"""One tensor-parallel rank in its own process: a ``Worker`` fed the engine's step messages.

A rank connects to its driver, receives a ``WorkerSpec``, joins the torch.distributed group
(rank and world from ``RANK`` / ``WORLD_SIZE``, rendezvous at ``MASTER_ADDR`` /
``MASTER_PORT``, as torchrun sets them), loads and shards the model, builds its pools (same
block count as every other rank, its own KV heads) and reports ``WorkerReady``. Then, per
``SchedulerOutput`` (the same object the engine's in-process worker runs): the step on its own
pools and shard, answered with a ``StepResult`` (rank 0's carries the sampled tokens), so the
driver hears from every rank each step.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from kvledger import envs
from kvledger.core.sched_output import SchedulerOutput
from kvledger.distributed import parallel_state
from kvledger.worker.messages import FlushKVTiers, Shutdown, StepResult, WorkerFailed, WorkerSpec
from kvledger.worker.worker import Worker


@torch.inference_mode()
def execute_step(worker: Worker, so: SchedulerOutput) -> StepResult:
    """One step on this rank, timed: compute and the time spent inside collectives."""
    t0 = time.perf_counter()
    st = parallel_state.TP
    st.collective_seconds, st.num_collectives = 0.0, 0
    output = worker.execute_model(so)
    res = StepResult(worker.rank, output)
    if worker.rank == 0:
        res.stats = worker.stats()
    res.compute_seconds = time.perf_counter() - t0
    res.collective_seconds, res.num_collectives = st.collective_seconds, st.num_collectives
    return res


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """The driver may still be starting (torchrun launches workers independently): retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, FileNotFoundError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_worker(driver: tuple[str, int], authkey: bytes, num_threads: int | None = None) -> int:
    """Serve one driver until it says Shutdown or goes away. Returns the exit code."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    conn = _connect(driver, authkey, envs.KVLEDGER_WORKER_CONNECT_TIMEOUT)
    conn.send(("hello", rank, world_size))
    try:
        spec: WorkerSpec = conn.recv()
        torch.set_num_threads(num_threads or spec.num_threads)
        dist.init_process_group(
            spec.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        parallel_state.set_tp(rank, world_size)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            spec.device = f"cuda:{torch.cuda.current_device()}"
        worker = Worker(spec, rank, world_size)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which names it
        _report(conn, rank, e)
        return 1
    conn.send(worker.ready)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0  # the driver is gone: nothing to serve
        if isinstance(msg, Shutdown):
            break
        if isinstance(msg, FlushKVTiers):
            conn.send(worker.flush_kv_tiers())
            continue
        try:
            conn.send(execute_step(worker, msg))
        except BaseException as e:  # noqa: BLE001
            _report(conn, rank, e)
            return 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _report(conn: Connection, rank: int, e: BaseException) -> None:
    reason = f"{type(e).__name__}: {e}".strip()
    if not str(e):
        reason += " " + traceback.format_exc(limit=3)
    try:
        conn.send(WorkerFailed(rank, reason[:2000]))
    except (OSError, EOFError):
        pass
