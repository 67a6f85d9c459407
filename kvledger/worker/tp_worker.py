"""One tensor-parallel rank: its shard of the weights, its heads' KV pools, one forward per step.

A worker connects to its driver, receives a ``WorkerSpec``, joins the torch.distributed group
(rank and world from ``RANK`` / ``WORLD_SIZE``, rendezvous at ``MASTER_ADDR`` /
``MASTER_PORT``, as torchrun sets them), loads and shards the model, builds its pools (same
block count as every other rank, its own KV heads; for a hybrid model one tensor per layer of a
KV cache group, each layer reading its group's tables from the plan) and reports ``WorkerReady``. Then, per
``StepPlan``: swap-out, copy-on-write and swap-in on its own pools (each rank moves its own
heads' blocks), one forward pass, and the logits rows; rank 0 sends them back, the other ranks
an empty ``StepResult`` (so the driver hears from every rank each step).

It holds no scheduler, block manager or request state: everything it needs is in the message.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import numpy as np
import torch
import torch.distributed as dist

from kvledger import envs
from kvledger.distributed import parallel_state
from kvledger.distributed.overlay_proxy import apply_overlay_ops
from kvledger.distributed.sharding import shard_model
from kvledger.executor.messages import (
    Shutdown,
    StepPlan,
    StepResult,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
)
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.layers import can_pack_linear, warm_up_gemm_shapes
from kvledger.storage import host_memory
from kvledger.storage.kv_cache import HostKVPool, KVCachePool


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int, world_size: int) -> None:
        from kvledger.model.loader import load_model

        self.rank, self.world_size = rank, world_size
        self.device = torch.device(spec.device)
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()
        loaded = load_model(
            spec.model, dtype=spec.dtype, device=spec.device, max_model_len=spec.max_model_len,
            pack_linear=False,
        )
        model = loaded.model
        shard_model(model, rank, world_size)
        if can_pack_linear(loaded.dtype, self.device):
            model.pack_linears()
        self.gemm_shapes_warmed = 0
        if spec.warm_up_gemm_rows is not None and self.device.type == "cpu":
            self.gemm_shapes_warmed = warm_up_gemm_shapes(model, *spec.warm_up_gemm_rows)[0]
        if spec.attention_backend == "triton":
            from kvledger.model.attention.triton_backend import TritonAttentionBackend

            model.attn_backend = TritonAttentionBackend()
        self.model = model
        attn = model.model.layers[0].self_attn
        # Hybrid models: a block holds one KV cache group's layers (group_size pool tensors),
        # and layer i reads tensor layer_slot[i] through its group's block tables.
        self.layer_group = spec.layer_group
        num_tensors = len(model.model.layers) if spec.layer_slot is None else max(spec.layer_slot) + 1
        self.kv_pool = KVCachePool(
            num_layers=num_tensors,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=loaded.dtype,
            device=self.device,
            kv_cache_dtype=spec.kv_cache_dtype,
            sink_tokens=spec.kv_sink_tokens,
            recent_tokens=spec.kv_recent_tokens,
            overlay_slots=spec.overlay_slots,
        )
        if spec.populate_kv_cache and self.device.type == "cpu":
            self.kv_pool.populate()
        self.layer_caches = (
            self.kv_pool.layers if spec.layer_slot is None
            else [self.kv_pool.layers[j] for j in spec.layer_slot]
        )
        self.sinks: dict[int, torch.Tensor] = {}  # the overlay's sink cache, keyed by the driver
        self.host_pool = (
            HostKVPool(spec.num_host_blocks, self.kv_pool) if spec.num_host_blocks else None
        )
        self.block_size = spec.block_size
        self.ready = WorkerReady(
            rank=rank,
            gemm_shapes_warmed=self.gemm_shapes_warmed,
            pid=os.getpid(),
            host=socket.gethostname(),
            num_kv_heads=attn.num_kv_heads,
            bytes_per_block=self.kv_pool.bytes_per_block,
            device_pool_bytes=self.kv_pool.data.numel() * self.kv_pool.data.element_size(),
            host_pool_bytes=0 if self.host_pool is None else self.host_pool.data.numel(),
            weight_bytes=_tensor_bytes(model.parameters()),
            overlay_bytes_per_row=(
                self.kv_pool.num_layers * 2 * attn.num_kv_heads * attn.head_dim
                * self.kv_pool.dtype.itemsize if self.kv_pool.overlay is not None else 0
            ),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        st = parallel_state.TP
        st.collective_seconds, st.num_collectives = 0.0, 0
        out = StepResult(self.rank, None)
        if plan.overlay_ops:
            apply_overlay_ops(self.kv_pool, self.sinks, plan.overlay_ops)
        if plan.blocks_to_swap_out:
            t = time.perf_counter()
            self.host_pool.swap_out(plan.blocks_to_swap_out)
            out.swap_out_seconds = time.perf_counter() - t
        self.kv_pool.copy_blocks(plan.blocks_to_copy)
        if plan.blocks_to_swap_in:
            t = time.perf_counter()
            self.host_pool.swap_in(plan.blocks_to_swap_in)
            out.swap_in_seconds = time.perf_counter() - t
        if plan.query_lens_list:
            dev = self.device

            def tensor(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(a).to(dev)

            meta = AttentionMetadata(
                slot_mapping=tensor(plan.slot_mapping),
                query_start_loc=tensor(plan.query_start_loc),
                seq_lens=tensor(plan.seq_lens),
                block_tables=tensor(plan.block_tables),
                block_size=self.block_size,
                max_query_len=plan.max_query_len,
                max_seq_len=plan.max_seq_len,
                query_lens_list=plan.query_lens_list,
                seq_lens_list=plan.seq_lens_list,
            )
            if plan.overlay_slots is not None:
                meta.overlay_slots = plan.overlay_slots
                meta.overlay_sink_from = plan.overlay_sink_from
                meta.overlay_window_from = plan.overlay_window_from
            if plan.rope_seq_lens is not None:
                meta.rope_seq_lens = tensor(plan.rope_seq_lens)
            if plan.group_block_tables is not None:  # hybrid: each layer its group's view
                meta.set_group_views(
                    [(tensor(bt), tensor(sm))
                     for bt, sm in zip(plan.group_block_tables, plan.group_slot_mappings, strict=True)],
                    self.layer_group,
                )
            hidden = self.model(tensor(plan.input_ids), tensor(plan.positions), meta, self.layer_caches)
            if plan.logits_rows:
                idx = torch.tensor(plan.logits_rows, dtype=torch.long, device=dev)
                logits = self.model.compute_logits(hidden[idx])  # gathered on every rank
                if self.rank == 0:
                    out.logits = logits.float().cpu().numpy()
        out.compute_seconds = time.perf_counter() - t0
        out.collective_seconds, out.num_collectives = st.collective_seconds, st.num_collectives
        return out


def _connect(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """The driver may still be starting (torchrun launches workers independently): retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, FileNotFoundError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_worker(driver: tuple[str, int], authkey: bytes, num_threads: int | None = None) -> int:
    """Serve one driver until it says Shutdown or goes away. Returns the exit code."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    conn = _connect(driver, authkey, envs.KVLEDGER_WORKER_CONNECT_TIMEOUT)
    conn.send(("hello", rank, world_size))
    try:
        spec: WorkerSpec = conn.recv()
        torch.set_num_threads(num_threads or spec.num_threads)
        dist.init_process_group(
            spec.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        parallel_state.set_tp(rank, world_size)
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            spec.device = f"cuda:{torch.cuda.current_device()}"
        worker = Worker(spec, rank, world_size)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which names it
        _report(conn, rank, e)
        return 1
    conn.send(worker.ready)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0  # the driver is gone: nothing to serve
        if isinstance(msg, Shutdown):
            break
        try:
            conn.send(worker.execute(msg))
        except BaseException as e:  # noqa: BLE001
            _report(conn, rank, e)
            return 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _report(conn: Connection, rank: int, e: BaseException) -> None:
    reason = f"{type(e).__name__}: {e}".strip()
    if not str(e):
        reason += " " + traceback.format_exc(limit=3)
    try:
        conn.send(WorkerFailed(rank, reason[:2000]))
    except (OSError, EOFError):
        pass
