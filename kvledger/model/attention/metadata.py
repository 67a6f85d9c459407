"""The flat description of one step that every attention backend receives.

One forward pass per step covers all scheduled requests (prefill chunks and decodes
together). Tokens are concatenated request by request; request ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step, has ``seq_lens[i]``
tokens of context whose K/V live in the blocks listed in ``block_tables[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: pool slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int64: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Python mirrors of the small per-request vectors, so backends need no .tolist() syncs.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # Quantised KV caches only (None otherwise): each request's full-precision overlay slot, and
    # the first position whose sink / recent-window rows that slot holds (earlier ones -- served by
    # the prefix cache -- are read dequantised). See kvledger.storage.kv_overlay.OverlaySlots.
    overlay_slots: list[int] | None = None
    overlay_sink_from: list[int] | None = None
    overlay_window_from: list[int] | None = None
    # Hybrid models (KV cache groups): each layer's view, whose block tables and slots are its
    # group's (kvledger.ledger.kv_cache_groups); None: every layer uses this one.
    per_layer: list[AttentionMetadata] | None = None
    # LongRoPE: each request's whole sequence length, which picks its RoPE table (None: seq_lens).
    rope_seq_lens: torch.Tensor | None = None
    # Speculative decoding's token trees (kvledger.spec_decode.tree): [T] int64, a bit mask per
    # query row of a tree-verifying request (bit j: row j of its chunk is an ancestor of the row, or
    # the row itself), 0 on every other row; None when no request of the step verifies a tree.
    tree_mask: torch.Tensor | None = None
    tree_reqs: frozenset[int] = frozenset()  # the requests (batch indices) whose chunk is a tree

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    def set_group_views(
        self, views: list[tuple[torch.Tensor, torch.Tensor]], layer_group: tuple[int, ...]
    ) -> None:
        """Hybrid models: KV cache groups 1.. get their own (block_tables, slot_mapping), the
        step otherwise this one; ``per_layer`` then gives layer i the view of ``layer_group[i]``.
        The driver's runner and each tensor-parallel rank build it the same way."""
        metas = [self] + [replace(self, block_tables=bt, slot_mapping=sm) for bt, sm in views]
        self.per_layer = [metas[g] for g in layer_group]

    def group_views(self, layer_group: tuple[int, ...]) -> list[AttentionMetadata]:
        """Groups 1..'s views, in group order (what ``set_group_views`` was given)."""
        by_group = dict(zip(layer_group, self.per_layer, strict=True))
        return [by_group[g] for g in range(1, max(layer_group) + 1)]
