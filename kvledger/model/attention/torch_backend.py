"""PyTorch reference attention over the paged cache (CPU first; runs anywhere torch does).

Correctness first: each request reads back only its own blocks, and queries of a chunk sit at
positions seq_len - query_len + i. Single-token decodes of all requests go to one call of the
native paged-decode kernel (kvledger.kernels.native: CPU, float32 or bfloat16 queries, the cache
unquantised or int8/fp8 codes), which reads the blocks in place in their stored format; elsewhere
they are batched into a few masked SDPA calls (grouped by context length), because a Python loop
costs more than the attention itself on small models.

Quantised caches (``layer_cache.quantized``): every key is read back dequantised from the blocks
of the requests in the step (never the whole cache), including the step's own tokens, and the
full-precision overlay is substituted for sinks and the recent window, per query: a query at
position q sees key p in full precision iff p < S or q - p < R (``kvledger.storage.kv_overlay``).
The native decode applies the same rule to the codes it reads (``_NativeDecode.fp_spans``).
A decode overwrites those rows; a prefill chunk with R > 0 attends over the dequantised context
plus the window's full-precision keys appended, with a mask that lets each query see each
position exactly once. So a token's attention does not depend on how its request was chunked,
batched or preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.kernels import native
from kvledger.kernels.gemm_rows import RowInvariance
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.storage.kv_cache import LayerKVCache
from kvledger.storage.kv_overlay import (
    Fix,
    OverlayInfo,
    Segments,
    chunk_overlay,
    decode_spans,
    overlay_writes,
)

# Batching decodes saves the per-request op overhead (~100 us per request and layer on these CPUs)
# but gathers each request's context padded to the longest in its batch, through a masked SDPA.
# Decodes are sorted by context length and cut into groups: a group grows while its padded context
# stays within _MAX_DECODE_PADDING x the real one and its gathered K + V within _MAX_GROUP_BYTES
# (past a few MiB the gathered copies fall out of cache and one big batch ran slower than the
# per-request loop; measured on bench-60m, docs/measurements/cpu_kernels.md, the issue-7 section).
_MAX_DECODE_PADDING = 1.5
_MAX_GROUP_BYTES = 4 << 20


@dataclass
class _Chunk:
    """One request attended on its own: query rows [start, end) over seq_len context tokens."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # None: no cached context, attend over this step's k/v directly
    mask: torch.Tensor | None  # [L, S] bool where the chunk follows cached context
    fix: Fix | None = None


# Prefill chunks take the native kernel (native.paged_prefill) while their rows read at most
# _NATIVE_PREFILL_MAX_READ context tokens in all (a fresh 1,024-token chunk), or, in contexts of at
# most _NATIVE_PREFILL_SHORT_CONTEXT tokens, _NATIVE_PREFILL_MAX_READ_SHORT (a fresh 2,048-token
# chunk, the default step budget). A chunk's rows read n * (2 * seq_len - n + 1) / 2, so a short
# chunk late in a long prompt reads far more than its length says. Measured
# (docs/measurements/cpu_kernels.md, the prefill attention section), native vs per-request SDPA:
# whole prefill steps of ~2,000 fresh tokens 0.64-0.90x (1 x 2,000, 2 x 1,000, 4 x 500; 60M and
# kvledger-tiny, bf16 and float32); one layer's attention of a late chunk, 60M shapes, bf16 /
# float32: 512 or 64 rows in 4,096 tokens 0.56-0.66x, 16 or 64 rows in 16,384 0.51-0.65x, but 32
# rows in 32,768 0.50x / 1.21x.
_NATIVE_PREFILL_MAX_READ = 1024 * 1025 // 2
_NATIVE_PREFILL_MAX_READ_SHORT = 2048 * 2049 // 2
_NATIVE_PREFILL_SHORT_CONTEXT = 16384


def _native_prefill_takes(query_len: int, seq_len: int) -> bool:
    """Whether a prefill chunk goes to native.paged_prefill (see _NATIVE_PREFILL_MAX_READ)."""
    reads = _prefill_reads(query_len, seq_len)
    return reads <= _NATIVE_PREFILL_MAX_READ or (
        seq_len <= _NATIVE_PREFILL_SHORT_CONTEXT and reads <= _NATIVE_PREFILL_MAX_READ_SHORT
    )


