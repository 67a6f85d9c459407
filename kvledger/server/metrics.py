"""Prometheus metrics in the server's own CollectorRegistry, twice: kvledger's ledger series
under ``kvledger:``, and the series vLLM users' dashboards and autoscalers read under vLLM's
own names, types, buckets and labels (``vllm:...``, labels ``model_name`` and ``engine``).

Gauges and engine counters (KV usage, queues, prefix cache, preemptions, swap traffic,
generated tokens) are read from the live ledger at scrape time, so /metrics can never drift
from /v1/ledger: the engine side captures them as plain data (``kvledger.engine.stats``, the
named query "metrics_state"), this module only formats them. Request-level counters and latency histograms are recorded as outputs pass
through the engine thread (AsyncEngine's observer hooks).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvledger.engine.stats import EngineStats, sum_stats
from kvledger.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
# vLLM's current defaults (vllm/v1/metrics/buckets.py), for the vllm:* histograms.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
ENGINE_INDEX = "0"  # vLLM's ``engine`` label of a single-engine server (with -dp N: 0..N-1)


@dataclass
class _EngineSeries:
    """One engine's children of vLLM's request-level series."""

    prompt_tokens: Any
    success: dict[str, Any]
    ttft: Any
    itl: Any
    e2e: Any


class _EngineCollector:
    """``state``: one engine's, or a list (data-parallel replicas: kvledger:* series give the
    total, vllm:* series one sample per replica under its ``engine`` label, as vLLM's)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.state: EngineStats | list[EngineStats] = EngineStats()

    def describe(self):
        return list(self._families(EngineStats(), with_samples=False))

    def collect(self):
        s = self.state
        states = s if isinstance(s, list) else [s]
        return list(self._families(sum_stats(states) if isinstance(s, list) else s, True, states))

    def _families(self, s: EngineStats, with_samples: bool, per_engine: list[EngineStats] | None = None):
        m = self.model_name
        gauges = [
            (
                "kv_cache_usage_perc",
                "KV-cache usage: used blocks / total blocks (1 = 100%).",
                s.usage,
            ),
            ("num_requests_running", "Sequences in the running batch.", s.running),
            ("num_requests_waiting", "Sequences waiting to be admitted.", s.waiting),
            ("num_requests_swapped", "Sequences swapped out to host memory.", s.swapped),
            ("kv_blocks_used", "KV blocks held by requests.", s.used_blocks),
            ("kv_blocks_free", "KV blocks free and empty.", s.free_blocks),
            (
                "kv_blocks_cached",
                "KV blocks free but holding reusable prefix content.",
                s.cached_blocks,
            ),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"kvledger:{name}", doc, labels=["model_name"])
            if with_samples:
                g.add_metric([m], value)
            yield g
        counters = [
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens served from the prefix cache.",
                s.prefix_cache_hits,
            ),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(f"kvledger:{name}", doc, labels=["model_name"])
            if with_samples:
                c.add_metric([m], value)
            yield c
        per_rank = [
            ("kv_rank_pool_bytes", "Bytes of a tensor-parallel rank's KV pool (rank 0 alone on one device).",
             s.rank_pool_bytes),
            ("kv_rank_used_bytes", "Bytes of a rank's KV pool held by requests (its heads of the used blocks).",
             s.rank_used_bytes),
        ]
        for name, doc, values in per_rank:
            g = GaugeMetricFamily(f"kvledger:{name}", doc, labels=["model_name", "rank"])
            if with_samples:
                for rank, v in enumerate(values):
                    g.add_metric([m, str(rank)], v)
            yield g
        g = GaugeMetricFamily(
            "kvledger:kv_model_used_bytes",
            "KV bytes held by requests over all ranks (a replicated KV head counts on each).",
            labels=["model_name"],
        )
        if with_samples:
            g.add_metric([m], sum(s.rank_used_bytes))
        yield g
        c = CounterMetricFamily(
            "kvledger:num_preemptions", "Preemptions, by mode.", labels=["model_name", "mode"]
        )
        if with_samples:
            for mode in ("swap", "recompute"):
                c.add_metric([m, mode], s.preemptions.get(mode, 0))
        yield c
        yield from self._vllm_families(s, with_samples, per_engine)
        c = CounterMetricFamily(
            "kvledger:swapped_bytes",
            "KV bytes moved between device and host, by direction.",
            labels=["model_name", "direction"],
        )
        if with_samples:
            c.add_metric([m, "out"], s.swap_out_bytes)
            c.add_metric([m, "in"], s.swap_in_bytes)
        yield c
        yield from _tier_families(m, s.tiers, with_samples)


    def _vllm_families(self, s: EngineStats, with_samples: bool, per_engine: list[EngineStats] | None = None):
        """The scheduler and cache series under vLLM's names (gauges and counters), one
        sample per engine (data-parallel replica) under the ``engine`` label."""
        labels = ["model_name", "engine"]
        engines = list(enumerate(per_engine)) if per_engine is not None else [(int(ENGINE_INDEX), s)]
        gauges = [
            ("num_requests_running", "Number of requests in model execution batches.", lambda e: e.running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", lambda e: e.waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda e: e.usage),
        ]
        for name, doc, get in gauges:
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
            if with_samples:
                for i, e in engines:
                    g.add_metric([self.model_name, str(i)], get(e))
            yield g
        counters = [
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             lambda e: e.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             lambda e: e.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemption from the engine.",
             lambda e: sum(e.preemptions.values())),
            ("generation_tokens", "Number of generation tokens processed.", lambda e: e.generation_tokens),
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", lambda e: e.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", lambda e: e.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             lambda e: e.spec_num_accepted_tokens),
        ]  # fmt: skip
        for name, doc, get in counters:
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=labels)
            if with_samples:
                for i, e in engines:
                    c.add_metric([self.model_name, str(i)], get(e))
            yield c
        c = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labels, "position"],
        )
        if with_samples:
            for i, e in engines:
                for pos, n in sorted(e.spec_accepted_per_pos.items()):
                    c.add_metric([self.model_name, str(i), str(pos)], n)
        yield c


