"""The engine's worker in its own process: each step is one method call, nothing copied."""

from __future__ import annotations

from kvledger.cache.kv_tier_messages import TierReport
from kvledger.core.sched_output import SchedulerOutput
from kvledger.executor.base import Executor, best_time
from kvledger.worker.messages import WorkerStats
from kvledger.worker.model_runner import ModelRunnerOutput
from kvledger.worker.worker import Worker


class LocalExecutor(Executor):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.ranks = [worker.ready]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    def flush_kv_tiers(self) -> TierReport | None:
        return self.worker.flush_kv_tiers()

    def shutdown(self) -> None:
        pass  # the worker is this process's memory

    def time_swap(self, num_blocks: int, repeats: int) -> tuple[int, float, float, float] | None:
        host, pool = self.worker.host_pool, self.worker.kv_pool
        if host is None:
            return None
        n = min(num_blocks, host.num_blocks, pool.num_blocks)
        pairs = [(i, i) for i in range(n)]
        host.swap_out(pairs)  # warm-up
        t_out = best_time(lambda: host.swap_out(pairs), repeats)
        t_in = best_time(lambda: host.swap_in(pairs), repeats)
        t_fixed = best_time(lambda: (host.swap_out(pairs[:1]), host.swap_in(pairs[:1])), repeats)
        return n, t_out, t_in, t_fixed

