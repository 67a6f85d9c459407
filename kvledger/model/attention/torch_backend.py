"""PyTorch reference attention over the paged cache (CPU first; runs anywhere torch does).

Correctness first: each request reads back only its own blocks, and queries of a chunk sit at
positions seq_len - query_len + i. Single-token decodes of many requests are batched into one
masked SDPA call, because a Python loop costs more than the attention itself on small models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.kv_cache import LayerKVCache

# Batching decodes saves the per-request op overhead (tens of microseconds per request and
# layer) but gathers every request's context padded to the longest one, through a masked SDPA.
# Measured on CPU (1 thread, stories260k up to 128-dim heads): the batch wins while each
# request's padded context is small (<= 32K elements of K) and loses to the loop above that,
# so batch only while the padding stays under 2x and the padded context under 32K elements.
_MAX_DECODE_PADDING = 2.0
_MAX_BATCHED_CONTEXT = 32768


@dataclass
class _Chunk:
    """One request attended on its own: query rows [start, end) over seq_len context tokens."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # None: no cached context, attend over this step's k/v directly
    mask: torch.Tensor | None  # [L, S] bool where the chunk follows cached context


@dataclass
class _DecodeBatch:
    """Single-token queries of several requests, attended in one padded SDPA call."""

    rows: torch.Tensor  # [B] query row of each request
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive (0 / -inf)


@dataclass
class _Plan:
    chunks: list[_Chunk]
    decode: _DecodeBatch | None


class TorchAttentionBackend:
    """Reference backend: per-request SDPA for prefill chunks, one batched SDPA for decodes."""

    def __init__(self) -> None:
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
    ) -> torch.Tensor:
        layer_cache.write(k, v, meta.slot_mapping)
        plan = self._get_plan(meta, q.dtype, k.shape[1] * k.shape[2])
        num_tokens, num_heads, head_dim = q.shape
        if len(plan.chunks) == 1 and plan.decode is None and plan.chunks[0].end == num_tokens:
            # A lone request (the common prefill and single-stream decode): no scatter needed.
            return self._attend_chunk(q, k, v, layer_cache, plan.chunks[0], scale)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        for c in plan.chunks:
            out[c.start : c.end] = self._attend_chunk(q, k, v, layer_cache, c, scale)
        if plan.decode is not None:
            d = plan.decode
            bsz = d.rows.shape[0]
            num_kv_heads = k.shape[1]
            kc, vc = layer_cache.read(d.block_tables)  # [B, nb, bs, K, D]
            kc = kc.flatten(1, 2).transpose(1, 2)  # [B, K, S, D]
            vc = vc.flatten(1, 2).transpose(1, 2)
            # Fold each group's query heads into rows: K/V are never expanded for GQA.
            qd = q.index_select(0, d.rows).view(bsz, num_kv_heads, -1, head_dim)
            o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=d.mask, scale=scale)
            out.index_copy_(0, d.rows, o.reshape(bsz, num_heads * head_dim))
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

    def _get_plan(self, meta: AttentionMetadata, dtype: torch.dtype, kv_width: int) -> _Plan:
        if meta is not self._plan_meta:
            self._plan = _build_plan(meta, dtype, kv_width)
            self._plan_meta = meta
        assert self._plan is not None
        return self._plan


def _build_plan(meta: AttentionMetadata, dtype: torch.dtype, kv_width: int) -> _Plan:
    """Split the step into per-request chunks and (when it pays) one batch of decodes."""
    device = meta.slot_mapping.device
    bs = meta.block_size
    starts: list[int] = []
    pos = 0
    for n in meta.query_lens_list:
        starts.append(pos)
        pos += n

    decode_reqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    batch_decodes = False
    if len(decode_reqs) >= 2:
        max_seq = max(meta.seq_lens_list[i] for i in decode_reqs)
        padded_len = -(-max_seq // bs) * bs
        real = sum(meta.seq_lens_list[i] for i in decode_reqs)
        batch_decodes = (
            len(decode_reqs) * padded_len <= _MAX_DECODE_PADDING * real
            and padded_len * kv_width <= _MAX_BATCHED_CONTEXT
        )

    chunks: list[_Chunk] = []
    for i, (query_len, seq_len) in enumerate(
        zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
    ):
        if query_len == 0 or (batch_decodes and query_len == 1):
            continue
        start = starts[i]
        if seq_len == query_len:
            chunks.append(_Chunk(start, start + query_len, seq_len, None, None))
            continue
        num_blocks = -(-seq_len // bs)
        mask = None
        if query_len > 1:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        chunks.append(
            _Chunk(start, start + query_len, seq_len, meta.block_tables[i, :num_blocks], mask)
        )

    decode = None
    if batch_decodes:
        idx = torch.tensor(decode_reqs, dtype=torch.int64, device=device)
        max_blocks = -(-max(meta.seq_lens_list[i] for i in decode_reqs) // bs)
        rows = torch.tensor([starts[i] for i in decode_reqs], dtype=torch.int64, device=device)
        block_tables = meta.block_tables.index_select(0, idx)[:, :max_blocks]
        seq_lens = meta.seq_lens.index_select(0, idx)
        valid = torch.arange(max_blocks * bs, device=device)[None, :] < seq_lens[:, None]
        mask = torch.zeros(valid.shape, dtype=dtype, device=device)
        mask.masked_fill_(~valid, float("-inf"))
        decode = _DecodeBatch(rows, block_tables, mask[:, None, None, :])
    return _Plan(chunks, decode)
