"""The one interface between the engine and whatever computes its steps.

The engine hands each ``SchedulerOutput`` to ``execute_model`` and gets the sampled tokens
back, whether the worker is in this process (``LocalExecutor``) or N tensor-parallel ranks in
their own processes (``TPExecutor``): the same message, the same answer (vLLM v1's executor).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvledger.cache.kv_tier_messages import TierReport
from kvledger.core.sched_output import SchedulerOutput
from kvledger.worker.messages import WorkerReady, WorkerStats
from kvledger.worker.model_runner import ModelRunnerOutput


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls (timings here are floors, not averages)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Executor(ABC):
    ranks: list[WorkerReady]  # one per rank: what each worker built (the ledger's rows)
    dead: str | None = None  # why no further step can run (a rank died), else None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (or only its bookkeeping: finished ids, block ops) on every worker."""

    @abstractmethod
    def stats(self) -> WorkerStats:
        """Rank 0's live figures (overlay, sink cache, device memory)."""

    def time_swap(self, num_blocks: int, repeats: int) -> tuple[int, float, float, float] | None:
        """(blocks moved, seconds of one batched swap-out of them, of one swap-in, of a
        one-block round trip), best of ``repeats``; None where it cannot be measured here."""
        return None

    def flush_kv_tiers(self) -> TierReport | None:
        """Wait for the tiered cache's disk writes (a graceful shutdown) and report them."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (processes, sockets)."""
