"""``python -m kvledger.worker --driver HOST:PORT``: one tensor-parallel rank for a driver.

The engine starts these itself for ``tensor_parallel_size=N`` (one process per rank). To run
ranks on several machines, start them with ``torchrun`` (or anything that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) and point them at a driver started with
``distributed_executor_backend="external"`` listening at ``tp_driver_address``::

    # machine A (the driver): kvledger serve MODEL -tp 2 --distributed-executor-backend external \
    #                          --tp-driver-address 0.0.0.0:29600
    # each worker machine, i = 0, 1:
    KVLEDGER_TP_AUTHKEY=secret torchrun --nnodes 2 --nproc-per-node 1 --node-rank i \
        --master-addr A --master-port 29500 -m kvledger.worker --driver A:29600

Both sides read the shared secret from ``KVLEDGER_TP_AUTHKEY`` (connections are authenticated
by ``multiprocessing.connection``'s HMAC handshake).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvledger import envs


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SystemExit(f"--driver must be HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvledger.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", required=True, help="HOST:PORT the driver listens on for workers")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the driver's choice)")
    args = ap.parse_args(argv)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise SystemExit(f"{name} is not set: start workers with torchrun (or set it yourself)")
    key = envs.KVLEDGER_TP_AUTHKEY
    if not key:
        raise SystemExit("KVLEDGER_TP_AUTHKEY is not set: use the driver's secret")
    from kvledger.worker.tp_worker import run_worker

    return run_worker(parse_address(args.driver), key.encode(), args.threads)


if __name__ == "__main__":
    sys.exit(main())
