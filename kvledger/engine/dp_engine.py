"""``kvledger serve --data-parallel-size N``: N engine cores (processes, each with its own KV
pool) behind the one HTTP front end, each request dispatched by ``kvledger.router.policy``
(``--dp-routing``) from the cores' own KV events.

Each core publishes its events on its own endpoint (vLLM's rule: the configured TCP port plus
the rank; an ipc path gets ``-dp<rank>``; with events not configured and ``cache_aware``
routing, they are turned on over private ipc sockets). A core that dies is taken out of
rotation: its in-flight requests fail with an error naming it, the others keep serving, and
``/health`` stays 200 while one lives. ``/v1/ledger`` gives the total and ``replicas``.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from typing import Any

from kvledger.cache.kv_events import KVEventsConfig
from kvledger.engine.async_core_engine import AsyncCoreEngine, start_cores
from kvledger.engine.core_client import EngineCoreClient
from kvledger.errors import ConfigError, EngineDeadError
from kvledger.router.policy import NoReplicaError, Router

# /v1/ledger keys that are a property of the pool's layout, the same on every replica
_SAME = {"block_size", "bytes_per_token", "bytes_per_block", "scale_bytes_per_token",
         "overlay_bytes_per_request", "kv_cache_dtype", "device"}  # fmt: skip


def rank_events_config(cfg: KVEventsConfig | None, rank: int, private_dir: str | None) -> KVEventsConfig | None:
    """Core ``rank``'s events config: its own endpoints; ``private_dir``: turn events on there."""
    if cfg is None or not cfg.enable_kv_cache_events:
        if private_dir is None:
            return cfg
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=f"ipc://{private_dir}/kv-events-dp{rank}",
                              replay_endpoint=f"ipc://{private_dir}/kv-replay-dp{rank}")  # fmt: skip

    def shift(ep: str | None) -> str | None:
        if ep is None:
            return None
        m = re.match(r"^(tcp://.*:)(\d+)$", ep)
        if m:
            return f"{m.group(1)}{int(m.group(2)) + rank}"
        return f"{ep}-dp{rank}"

    return dataclasses.replace(cfg, endpoint=shift(cfg.endpoint), replay_endpoint=shift(cfg.replay_endpoint))


