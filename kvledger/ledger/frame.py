"""One dashboard frame: the block map, the seeds' totals and the request table, as plain JSON.

Captured in one go from a scheduler and its KV cache manager (the engine thread for the live
server, the simulator's loop for ``simulate --html``), so every figure in a frame describes the
same instant. Frames and series points are plain dicts of numbers and strings: they can cross
a process boundary as JSON unchanged.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvledger.ledger.block_map import PoolState, build_block_map
from kvledger.ledger.snapshot import LedgerSnapshot

SERIES_KEYS = ("t", "usage", "used", "running", "waiting", "swapped", "tokens", "swap", "recompute")


def ledger_body(snap: LedgerSnapshot, scheduler: Any) -> dict[str, Any]:
    """What ``GET /v1/ledger`` reports (``LedgerSnapshot.to_dict()`` and the queue sizes)."""
    d = snap.to_dict()
    d["num_requests"] = {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "swapped": len(scheduler.swapped),
    }
    return d


def totals(snap: LedgerSnapshot, max_model_len: int, reference_bytes_per_token: int) -> dict:
    """The seeds' figures for this instant.

    - paged vs naive: tokens stored / token slots in used blocks, against what reserving
      ``max_model_len`` contiguously per device-resident request would give (and how many
      requests such pre-allocation could hold in this pool at all);
    - sharing: device blocks that prefix sharing / forks saved (holders beyond the first);
    - quantisation: bytes the stored tokens save against the model dtype's KV bytes per token,
      less the full-precision overlay and sink cache that quantised formats reserve; and how
      many more tokens the same bytes hold.
    """
    bpt, bpb, bs = snap.bytes_per_token, snap.bytes_per_block, snap.block_size
    resident = [r for r in snap.requests.values() if r.blocks > 0]
    naive_tokens = sum(r.num_tokens for r in resident)
    holders_of_shared = sum(r.shared_blocks for r in snap.requests.values())
    saved_blocks = max(0, holders_of_shared - snap.shared_blocks)
    pool_tokens = snap.total_blocks * bs
    ref = reference_bytes_per_token or bpt
    q = snap.prefix_cache_queries
    # Quantised formats keep sinks and a recent window per request in the model dtype, outside
    # the blocks but inside the same budget: that overlay (and the sink cache) is the cost.
    gross = (ref - bpt) * snap.tokens_stored
    overhead = snap.overlay_bytes + snap.sink_cache_bytes if ref != bpt else 0
    return {
        "bytes_per_token": bpt,
        "bytes_per_block": bpb,
        "block_size": bs,
        "kv_cache_dtype": snap.kv_cache_dtype,
        "pool_bytes": snap.total_bytes,
        "pool_tokens": pool_tokens,
        "used_bytes": snap.used_bytes,
        "tokens_stored": snap.tokens_stored,
        "paged_utilization": snap.utilization if snap.used_blocks else None,
        "naive_utilization": naive_tokens / (len(resident) * max_model_len) if resident else None,
        "max_model_len": max_model_len,
        "resident_requests": len(resident),
        "naive_max_requests": pool_tokens // max_model_len,
        # The same quantity paged: how many requests of the resident ones' mean footprint in
        # device blocks (shared blocks counted once, as the pool holds them) the pool holds.
        "paged_max_requests": snap.total_blocks * len(resident) // snap.used_blocks
        if resident and snap.used_blocks
        else None,
        "mean_resident_tokens": naive_tokens / len(resident) if resident else None,
        "sharing_saved_blocks": saved_blocks,
        "sharing_saved_bytes": saved_blocks * bpb,
        "prefix_cache_hit_tokens": snap.prefix_cache_hits,
        "prefix_cache_hit_rate": snap.prefix_cache_hits / q if q else None,
        "reference_bytes_per_token": ref,
        "quantization_saved_bytes": gross - overhead,
        "quantization_gross_saved_bytes": gross,
        "quantization_overhead_bytes": overhead,
        "quantization_capacity_ratio": pool_tokens * ref / (snap.total_bytes + snap.overlay_bytes)
        if snap.total_bytes
        else None,
        "preemptions": dict(snap.preemptions),
        "swap_out_bytes": snap.swap_out_bytes,
        "swap_in_bytes": snap.swap_in_bytes,
        "cow_copies": snap.cow_copies,
        "tiers": snap.tiers,  # the prefix cache's host and disk tiers (None: off)
    }


def request_rows(snap: LedgerSnapshot, scheduler: Any, max_rows: int = 64) -> list[dict]:
    """Running, waiting and swapped requests (at most ``max_rows`` of each), with what each
    holds: tokens, device blocks and their bytes, blocks shared with others, host blocks."""
    rows = []
    bpb = snap.bytes_per_block
    for state, queue in (
        ("running", scheduler.running),
        ("swapped", scheduler.swapped),
        ("waiting", scheduler.waiting),
    ):
        for i, req in enumerate(queue):
            if i >= max_rows:
                break
            rb = snap.requests.get(req.request_id)
            blocks = rb.blocks if rb else 0
            rows.append(
                {
                    "id": req.request_id,
                    "state": state,
                    "prompt_tokens": req.num_prompt_tokens,
                    "output_tokens": req.num_output_tokens,
                    "kv_tokens": rb.num_tokens if rb else 0,
                    "blocks": blocks,
                    "shared_blocks": rb.shared_blocks if rb else 0,
                    "swapped_blocks": rb.swapped_blocks if rb else 0,
                    "bytes": blocks * bpb,
                    "preemptions": req.num_preemptions,
                }
            )
    return rows


def capture_frame_parts(
    scheduler: Any,
    snap: LedgerSnapshot,
    *,
    time: float,
    max_model_len: int,
    reference_bytes_per_token: int = 0,
    max_rows: int = 64,
) -> tuple[dict[str, Any], PoolState]:
    """A frame less its block map, and the raw pool state to build the map from (anywhere,
    later: ``build_block_map``). ``snap`` must come from ``scheduler.kv`` at the same instant."""
    ledger = ledger_body(snap, scheduler)
    ledger.pop("requests")  # the request table below carries them
    frame = {
        "time": time,
        "ledger": ledger,
        "totals": totals(snap, max_model_len, reference_bytes_per_token),
        "requests": request_rows(snap, scheduler, max_rows),
    }
    return frame, PoolState.capture(scheduler.kv)


def capture_frame(
    scheduler: Any,
    snap: LedgerSnapshot,
    *,
    time: float,
    max_model_len: int,
    reference_bytes_per_token: int = 0,
    max_cells: int = 2048,
    max_rows: int = 64,
) -> dict[str, Any]:
    """A whole frame, block map included."""
    frame, pool = capture_frame_parts(
        scheduler,
        snap,
        time=time,
        max_model_len=max_model_len,
        reference_bytes_per_token=reference_bytes_per_token,
        max_rows=max_rows,
    )
    frame["block_map"] = build_block_map(pool, max_cells)
    return frame


def series_point(scheduler: Any, time: float, generated_tokens: int) -> dict[str, float]:
    """The time-series sample: O(1), cheap enough to take every step or every 0.5 s."""
    kv = scheduler.kv
    pool = kv.pool
    pre = scheduler.num_preemptions
    return {
        "t": time,
        "usage": pool.num_used_blocks / pool.num_blocks,
        "used": pool.num_used_blocks,
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "swapped": len(scheduler.swapped),
        "tokens": generated_tokens,  # cumulative; the page differentiates it into tokens/s
        "swap": pre.get("swap", 0),
        "recompute": pre.get("recompute", 0),
    }


class SeriesHistory:
    """The last ``maxlen`` series points (the live page's charts start from these)."""

    def __init__(self, maxlen: int = 600) -> None:
        self.points: deque[dict[str, float]] = deque(maxlen=maxlen)

    def add(self, point: dict[str, float]) -> None:
        self.points.append(point)

    def since(self, t: float | None) -> list[dict[str, float]]:
        if t is None:
            return list(self.points)
        return [p for p in self.points if p["t"] > t]
