"""The engine's statistics as plain data (as vLLM's ``v1/metrics/stats.py``): captured in the
process that owns the engine, between steps, and read by whoever reports them.

``capture_stats`` runs where the engine is (the engine thread, or an engine core process, as
the named query ``"metrics_state"`` of ``engine_info``); ``EngineStats`` crosses the process
boundary by pickle; the HTTP server's Prometheus collector (``kvledger/server/metrics.py``)
only formats it. Nothing here imports the server, prometheus or torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.core.engine import LLMEngine


@dataclass
class EngineStats:
    """What a scrape reads from the engine, captured in one go between two steps."""

    usage: float = 0.0
    used_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    generation_tokens: int = 0
    # Speculative decoding (vLLM's SpecDecodingStats; zero when off).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: dict[int, int] = field(default_factory=dict)
    # Per tensor-parallel rank (one entry on one device): the real pool, and what it holds now.
    rank_pool_bytes: list[int] = field(default_factory=list)
    rank_used_bytes: list[int] = field(default_factory=list)
    # The tiered prefix cache's counters (KVTiers.flat_stats; empty when off).
    tiers: dict[str, float] = field(default_factory=dict)


def capture_stats(engine: LLMEngine) -> EngineStats:
    """The live engine's statistics: its ledger snapshot and its scheduler's queues."""
    snap = engine.ledger()
    s = engine.scheduler
    return EngineStats(
        usage=snap.usage,
        used_blocks=snap.used_blocks,
        free_blocks=snap.free_blocks,
        cached_blocks=snap.cached_blocks,
        running=len(s.running),
        waiting=len(s.waiting),
        swapped=len(s.swapped),
        prefix_cache_queries=snap.prefix_cache_queries,
        prefix_cache_hits=snap.prefix_cache_hits,
        preemptions=dict(snap.preemptions),
        swap_out_bytes=snap.swap_out_bytes,
        swap_in_bytes=snap.swap_in_bytes,
        generation_tokens=engine.num_generated_tokens,
        **_spec_stats(snap.speculation, engine),
        rank_pool_bytes=[r["device_pool_bytes"] for r in snap.ranks] or [snap.device_pool_bytes],
        rank_used_bytes=[r["used_bytes"] for r in snap.ranks] or [snap.used_bytes],
        tiers=engine.kv.tiers.flat_stats() if engine.kv.tiers is not None else {},
    )


def _spec_stats(row: dict | None, engine: LLMEngine) -> dict:
    if row is None:
        return {}
    per_pos = engine.scheduler.speculator.stats.num_accepted_tokens_per_pos
    return {
        "spec_num_drafts": row["num_drafts"],
        "spec_num_draft_tokens": row["num_draft_tokens"],
        "spec_num_accepted_tokens": row["num_accepted_tokens"],
        "spec_accepted_per_pos": dict(enumerate(per_pos)),
    }


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Data-parallel replicas as one engine: counts summed, usage recomputed."""
    total = EngineStats()
    for s in stats:
        for f in dataclasses.fields(EngineStats):
            v = getattr(s, f.name)
            if isinstance(v, dict):
                acc = getattr(total, f.name)
                for k, x in v.items():
                    acc[k] = acc.get(k, 0) + x
            elif f.name != "usage":
                setattr(total, f.name, getattr(total, f.name) + v)
    blocks = total.used_blocks + total.free_blocks
    total.usage = total.used_blocks / blocks if blocks else 0.0
    return total
