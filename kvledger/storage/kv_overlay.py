"""The full-precision overlay of a quantised KV cache: attention sinks and the recent window.

The overlay (``OverlaySlots``): the pool always holds the quantised code of every token, so prefix
sharing, COW and swap stay block copies. Each request that runs also owns an overlay slot holding
the model-dtype K/V of its first ``S = kv_sink_tokens`` positions and a ring of its last
``R = kv_recent_tokens`` positions, in every layer. Attention reads the dequantised blocks and
substitutes those values; a token leaving the window is thereafter read through its code (KIVI's
residual). The rule is per query: a query at position ``q`` sees key ``p`` in full precision iff
``p < S`` or ``q - p < R`` (and the slot holds it), whatever the chunking of the step, so results
do not depend on batching, chunked prefill or preemption.

Two halves, one rule: ``OverlaySlots`` is the runner's bookkeeping (which slot each request owns
and which of its rows are valid, written into ``AttentionMetadata.overlay_*``), and ``Fix`` /
``chunk_overlay`` / ``overlay_writes`` / ``decode_spans`` turn that metadata into the row
substitutions every attention backend applies (torch, native decode, Triton).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvledger.model.attention.metadata import AttentionMetadata

SINK_CACHE_ENTRIES = 32  # prompts whose first S tokens' full-precision K/V are kept for prefix hits


# -- the runner's side: slots -------------------------------------------------------------------
@dataclass
class _SlotState:
    slot: int
    sink_from: int  # sink rows p in [sink_from, S) hold this request's own values (0 after a sink-cache hit)
    ring_from: int  # window rows p >= ring_from (and within the last R before hi) are valid
    hi: int  # positions < hi have been written into the slot
    # Speculative decoding: (first draft position, the ring rows its drafts overwrote, as they
    # were before); the rows of rejected drafts are put back at the next step.
    saved: tuple[int, torch.Tensor] | None = None


class OverlaySlots:
    """Which overlay slot each request owns, and what that slot holds (the runner's bookkeeping).

    A slot is taken at a request's first schedule and kept while it is swapped out *or* preempted
    by recompute (a recompute usually resumes from its own cached blocks, and the window rows just
    before the resume point exist nowhere else); it is released once the request finishes. An n > 1
    child gets a copy of its parent's slot at the fork. When every slot is held, the overlay grows
    (doubling) rather than silently dropping a request to dequantised sinks: results stay the same
    whatever the load, and the ledger's ``overlay_bytes`` shows the real size.

    Sinks on a prefix-cache hit: a request whose prompt starts in the cache did not compute its
    first S positions. Their K/V depend only on the first S tokens (causal attention), so an LRU
    table keyed by those tokens keeps full-precision sink K/V (all layers), filled by the requests
    that compute them; on a miss the dequantised values are used (counted in
    ``sink_cache_misses``). Window rows served by the prefix cache are read dequantised.
    """

    def __init__(self, pool: Any, sink_entries: int = SINK_CACHE_ENTRIES) -> None:
        self.pool = pool
        self.S = pool.sink_tokens
        self.R = pool.recent_tokens
        self.states: dict[str, _SlotState] = {}
        self.free: list[int] = list(range(pool.overlay_slots - 1, -1, -1))
        self.sink_cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.sink_entries = sink_entries
        self.sink_cache_hits = 0
        self.sink_cache_misses = 0

    @property
    def num_used(self) -> int:
        """Slots held by requests the runner has not been told have finished."""
        return len(self.states)

    @property
    def sink_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sink_cache.values())

    def release(self, request_ids: list[str]) -> None:
        """Release the slots of requests that finished."""
        for rid in request_ids:
            st = self.states.pop(rid, None)
            if st is not None:
                self.free.append(st.slot)

    def _take_slot(self) -> int:
        if not self.free:
            old = self.pool.overlay_slots
            self.pool.grow_overlay(2 * old)
            self.free = list(range(self.pool.overlay_slots - 1, old - 1, -1))
        return self.free.pop()

    def annotate(self, meta: Any, reqs: list[Any], spec: dict[str, list[int]] | None = None) -> None:
        """Give each scheduled request (``reqs``: the runner's states, with ``request_id`` and
        ``all_token_ids``) its slot and tell attention which rows the slot holds. ``spec``: the
        step's drafts (speculative decoding), whose ring rows are saved first."""
        S, R = self.S, self.R
        slots, sink_from, ring_from = [], [], []
        for req, n, end in zip(reqs, meta.query_lens_list, meta.seq_lens_list, strict=True):
            start = end - n
            st = self.states.get(req.request_id)
            if st is not None and st.saved is not None:
                self._restore_rejected(st, start)
            if st is not None and spec and req.request_id in spec and R:
                st.saved = self._save_ring(st.slot, max(S, start + 1), end)
            if st is None:
                st = _SlotState(self._take_slot(), start, start, start)
                self.states[req.request_id] = st
                if start > 0:
                    self._sinks_from_cache(st, req)
            elif start != st.hi:
                # Resumed after a recompute preemption (or from a longer cached prefix).
                if start < st.hi:
                    st.ring_from = max(st.ring_from, st.hi - R)
                    if st.ring_from > start:
                        st.ring_from = start
                    st.sink_from = min(st.sink_from, start)
                else:
                    st.ring_from = start
                    if st.hi < S and st.sink_from > 0:
                        st.sink_from = S
                        self._sinks_from_cache(st, req)
            slots.append(st.slot)
            sink_from.append(st.sink_from)
            ring_from.append(st.ring_from)
            st.hi = end
        meta.overlay_slots = slots
        meta.overlay_sink_from = sink_from
        meta.overlay_window_from = ring_from

    def _save_ring(self, slot: int, lo: int, hi: int) -> tuple[int, torch.Tensor] | None:
        """The ring rows positions [lo, hi) are about to overwrite (a step's drafts)."""
        if lo >= hi:
            return None
        S, R = self.S, self.R
        rows = [self.pool.read_overlay_rows(slot, S + p % R, S + p % R + 1) for p in range(lo, hi)]
        return lo, torch.cat(rows, dim=2).clone()

    def _restore_rejected(self, st: _SlotState, start: int) -> None:
        """After a verification: the ring rows of drafts from ``start`` on (rejected, or rolled
        back by a preemption) get back the rows they overwrote, and the slot ends there."""
        first, rows = st.saved
        st.saved = None
        S, R = self.S, self.R
        for j, p in enumerate(range(first, st.hi)):
            if p >= start:
                self.pool.write_overlay_rows(st.slot, S + p % R, rows[:, :, j : j + 1])
        st.hi = min(st.hi, max(start, first))

    def after_step(self, meta: Any, reqs: list[Any]) -> None:
        """Publish sinks a request has just finished computing to the sink cache."""
        S = self.S
        if S == 0 or self.sink_entries == 0:
            return
        for req, n, end in zip(reqs, meta.query_lens_list, meta.seq_lens_list, strict=True):
            if end - n < S <= end and len(req.all_token_ids) >= S:  # (drafts: not yet tokens)
                st = self.states[req.request_id]
                if st.sink_from != 0:
                    continue
                key = tuple(req.all_token_ids[:S])
                if key in self.sink_cache:
                    self.sink_cache.move_to_end(key)
                    continue
                self.sink_cache[key] = self.pool.read_overlay_rows(st.slot, 0, S).clone()
                if len(self.sink_cache) > self.sink_entries:
                    self.sink_cache.popitem(last=False)

    def _sinks_from_cache(self, st: _SlotState, req: Any) -> None:
        S = self.S
        if S == 0 or len(req.all_token_ids) < S:
            return
        key = tuple(req.all_token_ids[:S])
        hit = self.sink_cache.get(key)
        if hit is None:
            self.sink_cache_misses += 1
            return
        self.sink_cache.move_to_end(key)
        self.sink_cache_hits += 1
        self.pool.write_overlay_rows(st.slot, 0, hit)
        st.sink_from = 0

    def fork(self, parent_id: str, child_id: str) -> None:
        """An n > 1 child starts with a copy of its parent's slot."""
        p = self.states.get(parent_id)
        if p is None or child_id in self.states:
            return
        slot = self._take_slot()
        self.pool.copy_overlay_slot(p.slot, slot)
        self.states[child_id] = _SlotState(slot, p.sink_from, p.ring_from, p.hi)


# -- the attention side: row substitutions --------------------------------------------------
@dataclass
class Fix:
    """Full-precision substitutions into one dequantised context (quantised caches only)."""

    ctx_ov: torch.Tensor | None = None  # context rows replaced from the overlay ...
    ov: torch.Tensor | None = None  # ... by these overlay rows
    ctx_k: torch.Tensor | None = None  # context rows replaced from this step's k/v ...
    k: torch.Tensor | None = None  # ... by these rows
    ext_ov: torch.Tensor | None = None  # extra window keys appended: overlay rows ...
    ext_k: torch.Tensor | None = None  # ... then rows of this step's k/v

    def apply(self, ctx: torch.Tensor, ov: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """ctx [rows, K, D] (a fresh dequantised tensor, modified in place) -> keys or values."""
        if self.ctx_ov is not None:
            ctx.index_copy_(0, self.ctx_ov, ov.index_select(0, self.ov))
        if self.ctx_k is not None:
            ctx.index_copy_(0, self.ctx_k, new.index_select(0, self.k))
        if self.ext_ov is None and self.ext_k is None:
            return ctx
        parts = [ctx]
        if self.ext_ov is not None:
            parts.append(ov.index_select(0, self.ext_ov))
        if self.ext_k is not None:
            parts.append(new.index_select(0, self.ext_k))
        return torch.cat(parts)


@dataclass
class OverlayInfo:
    """What attention needs to know about a quantised cache's overlay."""

    sinks: int  # S
    recent: int  # R
    overlay: bool  # the cache has overlay rows and the step says which slot each request owns


class Segments:
    """Collects destination / source row indices as Python ints, made tensors once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, list[int]] = {}

    def add(self, name: str, rows) -> None:
        if rows:
            self.parts.setdefault(name, []).extend(rows)

    def get(self, name: str) -> torch.Tensor | None:
        p = self.parts.get(name)
        return None if not p else torch.tensor(p, dtype=torch.int64, device=self.device)

    def to_fix(self) -> Fix | None:
        if not self.parts:
            return None
        return Fix(*(self.get(n) for n in ("ctx_ov", "ov", "ctx_k", "k", "ext_ov", "ext_k")))


def chunk_overlay(
    seg: Segments,
    meta: AttentionMetadata,
    quant: OverlayInfo,
    i: int,
    row: int,
    query_len: int,
    seq_len: int,
    ctx_offset: int,
) -> torch.Tensor | None:
    """Full-precision substitutions for request i's context; returns the chunk's mask when the
    window needs extra keys (a prefill chunk with R > 0), else None."""
    dev = seg.device
    S, R = quant.sinks, quant.recent
    base = meta.overlay_slots[i] * (S + R)
    p0 = seq_len - query_len  # position of the chunk's first token
    # Sinks: earlier ones from the slot (if it holds them), the chunk's own from this step's k/v.
    lo, hi = max(meta.overlay_sink_from[i], 0), min(S, p0)
    seg.add("ctx_ov", range(lo + ctx_offset, hi + ctx_offset))
    seg.add("ov", range(lo + base, hi + base))
    hi = min(S, seq_len)
    seg.add("ctx_k", range(p0 + ctx_offset, hi + ctx_offset))
    seg.add("k", range(row, hi - p0 + row))
    if R == 0:
        return None
    # Window rows before the chunk that the slot's ring holds (positions >= w_lo).
    w_lo = max(S, p0 - R + 1, min(meta.overlay_window_from[i], p0))
    ring = base + S
    if query_len == 1:
        seg.add("ctx_ov", range(w_lo + ctx_offset, p0 + ctx_offset))
        seg.add("ov", [ring + p % R for p in range(w_lo, p0)])
        if p0 >= S:
            seg.add("ctx_k", (p0 + ctx_offset,))
            seg.add("k", (row,))
        return None
    e0 = min(w_lo, max(S, p0))  # extra keys cover positions [e0, seq_len)
    if e0 >= seq_len:
        return None
    seg.add("ext_ov", [ring + p % R for p in range(e0, p0)])
    seg.add("ext_k", range(max(e0, p0) - p0 + row, seq_len - p0 + row))
    q = torch.arange(p0, seq_len, device=dev)[:, None]
    kp = torch.arange(seq_len, device=dev)[None, :]
    ep = torch.arange(e0, seq_len, device=dev)[None, :]
    ctx_ok = (kp <= q) & ~((kp >= e0) & (q - kp < R))
    ext_ok = (ep <= q) & (q - ep < R)
    return torch.cat([ctx_ok, ext_ok], dim=1)


def overlay_writes(
    meta: AttentionMetadata, quant: OverlayInfo, starts: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of this step's k/v to keep in the overlay: new sink positions and the last R."""
    S, R = quant.sinks, quant.recent
    src: list[int] = []
    dst: list[int] = []
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if query_len == 0:
            continue
        p0, row, base = seq_len - query_len, starts[i], meta.overlay_slots[i] * (S + R)
        for p in range(p0, min(S, seq_len)):
            src.append(row + p - p0)
            dst.append(base + p)
        if R:
            for p in range(max(S, seq_len - R, p0), seq_len):
                src.append(row + p - p0)
                dst.append(base + S + p % R)
    return (
        torch.tensor(src, dtype=torch.int64, device=device),
        torch.tensor(dst, dtype=torch.int64, device=device),
    )


def decode_spans(meta: AttentionMetadata, info: OverlayInfo, decodes: list[int]) -> torch.Tensor:
    """The single-token case of ``chunk_overlay`` as the native decode's spans: per request
    (overlay base row, sink_lo, sink_hi, win_lo, self) = the positions read in full precision."""
    S, R = info.sinks, info.recent
    flat: list[int] = []
    for i in decodes:
        p0 = meta.seq_lens_list[i] - 1
        lo = max(meta.overlay_sink_from[i], 0)
        hi = max(lo, min(S, p0))
        if R:
            w_lo, own = max(S, p0 - R + 1, min(meta.overlay_window_from[i], p0)), 1
        else:
            w_lo, own = p0, int(p0 < S)
        flat += (meta.overlay_slots[i] * (S + R), lo, hi, w_lo, own)
    return torch.tensor(flat, dtype=torch.int64).view(len(decodes), 5)