_TIER_GAUGES = (
    ("blocks", "KV blocks the tier of the prefix cache holds."),
    ("bytes", "Bytes of KV blocks the tier holds."),
    ("capacity_bytes", "The tier's byte budget (LRU beyond it)."),
)
_TIER_COUNTERS = (
    ("hits", "Prefix blocks loaded from the tier into the device pool."),
    ("stored", "KV blocks stored into the tier."),
)


def _tier_families(m: str, t: dict[str, float], with_samples: bool):
    """The tiered prefix cache (kvledger/cache/kv_tiers.py): vLLM's external prefix-cache
    counters (its KV connector's; here: tokens looked up past the device hit, tokens served by
    a lower tier) and per-tier series, labelled ``tier`` (host | disk)."""
    for name, doc, key in (
        ("external_prefix_cache_queries", "External prefix cache queries from KV connector, in tokens.", "query_tokens"),
        ("external_prefix_cache_hits", "External prefix cache hits from KV connector, in tokens.", "hit_tokens"),
    ):  # fmt: skip
        c = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name", "engine"])
        if with_samples and t:
            c.add_metric([m, ENGINE_INDEX], t.get(key, 0))
        yield c
    for kind, table in ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS)):
        for name, doc in table:
            fam = kind(f"kvledger:kv_tier_{name}", doc, labels=["model_name", "tier"])
            if with_samples and t:
                for tier in ("host", "disk"):
                    fam.add_metric([m, tier], t.get(f"{tier}_{name}", 0))
            yield fam
    for unit in ("bytes", "seconds"):
        c = CounterMetricFamily(
            f"kvledger:kv_tier_transfer_{unit}",
            f"{unit.capitalize()} of block transfers to (store) and from (load) each tier.",
            labels=["model_name", "tier", "direction"],
        )
        if with_samples and t:
            for tier in ("host", "disk"):
                for d in ("store", "load"):
                    c.add_metric([m, tier, d], t.get(f"traffic_{tier}_{d}_{unit}", 0))
        yield c


