"""What crosses between the driver and its tensor-parallel workers: plain dataclasses of numpy
arrays, lists and numbers (pickled over a ``multiprocessing.connection``), never torch tensors
or engine objects, so a worker on another machine needs nothing but this module to read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class WorkerSpec:
    """Sent once to every rank: what to load and how big its pools are (same for all ranks)."""

    model: str
    dtype: str
    device: str
    max_model_len: int
    block_size: int
    num_blocks: int
    num_host_blocks: int
    kv_cache_dtype: str
    kv_sink_tokens: int
    kv_recent_tokens: int
    overlay_slots: int  # quantised KV: the overlay's initial slots (it grows as the driver says)
    attention_backend: str
    num_threads: int
    dist_backend: str  # "gloo" on CPU, "nccl" on CUDA
    collective_timeout_s: float
    # Hybrid models (KV cache groups, kvledger.ledger.kv_cache_groups): each model layer's group
    # and pool tensor; the pool then has max(layer_slot) + 1 tensors. None: one tensor per layer.
    layer_group: tuple[int, ...] | None = None
    layer_slot: tuple[int, ...] | None = None
    # `kvledger serve`: (max rows of a step, max sampled rows) - create every oneDNN GEMM shape
    # of this rank's shards at start-up (model/layers.warm_up_gemm_shapes; issue 23). None: no.
    warm_up_gemm_rows: tuple[int, int] | None = None
    # `kvledger serve`: map this rank's whole KV pool at start-up (KVCachePool.populate).
    populate_kv_cache: bool = False


@dataclass
class WorkerReady:
    rank: int
    pid: int
    host: str
    num_kv_heads: int  # this rank's KV heads (a replicated head counts on every rank holding it)
    bytes_per_block: int  # measured on the rank's real pool
    device_pool_bytes: int
    host_pool_bytes: int
    weight_bytes: int
    overlay_bytes_per_row: int = 0  # one overlay row (a token's K and V, all layers) on this rank
    gemm_shapes_warmed: int = 0  # GEMMs run at start-up by warm_up_gemm_rows


@dataclass
class StepPlan:
    """One engine step, the same message for every rank: the flat inputs the runner prepared
    (token ids, positions, slot mapping, block tables gathered from the runner's block table),
    the block copies in the runner's order, and which hidden rows need logits."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    max_query_len: int
    max_seq_len: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    logits_rows: list[int]
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    rope_seq_lens: np.ndarray | None = None  # LongRoPE models: each request's whole length
    # Quantised KV with an overlay: each request's slot and valid rows (AttentionMetadata's
    # overlay_*), and the pool operations to replay first (kvledger.distributed.overlay_proxy).
    overlay_slots: list[int] | None = None
    overlay_sink_from: list[int] | None = None
    overlay_window_from: list[int] | None = None
    overlay_ops: list = field(default_factory=list)
    # Hybrid models: the block tables and slot mapping of KV cache groups 1.. (group 0's are
    # above); None when every layer reads group 0's (AttentionMetadata.per_layer is None).
    group_block_tables: list[np.ndarray] | None = None
    group_slot_mappings: list[np.ndarray] | None = None


@dataclass
class StepResult:
    rank: int
    logits: np.ndarray | None  # rank 0 only: float32 [len(logits_rows), vocab]
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0
    compute_seconds: float = 0.0  # block ops + forward + logits, on the rank
    collective_seconds: float = 0.0  # of which inside all-reduce / all-gather
    num_collectives: int = 0


@dataclass
class WorkerFailed:
    """A rank's own report of why it cannot go on (load error, collective timeout...)."""

    rank: int
    reason: str


@dataclass
class Shutdown:
    pass