def sum_ledgers(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' ledgers as one pool: counts summed, fractions recomputed."""
    total: dict[str, Any] = {}
    for k, v in parts[0].items():
        vals = [p.get(k) for p in parts]
        if k in _SAME or isinstance(v, str) or v is None:
            total[k] = v
        elif isinstance(v, bool):
            total[k] = all(vals)
        elif isinstance(v, int | float):
            total[k] = sum(x or 0 for x in vals)
        elif isinstance(v, dict) and all(isinstance(x, int | float) for x in v.values()):
            total[k] = {kk: sum((p.get(k) or {}).get(kk, 0) for p in parts) for kk in v}
        elif isinstance(v, dict):
            total[k] = {kk: vv for p in parts for kk, vv in (p.get(k) or {}).items()}
        else:
            total[k] = v
    if total.get("total_blocks"):
        total["usage"] = total["used_blocks"] / total["total_blocks"]
    slots = total.get("used_blocks", 0) * total.get("block_size", 0)
    if "utilization" in total:
        total["utilization"] = total["tokens_stored"] / slots if slots else None
    return total


class DataParallelEngine(AsyncCoreEngine):
    def __init__(self, clients: list[EngineCoreClient], tokenizer: Any, router: Router,
                 events: list[KVEventsConfig | None], observer: Any = None) -> None:  # fmt: skip
        super().__init__(clients, tokenizer, observer)
        self.router = router
        self._events = events
        self._subs: list[Any] = []
        self._zctx: Any = None

    @classmethod
    def launch_dp(
        cls,
        config: Any,
        num_engines: int,
        routing: str = "cache_aware",
        torch_threads: int | None = None,
        observer: Any = None,
    ) -> DataParallelEngine:
        if num_engines < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {num_engines}")
        private = tempfile.mkdtemp(prefix="kvledger-dp-") if routing == "cache_aware" else None
        events = [rank_events_config(config.kv_events_config, r, private) for r in range(num_engines)]
        router = Router(num_engines, routing, config.cache.block_size, config.cache.prefix_caching_hash_algo)
        configs = [dataclasses.replace(config, kv_events_config=events[r], data_parallel_rank=r)
                   for r in range(num_engines)]
        clients, tokenizer = start_cores(configs, torch_threads)
        return cls(clients, tokenizer, router, events, observer)

    # -- lifecycle
    def start(self) -> None:
        if self._loop is not None:
            return
        super().start()
        if self.router.policy == "cache_aware":
            import zmq.asyncio

            from kvledger.router.subscriber import EventSubscriber

            self._zctx = zmq.asyncio.Context()
            for r, ev in enumerate(self._events):
                if ev is not None and ev.enable_kv_cache_events:
                    s = EventSubscriber(self._zctx, ev.endpoint, self.router.replicas[r].index,
                                        ev.replay_endpoint, ev.topic)  # fmt: skip
                    s.start()
                    self._subs.append(s)

    def shutdown(self, timeout: float = 10.0) -> None:
        for s in self._subs:
            s.close()
        super().shutdown(timeout)
        if self._zctx is not None:
            self._zctx.term()

    @property
    def is_running(self) -> bool:
        return self._loop is not None and any(c.is_alive for c in self.clients)

    # -- dispatch
    def choose_engine(self, prompt_token_ids: list[int], request_id: str | None = None, params: Any = None) -> int:
        try:
            d = self.router.choose(prompt_token_ids)
        except NoReplicaError as e:
            raise EngineDeadError(str(e)) from None
        if request_id is not None:
            max_tokens = getattr(params, "max_tokens", None) or 16
            self.router.dispatched(request_id, d, prompt_token_ids, max_tokens)
        return d.rank

    def _release(self, request_id: str) -> int | None:
        self.router.finished(request_id)
        return super()._release(request_id)

    def _dispatch(self, outs: list[Any]) -> None:
        for out in outs:
            if not out.finished and any(o.token_ids for o in out.outputs):
                self.router.prefilled(out.request_id)
        super()._dispatch(outs)

    def _on_dead(self, index: int, error: BaseException) -> None:  # reader thread
        named = EngineDeadError(f"data-parallel replica {index} died ({error}); it is out of rotation")
        self._post(self._replica_died, index, named)

    def _replica_died(self, index: int, error: BaseException) -> None:
        self.router.mark_dead(index)
        if not any(c.is_alive for c in self.clients):
            self.dead = error
        self._fail(error, index)

    # -- reads
    async def query(self, name: str, *args: Any, engine_index: int | None = None) -> Any:
        """A named read of one core; with no index: "metrics_state" of every live core (a
        list: /metrics gives each under vLLM's ``engine`` label and the total), anything
        else of the first live core."""
        if engine_index is not None:
            return await super().query(name, *args, engine_index=engine_index)
        alive = [i for i, c in enumerate(self.clients) if c.is_alive]
        if not alive:
            raise EngineDeadError("no data-parallel replica is alive")
        if name == "metrics_state":
            return [await AsyncCoreEngine.query(self, name, *args, engine_index=i) for i in alive]
        return await super().query(name, *args, engine_index=alive[0])

    async def ledger(self, engine_index: int | None = None) -> dict[str, Any]:
        if engine_index is not None:
            return await super().query("ledger", engine_index=engine_index)
        parts = [await AsyncCoreEngine.query(self, "ledger", engine_index=i) for i, c in enumerate(self.clients) if c.is_alive]
        total = sum_ledgers(parts)
        total["replicas"] = [{"rank": i, "alive": c.is_alive, "pid": c.proc.pid} for i, c in enumerate(self.clients)]
        alive = iter(parts)
        for rep in total["replicas"]:
            if rep["alive"]:
                rep["ledger"] = {k: v for k, v in next(alive).items() if k != "requests"}
        return total
