"""CUDA graphs for decode steps: one captured forward per batch size, replayed from static buffers.

A decode step of a small model is dozens of kernel launches per layer; at batch 1-64 the launches
and Python, not the GPU, set the step time. As in vLLM, pure-decode steps of up to the largest
captured size run as a graph replay: the step's ids, positions, slots, context lengths and block
tables are copied into fixed buffers (padding rows: slot -1, so nothing is written, and one
context token), and the graph captured for the next size up is replayed. Prefill and mixed steps
run eagerly. ``enforce_eager=True`` turns graphs off.

Only the Triton backend is captured (no host reads per step; a fixed split-K factor per size),
and only for caches without the quantised formats' full-precision overlay (whose per-step row
lists are built on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvledger.model.attention.metadata import AttentionMetadata

MAX_CAPTURE_SIZE = 512  # vLLM's default largest captured decode batch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to max_num_seqs (rounded up to 8) or 512."""
    top = min(MAX_CAPTURE_SIZE, -(-max_num_seqs // 8) * 8)
    return [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def capture(fn: Callable[[], torch.Tensor], device: torch.device, pool=None) -> Graph:
    """Warm fn up on a side stream (Triton compiles, allocator settles), then capture it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return Graph(graph, out)


class DecodeGraphs:
    """Captured decode forwards (hidden states [B, hidden]) for capture_sizes(max_num_seqs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        top = self.sizes[-1]
        width = -(-max_model_len // block_size)
        i64 = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slots = torch.full((top,), -1, **i64)
        self.seq_lens = torch.ones(top, **i64)
        self.qsl = torch.arange(top + 1, **i64)
        self.tables = torch.zeros(top, width, **i64)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.graphs: dict[int, Graph] = {}
        if device.type == "cuda":
            self._capture_all(model, kv_layers, num_kv_heads, device)

    def meta_for(self, b: int) -> AttentionMetadata:
        """The metadata a size-b graph is captured with: views of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            query_start_loc=self.qsl[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.tables[:b],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_list=[1] * b,
            seq_lens_list=[1] * b,
        )

    def _capture_all(self, model, kv_layers, num_kv_heads: int, device: torch.device) -> None:
        from kvledger.model.attention.triton_kernels import choose_num_splits

        backend = model.attn_backend
        pool = torch.cuda.graph_pool_handle()
        try:
            for b in reversed(self.sizes):  # largest first: the others reuse its memory
                meta = self.meta_for(b)
                backend.fixed_num_splits = choose_num_splits(
                    b, num_kv_heads, self.max_model_len, backend.num_sms
                )

                def fn(b=b, meta=meta):
                    return model(self.ids[:b], self.positions[:b], meta, kv_layers)

                self.graphs[b] = capture(fn, device, pool)
        finally:
            backend.fixed_num_splits = None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Hidden states of a pure-decode step by graph replay; None if no graph fits it."""
        b = self.stage(input_ids, positions, meta)
        if b is None:
            return None
        return self.graphs[b].replay()[: meta.num_reqs]

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Copy a pure-decode step into the static buffers, padded to the next captured size
        (padding rows: slot -1, nothing written; one context token); returns that size."""
        n = meta.num_reqs
        b = next((s for s in self.sizes if s >= n), None)
        if b is None or not meta.is_pure_decode:
            return None
        w = meta.block_tables.shape[1]
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:b].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:b].fill_(1)
        self.tables[:n, :w].copy_(meta.block_tables)
        self.tables[n:b, 0].fill_(0)
        return b
