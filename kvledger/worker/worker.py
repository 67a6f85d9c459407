"""One device's share of the work: the model (its shard under tensor parallelism), its KV pools
and the runner. The same class serves the engine in-process (``LocalExecutor``) and each
tensor-parallel rank in its own process (``worker/tp_worker.py``); it holds no scheduler,
block manager or engine request: everything it does is in the step messages.
"""

from __future__ import annotations

import os
import socket

import torch

from kvledger.cache.kv_tier_messages import TierReport
from kvledger.core.sched_output import SchedulerOutput
from kvledger.model.gemm_calibration import model_dispatch
from kvledger.model.layers import can_pack_linear, warm_up_gemm_shapes
from kvledger.model.loader import LoadedModel, load_model
from kvledger.storage import host_memory
from kvledger.storage.kv_cache import HostKVPool, KVCachePool
from kvledger.worker.drafter import Drafter
from kvledger.worker.messages import WorkerReady, WorkerSpec, WorkerStats
from kvledger.worker.model_runner import ModelRunner, ModelRunnerOutput


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int = 0, world_size: int = 1) -> None:
        """Load the model (and shard it when ``world_size`` > 1); the pools come with
        ``init_kv_cache``, here at once when the spec already says how many blocks."""
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(spec.device)
        if self.device.type == "cpu":  # steps reuse their activation memory, not re-fault it
            host_memory.keep_freed_memory()
        sharded = world_size > 1
        self.loaded: LoadedModel = load_model(
            spec.model, dtype=spec.dtype, device=spec.device, max_model_len=spec.max_model_len,
            pack_linear=not sharded, quantization=None if sharded else spec.quantization,
            hf_overrides=spec.hf_overrides,
        )  # fmt: skip
        model = self.loaded.model
        if sharded:  # shard before packing: the kernels see each rank's own matrices
            from kvledger.distributed.sharding import shard_model

            shard_model(model, rank, world_size)
            if spec.quantization is not None:  # each rank quantises its own float shard
                model.quantize_layers(spec.quantization)
            if can_pack_linear(self.loaded.dtype, self.device):
                model.pack_linears()
        if spec.attention_backend == "triton":
            from kvledger.model.attention.triton_backend import TritonAttentionBackend

            model.attn_backend = TritonAttentionBackend()
        self.model = model
        self.draft: LoadedModel | None = None
        if spec.draft_model is not None:  # the draft is small: it runs unsharded, beside the target
            self.draft = load_model(
                spec.draft_model, dtype=spec.dtype, device=spec.device,
                max_model_len=spec.max_model_len, quantization=spec.draft_quantization,
            )  # fmt: skip
        if self.device.type == "cpu":  # the load's transient copies, freed, leave the heap
            host_memory.return_freed_memory()
        self.drafter: Drafter | None = None
        self.kv_pool: KVCachePool | None = None
        self.host_pool: HostKVPool | None = None
        self.tiers = None  # storage.kv_tiers.TierWorker when the tiered prefix cache is on
        self.runner: ModelRunner | None = None
        self.ready: WorkerReady | None = None
        if spec.num_blocks:
            self.init_kv_cache(spec)

    def init_kv_cache(self, spec: WorkerSpec) -> WorkerReady:
        """Build the pools (``spec.num_blocks`` blocks of this rank's KV heads), warm the GEMM
        shapes, capture CUDA graphs, and make the runner."""
        self.spec = spec
        model = self.model
        attn = model.model.layers[0].self_attn
        # Hybrid models: a block holds one KV cache group's layers (group_size pool tensors),
        # and layer i reads tensor layer_slot[i] through its group's block tables.
        layers = len(model.model.layers)
        num_tensors = layers if spec.layer_slot is None else max(spec.layer_slot) + 1
        pool = self.kv_pool = KVCachePool(
            num_layers=num_tensors,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=self.loaded.dtype,
            device=self.device,
            kv_cache_dtype=spec.kv_cache_dtype,
            sink_tokens=spec.kv_sink_tokens,
            recent_tokens=spec.kv_recent_tokens,
            overlay_slots=spec.overlay_slots,
        )
        if spec.num_host_blocks:
            self.host_pool = HostKVPool(spec.num_host_blocks, pool)
        draft_block_bytes = 0
        if self.draft is not None:  # the draft's KV: its own tensors over the same block ids
            d_attn = self.draft.model.model.layers[0].self_attn
            draft_pool = KVCachePool(
                num_layers=len(self.draft.model.model.layers), num_blocks=spec.num_blocks,
                block_size=spec.block_size, num_kv_heads=d_attn.num_kv_heads,
                head_dim=d_attn.head_dim, dtype=self.draft.dtype, device=self.device,
            )  # fmt: skip
            if spec.populate_kv_cache and self.device.type == "cpu":
                draft_pool.populate()
            self.drafter = Drafter(self.draft.model, draft_pool)
            draft_block_bytes = draft_pool.bytes_per_block
        layer_caches = (
            pool.layers if spec.layer_slot is None else [pool.layers[j] for j in spec.layer_slot]
        )
        if spec.populate_kv_cache and self.device.type == "cpu":
            pool.populate()
        dispatch = ""
        if spec.gemm_dispatch_rows and self.device.type == "cpu":
            rows = model.row_invariance
            rows.dispatch = model_dispatch(model, spec.gemm_dispatch_rows)
            dispatch = rows.dispatch.describe(spec.gemm_dispatch_rows, self.loaded.dtype)
        warmed = 0
        if spec.warm_up_gemm_rows is not None and self.device.type == "cpu":
            warmed = warm_up_gemm_shapes(model, *spec.warm_up_gemm_rows)[0]
        graphs = None
        if spec.cuda_graph_max_seqs and self.device.type == "cuda":
            from kvledger.worker.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(
                model, pool.layers, spec.cuda_graph_max_seqs, self.loaded.max_model_len,
                spec.block_size, attn.num_kv_heads, self.device,
            )  # fmt: skip
        if spec.kv_offload is not None:
            from kvledger.storage.kv_tiers import TierWorker

            self.tiers = TierWorker(spec.kv_offload, pool, self.rank)
        self.runner = ModelRunner(
            model, pool, self.host_pool, spec.block_size, self.device, seed=spec.seed,
            eos_token_ids=tuple(self.loaded.eos_token_ids), layer_group=spec.layer_group,
            layer_caches=layer_caches, rope_long_from=spec.rope_long_from, graphs=graphs,
            drafter=self.drafter,
            tiers=self.tiers,
        )  # fmt: skip
        if self.tiers is not None:
            self.tiers.overlay = self.runner.overlay  # quantised KV: sinks kept beside block 0
        self.ready = WorkerReady(
            rank=self.rank,
            pid=os.getpid(),
            host=socket.gethostname(),
            num_kv_heads=attn.num_kv_heads,
            bytes_per_block=pool.bytes_per_block + draft_block_bytes,
            device_pool_bytes=pool.data.numel() * pool.data.element_size()
            + spec.num_blocks * draft_block_bytes,
            host_pool_bytes=0 if self.host_pool is None else self.host_pool.data.numel(),
            tier_host_bytes=0 if self.tiers is None or self.tiers.host is None else self.tiers.host.num_bytes,
            weight_bytes=_tensor_bytes(model.parameters()),
            gemm_shapes_warmed=warmed,
            gemm_dispatch=dispatch,
            draft_bytes_per_block=draft_block_bytes,
            draft_weight_bytes=0 if self.draft is None else _tensor_bytes(self.draft.model.parameters()),
        )
        return self.ready

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step; tensor-parallel ranks other than 0 compute and keep state but sample
        nothing (rank 0's tokens are the engine's)."""
        return self.runner.execute(so, sample=self.rank == 0)

    def flush_kv_tiers(self) -> TierReport | None:
        """Wait for the tiered cache's disk writes and stop its threads (a graceful shutdown):
        their report, or None without tiers."""
        if self.tiers is None:
            return None
        rep = self.tiers.flush()
        self.tiers.close()
        return rep

    def stats(self) -> WorkerStats:
        pool, ov = self.kv_pool, self.runner.overlay
        st = WorkerStats(overlay_slots=pool.overlay_slots, overlay_bytes=pool.overlay_bytes)
        if self.drafter is not None:
            st.draft_forwards = self.drafter.num_forwards
        if ov is not None:
            st.overlay_slots_used = ov.num_used
            st.sink_cache_entries = len(ov.sink_cache)
            st.sink_cache_bytes = ov.sink_cache_bytes
            st.sink_cache_hits = ov.sink_cache_hits
            st.sink_cache_misses = ov.sink_cache_misses
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            st.device_memory = {
                "total": total,
                "free": free,
                "torch_allocated": torch.cuda.memory_allocated(self.device),
                "torch_reserved": torch.cuda.memory_reserved(self.device),
            }
        return st
