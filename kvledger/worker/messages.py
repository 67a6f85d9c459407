"""What crosses between an engine and its workers besides the step itself (which is the
scheduler's ``SchedulerOutput``): plain dataclasses of numbers, strings and lists, pickled over
a ``multiprocessing.connection`` for tensor-parallel ranks, passed as they are to the local
worker. A worker on another machine needs nothing but these and ``core.sched_output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.cache.kv_block_file import OffloadSpec
from kvledger.worker.model_runner import ModelRunnerOutput


@dataclass
class WorkerSpec:
    """What a worker loads and builds (the same for every rank). ``num_blocks`` 0: the pools
    come later (``Worker.init_kv_cache``), once the engine has sized them (on CUDA, from a
    profile of this worker)."""

    model: str
    dtype: str
    device: str
    max_model_len: int | None  # the RoPE table's length (None: the model's own limit)
    block_size: int
    num_blocks: int = 0
    num_host_blocks: int = 0
    kv_cache_dtype: str = "auto"
    kv_sink_tokens: int = 0
    kv_recent_tokens: int = 0
    overlay_slots: int = 0  # quantised KV: the overlay's initial slots (it grows on demand)
    attention_backend: str = "torch"
    quantization: str | None = None  # on-the-fly weight quantization (model/quant_int8.py)
    hf_overrides: dict | None = None  # laid over config.json (vLLM's --hf-overrides)
    # Speculative decoding with a draft model (worker/drafter.py): its folder and on-the-fly
    # weight quantization. Its KV pool has the same blocks as the target's.
    draft_model: str | None = None
    draft_quantization: str | None = None
    seed: int = 0  # the sampler's generator for unseeded requests
    # Hybrid models (KV cache groups, kvledger.ledger.kv_cache_groups): each model layer's group
    # and pool tensor; the pool then has max(layer_slot) + 1 tensors. None: one tensor per layer.
    layer_group: tuple[int, ...] | None = None
    layer_slot: tuple[int, ...] | None = None
    # LongRoPE's switch point (Scheduler.rope_long_from); None: no such switch.
    rope_long_from: int | None = None
    # `kvledger serve`: (max rows of a step, max sampled rows) - create every oneDNN GEMM shape
    # at start-up (model/layers.warm_up_gemm_shapes; issue 23). None: no.
    warm_up_gemm_rows: tuple[int, int] | None = None
    # The most rows a step's products have (max_num_batched_tokens): how far the GEMM dispatch is
    # calibrated (model/gemm_calibration.py). 0: no dispatch is chosen (the builtin rules).
    gemm_dispatch_rows: int = 0
    # `kvledger serve`: map the whole KV pool at start-up (KVCachePool.populate).
    populate_kv_cache: bool = False
    # CUDA graphs of decode steps for up to this many requests (0: none; worker/cuda_graphs.py).
    cuda_graph_max_seqs: int = 0
    # The tiered prefix cache's host and disk tiers (storage/kv_tiers.py); None: off.
    kv_offload: OffloadSpec | None = None
    # Tensor parallelism: torch threads per rank, the collective backend, its timeout.
    num_threads: int = 1
    dist_backend: str = "gloo"
    collective_timeout_s: float = 60.0


@dataclass
class WorkerReady:
    """A worker's facts once its pools exist (the ledger's per-rank rows come from these)."""

    rank: int
    pid: int
    host: str
    num_kv_heads: int  # this rank's KV heads (a replicated head counts on every rank holding it)
    bytes_per_block: int  # measured on the rank's real pool (a draft model's KV included)
    device_pool_bytes: int
    host_pool_bytes: int
    weight_bytes: int
    tier_host_bytes: int = 0  # the tiered prefix cache's host tier (storage/kv_tiers.py)
    gemm_shapes_warmed: int = 0  # GEMMs run at start-up by warm_up_gemm_rows
    gemm_dispatch: str = ""  # which kernel takes which rows (GemmDispatch.describe), CPU only
    draft_bytes_per_block: int = 0  # of bytes_per_block, the draft model's KV
    draft_weight_bytes: int = 0


@dataclass
class WorkerStats:
    """Live figures only a worker knows: the quantised formats' overlay and sink cache, and on
    CUDA the device's memory as torch sees it."""

    overlay_slots: int = 0
    overlay_bytes: int = 0
    overlay_slots_used: int = 0
    sink_cache_entries: int = 0
    sink_cache_bytes: int = 0
    sink_cache_hits: int = 0
    sink_cache_misses: int = 0
    device_memory: dict | None = None
    draft_forwards: int = 0  # a draft model's forward passes so far (worker/drafter.py)


@dataclass
class StepResult:
    """One rank's answer to a step: rank 0's output carries the sampled tokens, the others'
    only their swap times."""

    rank: int
    output: ModelRunnerOutput
    stats: WorkerStats = field(default_factory=WorkerStats)
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


@dataclass
class FlushKVTiers:
    """A graceful shutdown: wait for the tiered cache's disk writes, answer with their
    ``TierReport``, and stop its threads (the driver merges every rank's)."""