def _prefill_reads(query_len: int, seq_len: int) -> int:
    """Context tokens the rows of a prefill chunk read, each up to its own position."""
    return query_len * (2 * seq_len - query_len + 1) // 2


@dataclass
class _DecodeBatch:
    """Single-token queries of several requests, attended in one padded SDPA call."""

    rows: torch.Tensor  # [B] query row of each request
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive (0 / -inf)
    fix: Fix | None = None  # rows of the flattened [B * max_blocks * block_size] context


@dataclass
class _NativeDecode:
    """Every single-token query of the step, for native.paged_decode (blocks read in place)."""

    rows: torch.Tensor  # [B] query row of each request
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    kv_tokens: int  # sum of seq_lens: the context tokens the step's rows read
    # Quantised caches with an overlay: per request (overlay base row, sink_lo, sink_hi, win_lo,
    # self) = the positions read in full precision (csrc/paged_decode.c).
    fp_spans: torch.Tensor | None = None


@dataclass
class _NativePrefill:
    """The step's prefill chunks over an unquantised cache that _native_prefill_takes, for
    native.paged_prefill (blocks read in place)."""

    row0: torch.Tensor  # [C] first query row of each chunk
    nrows: torch.Tensor  # [C] its rows
    block_tables: torch.Tensor  # [C, max_blocks]
    seq_lens: torch.Tensor  # [C] context length at its last row
    kv_tokens: int  # the context tokens its rows read in all


@dataclass
class _Plan:
    chunks: list[_Chunk]
    decode: list[_DecodeBatch]
    native_decode: _NativeDecode | None = None
    native_prefill: _NativePrefill | None = None
    # Quantised caches: this step's rows to keep in the full-precision overlay (after attention).
    overlay_src: torch.Tensor | None = None
    overlay_dst: torch.Tensor | None = None