class ServerMetrics:
    """The registry, plus the AsyncEngine observer hooks that feed its request metrics."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            "kvledger:prompt_tokens", "Prompt tokens of accepted requests.", labels,
            registry=self.registry,
        )  # fmt: skip
        self.request_success = Counter(
            "kvledger:request_success",
            "Finished completions, by finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvledger:time_to_first_token_seconds",
            "Arrival to first token, server side.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvledger:inter_token_latency_seconds",
            "Time between successive output steps of a request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self._vllm_request_metrics()
        self._last: dict[str, tuple[int, float]] = {}  # request -> (tokens seen, last token time)
        self._render_lock = threading.Lock()

    def _vllm_request_metrics(self) -> None:
        """vLLM's request-level series, labelled by the engine (data-parallel rank) that served
        each request: its children are made per engine on first use."""
        labels, reg = ["model_name", "engine"], self.registry
        self._v_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        )
        self._v_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._v_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=VLLM_TTFT_BUCKETS,
            registry=reg,
        )
        self._v_itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=VLLM_ITL_BUCKETS,
            registry=reg,
        )
        self._v_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=VLLM_LATENCY_BUCKETS,
            registry=reg,
        )
        self._v_engines: dict[int, _EngineSeries] = {}
        self._v(int(ENGINE_INDEX))  # engine 0's series exist (at zero) before any request

    def _v(self, engine_index: int) -> _EngineSeries:
        series = self._v_engines.get(engine_index)
        if series is None:
            values = (self.model_name, str(engine_index))
            series = self._v_engines[engine_index] = _EngineSeries(
                prompt_tokens=self._v_prompt_tokens.labels(*values),
                success={r: self._v_success.labels(*values, r) for r in VLLM_FINISH_REASONS},
                ttft=self._v_ttft.labels(*values),
                itl=self._v_itl.labels(*values),
                e2e=self._v_e2e.labels(*values),
            )
        return series

    # -- AsyncEngine observer (engine thread) ------------------------------------------------
    def on_request_added(self, num_prompt_tokens: int, engine_index: int = 0) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self._v(engine_index).prompt_tokens.inc(num_prompt_tokens)

    def on_outputs(self, outputs: list[RequestOutput], engine_index: int = 0) -> None:
        m = self.model_name
        v = self._v(engine_index)
        for out in outputs:
            met = out.metrics
            num_tokens = met.num_generation_tokens if met is not None else 0  # outputs may be deltas
            prev = self._last.get(out.request_id)
            if met is not None and met.last_token_time is not None and num_tokens:
                if prev is None:
                    if met.first_token_time is not None:
                        self.ttft.labels(m).observe(met.first_token_time - met.arrival_time)
                        v.ttft.observe(met.first_token_time - met.arrival_time)
                elif num_tokens > prev[0]:
                    self.itl.labels(m).observe(met.last_token_time - prev[1])
                    v.itl.observe(met.last_token_time - prev[1])
                self._last[out.request_id] = (num_tokens, met.last_token_time)
            if out.finished:
                self._last.pop(out.request_id, None)
                # a pooling output (one vector, no completions) finished when it was pooled
                reasons = (
                    [c.finish_reason for c in out.outputs] if isinstance(out.outputs, list)
                    else ["stop" if out.outputs.data else "abort"]
                )  # fmt: skip
                for finish in reasons:
                    self.request_success.labels(m, finish or "abort").inc()
                    v.success[finish if finish in v.success else "abort"].inc()
                if met is not None:
                    end = met.finished_time or met.last_token_time
                    if end is not None:
                        v.e2e.observe(end - met.arrival_time)

    # -- scrape ----------------------------------------------------------------------------
    def render(self, state: EngineStats | list[EngineStats]) -> bytes:
        with self._render_lock:
            self._engine.state = state
            return generate_latest(self.registry)
