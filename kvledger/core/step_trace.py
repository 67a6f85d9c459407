"""A line per engine step, for explaining latency tails: when the step ran, how long it took,
and what it carried (prefill tokens, decodes). Client-side inter-token and first-token
percentiles are set by a handful of long steps; this says which ones they were.

Off unless ``KVLEDGER_STEP_TRACE`` names a file; each engine that runs steps (the engine core
process of a server) appends JSON lines to it. Steps are kept in memory and written when the engine
runs out of work (the end of a load) or every FLUSH_STEPS steps, so the trace adds no file write to
a busy step loop (in-process, the tiny model's 8-request decode step took the same time with and
without it; docs/measurements/serving_vs_vllm.md, "Which steps make the tails"). Times are
``time.monotonic()`` (CLOCK_MONOTONIC, shared by the processes of one machine, so a client can place
the steps against its own requests).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kvledger import envs

if TYPE_CHECKING:
    from kvledger.core.sched_output import SchedulerOutput

ENV = "KVLEDGER_STEP_TRACE"
FLUSH_STEPS = 4096


class StepTrace:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a")  # noqa: SIM115 - open for the engine's lifetime
        self._steps: list[tuple[float, float, int, int]] = []

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = envs.KVLEDGER_STEP_TRACE
        return cls(path) if path else None

    @staticmethod
    def composition(so: SchedulerOutput, requests: dict) -> tuple[int, int]:
        """(prefill tokens, decodes) of a scheduled step, before it runs: a decode is one new
        token at the end of a request whose every earlier token is computed."""
        prefill = decodes = 0
        for rid, n, computed in so.batch():
            if n == 1 and computed == requests[rid].num_tokens - 1:
                decodes += 1
            else:
                prefill += n
        return prefill, decodes

    def record(self, start: float, end: float, composition: tuple[int, int], idle: bool) -> None:
        """One step: [start, end) of its model execution and output processing; ``idle``: the
        engine has nothing left to run, so the kept steps are written now."""
        self._steps.append((start, end, *composition))
        if idle or len(self._steps) >= FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        keys = ("start", "end", "prefill_tokens", "decodes")
        self._f.write("".join(json.dumps(dict(zip(keys, st, strict=True))) + "\n" for st in self._steps))
        self._f.flush()
        self._steps.clear()

    def close(self) -> None:
        self.flush()
        self._f.close()