class TorchAttentionBackend:
    """Reference backend: decodes through the native paged-decode kernel, and prefill chunks over
    an unquantised cache that _native_prefill_takes through the native paged-prefill kernel,
    where they run; else per-request SDPA for prefill chunks and grouped padded SDPA for
    decodes."""

    def __init__(self, row_invariance: RowInvariance | None = None) -> None:
        """``row_invariance``: the model's (whether the o_proj its output feeds pads its rows);
        a backend of its own gets one that nothing sets."""
        self.row_invariance = RowInvariance() if row_invariance is None else row_invariance
        # Per-step plan, built by the first layer and reused by the others (same metadata object).
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        layer_cache.write(k, v, meta.slot_mapping)
        if window is not None or softcap is not None:
            return _attend_windowed(q, layer_cache, meta, scale, window, softcap)
        num_tokens, num_heads, head_dim = q.shape
        plan = self._get_plan(meta, q.dtype, k.shape[1] * k.shape[2], layer_cache, num_heads)
        nd, npf = plan.native_decode, plan.native_prefill
        if (
            len(plan.chunks) == 1
            and nd is None
            and npf is None
            and not plan.decode
            and plan.chunks[0].end == num_tokens
        ):
            # A lone request (the common prefill and single-stream decode): no scatter needed.
            out = self._attend_chunk(q, k, v, layer_cache, plan.chunks[0], scale)
            if plan.overlay_dst is not None:
                layer_cache.write_overlay(k, v, plan.overlay_src, plan.overlay_dst)
            return out
        # o_proj's input
        out = self.row_invariance.empty_rows(num_tokens, num_heads * head_dim, q.dtype, q.device)
        for c in plan.chunks:
            out[c.start : c.end] = self._attend_chunk(q, k, v, layer_cache, c, scale)
        if nd is not None or npf is not None:
            if q.stride(2) != 1 or q.stride(1) != head_dim:
                q = q.contiguous()  # the kernels take any row stride, heads packed
        if nd is not None:
            native.paged_decode(
                q, layer_cache, nd.block_tables, nd.seq_lens, nd.rows, out, scale, nd.fp_spans, k, v,
                nd.kv_tokens,
            )
        if npf is not None:
            native.paged_prefill(
                q, layer_cache, npf.block_tables, npf.seq_lens, npf.row0, npf.nrows, out, scale, npf.kv_tokens,
                meta.tree_mask,
            )
        num_kv_heads = k.shape[1]
        for d in plan.decode:
            bsz = d.rows.shape[0]
            kc, vc = layer_cache.read(d.block_tables)  # [B, nb, bs, K, D]
            if d.fix is not None:
                shape = kc.shape
                kc = d.fix.apply(kc.flatten(0, 2), layer_cache.overlay_k, k).view(shape)
                vc = d.fix.apply(vc.flatten(0, 2), layer_cache.overlay_v, v).view(shape)
            kc = kc.flatten(1, 2).transpose(1, 2)  # [B, K, S, D]
            vc = vc.flatten(1, 2).transpose(1, 2)
            # Fold each group's query heads into rows: K/V are never expanded for GQA.
            qd = q.index_select(0, d.rows).view(bsz, num_kv_heads, -1, head_dim)
            o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=d.mask, scale=scale)
            out.index_copy_(0, d.rows, o.reshape(bsz, num_heads * head_dim))
        if plan.overlay_dst is not None:
            # After attention: a prefill chunk's window reads ring rows that this write reuses.
            layer_cache.write_overlay(k, v, plan.overlay_src, plan.overlay_dst)
        return out

    @staticmethod
    def _attend_chunk(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: LayerKVCache,
        c: _Chunk,
        scale: float,
    ) -> torch.Tensor:
        """One request's rows → [L, H * D]."""
        _, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        query_len = c.end - c.start
        if c.block_ids is None:
            ki, vi = k[c.start : c.end], v[c.start : c.end]
        else:
            kc, vc = layer_cache.read(c.block_ids)
            ki = kc.flatten(0, 1)[: c.seq_len]
            vi = vc.flatten(0, 1)[: c.seq_len]
            if c.fix is not None:
                ki = c.fix.apply(ki, layer_cache.overlay_k, k)
                vi = c.fix.apply(vi, layer_cache.overlay_v, v)
        ki = ki.transpose(0, 1).unsqueeze(0)  # [1, K, S, D]
        vi = vi.transpose(0, 1).unsqueeze(0)
        if query_len == 1:
            # One query attends to everything; group rows per KV head (no expansion, no mask).
            qi = q[c.start : c.end].view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale)
            return o.view(1, num_heads * head_dim)
        qi = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        o = F.scaled_dot_product_attention(
            qi,
            ki,
            vi,
            attn_mask=c.mask,
            is_causal=c.mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return o[0].transpose(0, 1).reshape(query_len, num_heads * head_dim)

    def native_only(
        self, meta: AttentionMetadata, dtype: torch.dtype, kv_width: int, layer_cache: LayerKVCache, num_heads: int
    ) -> tuple[_NativeDecode | None, _NativePrefill | None] | None:
        """The step's native decode and prefill calls when its attention is nothing else (no
        SDPA chunk or group, no full-precision overlay), else None: what the native decoder
        layer (kvledger.model.fused_layer) can run in their place."""
        plan = self._get_plan(meta, dtype, kv_width, layer_cache, num_heads)
        nd = plan.native_decode
        if plan.chunks or plan.decode or plan.overlay_dst is not None or (nd is not None and nd.fp_spans is not None):
            return None
        return nd, plan.native_prefill

    def _get_plan(
        self,
        meta: AttentionMetadata,
        dtype: torch.dtype,
        kv_width: int,
        layer_cache: LayerKVCache,
        num_heads: int,
    ) -> _Plan:
        if meta is not self._plan_meta:
            use_native = native.can_paged_decode(layer_cache, num_heads, dtype)
            quant = None
            if getattr(layer_cache, "quantized", False):
                quant = OverlayInfo(
                    layer_cache.sink_tokens,
                    layer_cache.recent_tokens,
                    layer_cache.overlay_k is not None and meta.overlay_slots is not None,
                )
            self._plan = _build_plan(meta, dtype, kv_width, quant, use_native)
            self._plan_meta = meta
        assert self._plan is not None
        return self._plan


def _build_plan(
    meta: AttentionMetadata,
    dtype: torch.dtype,
    kv_width: int,
    quant: OverlayInfo | None = None,
    use_native: bool = False,
) -> _Plan:
    """Split the step into per-request chunks and the decodes: all in one _NativeDecode when
    use_native, else padded batches (_decode_groups)."""
    device = meta.slot_mapping.device
    bs = meta.block_size
    starts: list[int] = []
    pos = 0
    for n in meta.query_lens_list:
        starts.append(pos)
        pos += n

    native_decode = native_prefill = None
    overlay = quant is not None and quant.overlay
    if use_native:
        groups = []
        batched = {i for i, n in enumerate(meta.query_lens_list) if n == 1}
        # Unquantised caches: prefill chunks read from the cache this layer just wrote
        # (quantised caches keep SDPA over the chunk's full-precision rows).
        prefill = [] if quant is not None else [
            i
            for i, (n, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True))
            if n > 1 and _native_prefill_takes(n, seq_len)
        ]
        if batched:
            native_decode = _native_decode(meta, sorted(batched), starts, quant if overlay else None)
        if prefill:
            native_prefill = _native_prefill(meta, prefill, starts)
        batched.update(prefill)
    else:
        groups = _decode_groups(meta, kv_width * dtype.itemsize * 2)
        batched = {i for g in groups for i in g}

    chunks: list[_Chunk] = []
    for i, (query_len, seq_len) in enumerate(
        zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
    ):
        if query_len == 0 or i in batched:
            continue
        start = starts[i]
        if seq_len == query_len and quant is None:
            chunks.append(_Chunk(start, start + query_len, seq_len, None, None))
            continue
        num_blocks = -(-seq_len // bs)
        mask = fix = None
        if overlay:
            fix = Segments(device)
            mask = chunk_overlay(fix, meta, quant, i, start, query_len, seq_len, 0)
        if i in meta.tree_reqs:  # a token tree: the context, then the row's ancestors
            mask = _tree_mask(meta.tree_mask[start : start + query_len], seq_len)
        elif mask is None and query_len > 1 and seq_len > query_len:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        chunks.append(
            _Chunk(
                start,
                start + query_len,
                seq_len,
                meta.block_tables[i, :num_blocks],
                mask,
                fix.to_fix() if fix is not None else None,
            )
        )

    decode = [_decode_batch(meta, g, starts, dtype, quant if overlay else None) for g in groups]
    plan = _Plan(chunks, decode, native_decode, native_prefill)
    if overlay:
        plan.overlay_src, plan.overlay_dst = overlay_writes(meta, quant, starts, device)
    return plan


def _tree_mask(bits: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[L, S] bool: a tree chunk's L rows see the S - L context tokens before it and, of its
    own rows, those set in their ``bits`` (csrc/paged_prefill.c's rule, for SDPA)."""
    n = bits.shape[0]
    own = (bits[:, None] >> torch.arange(n, device=bits.device)[None, :]) & 1
    mask = torch.ones(n, seq_len, dtype=torch.bool, device=bits.device)
    mask[:, seq_len - n :] = own.bool()
    return mask


def _select_requests(
    meta: AttentionMetadata, reqs: list[int], starts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query row, block-table row and context length of each of the given single-token requests
    (indices ascending, so that all of them means the metadata's own order)."""
    device = meta.slot_mapping.device
    if len(reqs) == meta.num_reqs:  # a pure decode step: the metadata's own tensors
        rows = torch.arange(len(reqs), dtype=torch.int64, device=device)
        return rows, meta.block_tables, meta.seq_lens
    idx = torch.tensor(reqs, dtype=torch.int64, device=device)
    rows = torch.tensor([starts[i] for i in reqs], dtype=torch.int64, device=device)
    return rows, meta.block_tables.index_select(0, idx), meta.seq_lens.index_select(0, idx)


def _native_decode(
    meta: AttentionMetadata,
    decodes: list[int],
    starts: list[int],
    quant: OverlayInfo | None,
) -> _NativeDecode:
    rows, tables, seq_lens = _select_requests(meta, decodes, starts)
    spans = None if quant is None else decode_spans(meta, quant, decodes)
    kv_tokens = sum(meta.seq_lens_list[i] for i in decodes)
    return _NativeDecode(
        rows, tables.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous(), kv_tokens, spans
    )


def _native_prefill(meta: AttentionMetadata, prefill: list[int], starts: list[int]) -> _NativePrefill:
    device = meta.slot_mapping.device
    idx = torch.tensor(prefill, dtype=torch.int64, device=device)
    lens = meta.query_lens_list
    return _NativePrefill(
        torch.tensor([starts[i] for i in prefill], dtype=torch.int64, device=device),
        torch.tensor([lens[i] for i in prefill], dtype=torch.int64, device=device),
        meta.block_tables.index_select(0, idx).to(torch.int64).contiguous(),
        meta.seq_lens.index_select(0, idx).to(torch.int64).contiguous(),
        sum(_prefill_reads(lens[i], meta.seq_lens_list[i]) for i in prefill),
    )


def _decode_groups(meta: AttentionMetadata, bytes_per_token: int) -> list[list[int]]:
    """Single-token queries cut into padded batches (see _MAX_DECODE_PADDING); a request left
    alone in its group is attended on its own (no padding, no mask)."""
    bs = meta.block_size
    seq_lens = meta.seq_lens_list
    decodes = sorted(
        (i for i, n in enumerate(meta.query_lens_list) if n == 1), key=seq_lens.__getitem__
    )
    groups: list[list[int]] = []
    group: list[int] = []
    real = 0
    for i in decodes:  # ascending: the newest member sets the padded length
        padded = -(-seq_lens[i] // bs) * bs
        n = len(group) + 1
        if group and (
            n * padded > _MAX_DECODE_PADDING * (real + seq_lens[i])
            or n * padded * bytes_per_token > _MAX_GROUP_BYTES
        ):
            groups.append(group)
            group, real = [], 0
        group.append(i)
        real += seq_lens[i]
    groups.append(group)
    return [g for g in groups if len(g) > 1]


def _decode_batch(
    meta: AttentionMetadata,
    group: list[int],
    starts: list[int],
    dtype: torch.dtype,
    quant: OverlayInfo | None,
) -> _DecodeBatch:
    device = meta.slot_mapping.device
    bs = meta.block_size
    group = sorted(group)  # batch order does not matter; ascending as _select_requests wants
    max_blocks = -(-max(meta.seq_lens_list[i] for i in group) // bs)
    rows, block_tables, seq_lens = _select_requests(meta, group, starts)
    block_tables = block_tables[:, :max_blocks]
    valid = torch.arange(max_blocks * bs, device=device)[None, :] < seq_lens[:, None]
    mask = torch.zeros(valid.shape, dtype=dtype, device=device)
    mask.masked_fill_(~valid, float("-inf"))
    fix = None
    if quant is not None:
        seg = Segments(device)
        for b, i in enumerate(group):
            chunk_overlay(seg, meta, quant, i, starts[i], 1, meta.seq_lens_list[i], b * max_blocks * bs)
        fix = seg.to_fix()
    return _DecodeBatch(rows, block_tables, mask[:, None, None, :], fix)


def _attend_windowed(
    q: torch.Tensor,
    layer_cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Sliding-window and/or soft-capped attention, one request at a time (the step's k/v are
    already in the cache). A query at position p sees keys p - window < j <= p, as HF's
    sliding-window mask; only the blocks holding those keys are read, so blocks wholly outside
    every query's window may have been released. Soft-capping (Gemma 2) is HF's eager order:
    scores * scale, cap * tanh(scores / cap), mask, float32 softmax, then V."""
    if getattr(layer_cache, "quantized", False):
        raise NotImplementedError("sliding-window / soft-capped attention needs an unquantised KV cache")
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads * head_dim)
    bs = meta.block_size
    device = q.device
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
        if query_len == 0:
            continue
        p0 = seq_len - query_len
        lo = 0 if window is None else max(0, p0 - window + 1)
        b0 = lo // bs
        ids = meta.block_tables[i, b0 : -(-seq_len // bs)]
        kc, vc = layer_cache.read(ids)
        first = b0 * bs
        kc = kc.flatten(0, 1)[: seq_len - first].transpose(0, 1)  # [K, S', D]
        vc = vc.flatten(0, 1)[: seq_len - first].transpose(0, 1)
        qp = torch.arange(p0, seq_len, device=device)[:, None]
        kp = torch.arange(first, seq_len, device=device)[None, :]
        mask = kp <= qp
        if window is not None:
            mask = mask & (kp > qp - window)
        qi = q[start : start + query_len].transpose(0, 1)  # [H, L, D]
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0), attn_mask=mask,
                scale=scale, enable_gqa=num_heads != kc.shape[0],
            )[0]
        else:
            rep = num_heads // kc.shape[0]
            kr = kc.repeat_interleave(rep, dim=0)
            vr = vc.repeat_interleave(rep, dim=0)
            scores = torch.matmul(qi, kr.transpose(1, 2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(probs, vr)
        out[start : start + query_len] = o.transpose(0, 1).reshape(query_len, num_heads * head_dim)
        start += query_len
    return out
