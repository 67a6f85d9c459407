"""The one interface between model code and attention kernels.

A backend sees flat tensors only (this step's q/k/v, one layer's cache, the step's metadata),
so a GPU kernel is a new backend, not a change to the model.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.storage.kv_cache import LayerKVCache


class AttentionBackend(Protocol):
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
        """Write k/v [T, n_kv, hd] at meta.slot_mapping, then attend q [T, n_heads, hd] causally over each
        request's context read back through its block table. Returns [T, n_heads * hd].

        ``window``: a query at position p sees only keys p - window < j <= p (sliding-window
        layers; the blocks before that may be gone). ``softcap``: scores become
        softcap * tanh(scores / softcap) before the mask (Gemma 2). The model passes these
        keywords only when set, so a backend without them still runs the other families."""
        ...
