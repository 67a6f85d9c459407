"""Device memory of the paged KV cache: allocated once, addressed by (block, offset) slots.

The block manager decides which block holds what; this module only owns the tensors and
carries out its decisions (writes, copy-on-write copies, swaps) as batched index ops.
The storage format sits behind the per-layer object (``LayerKVCache``) so that a quantised
format is another class with the same ``write``/``read``/``storage`` interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvledger.kernels import native
from kvledger.storage import host_memory


class LayerKVCache(Protocol):
    """What attention backends and the pools need from one layer's cache."""

    block_size: int
    # Tensors whose dim 1 indexes physical blocks; copies and swaps move these verbatim.
    storage: tuple[torch.Tensor, ...]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new K/V rows [T, num_kv_heads, head_dim] at flat slots block_id * block_size + offset."""

    def read(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given blocks, shape [*block_ids.shape, block_size, num_kv_heads, head_dim], in the compute dtype."""


class PagedKVCache:
    """One layer's K and V, stored unquantised in the model dtype as kv[2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.storage = (kv,)
        _, num_blocks, block_size, num_kv_heads, head_dim = kv.shape
        self.block_size = block_size
        self.k = kv[0]
        self.v = kv[1]
        # Flat views for writes: slot s is row s.
        self._k_slots = self.k.view(num_blocks * block_size, num_kv_heads, head_dim)
        self._v_slots = self.v.view(num_blocks * block_size, num_kv_heads, head_dim)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if k.shape[-2:] == self.k.shape[-2:] and native.write_kv(self, k, v, slot_mapping):
            return
        self._k_slots.index_copy_(0, slot_mapping, k)
        self._v_slots.index_copy_(0, slot_mapping, v)

    def read(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*block_ids.shape, *self.k.shape[1:])
        flat = block_ids.reshape(-1)
        return self.k.index_select(0, flat).view(shape), self.v.index_select(0, flat).view(shape)


def _pairs_to_index(pairs: list[tuple[int, int]], src_device, dst_device):
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device)
    return src, dst


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool = False
) -> torch.Tensor:
    """Zeros; on the CPU from pages that stay unmapped until first written (huge pages where
    available, see host_memory), so the process's resident memory grows with the blocks
    actually used, not the pool's size."""
    if device.type == "cpu" and not pin_memory:
        return host_memory.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


class KVCachePool:
    """All layers' paged KV cache, preallocated once (zeros: unwritten slots stay finite, so masked reads are safe).

    ``kv_cache_dtype`` auto stores K/V in the model dtype; int8 / fp8 / fp8_int8 store codes plus
    one float16 scale per token per KV head (``kvledger.storage.kv_quant``), all in one uint8 buffer,
    and keep ``overlay_slots`` full-precision overlay slots of ``sink_tokens + recent_tokens`` rows
    per layer for the requests' attention sinks and recent window.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        kv_cache_dtype: str = "auto",
        sink_tokens: int = 0,
        recent_tokens: int = 0,
        overlay_slots: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_cache_dtype = kv_cache_dtype
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.overlay: torch.Tensor | None = None
        self.overlay_slots = 0
        if kv_cache_dtype == "auto":
            # One allocation for the whole cache, so its size is one number the ledger can check.
            self.data = lazy_zeros(
                (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
                dtype,
                self.device,
                pin_memory,
            )
            self.layers: list[LayerKVCache] = [PagedKVCache(self.data[i]) for i in range(num_layers)]
            return
        from kvledger.storage import kv_quant

        k_fmt, v_fmt = kv_quant.KV_FORMATS[kv_cache_dtype]
        lay = kv_quant.layout_bytes(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Still one allocation (codes and scales are views of it), so data.zero_() resets it all.
        self.data = lazy_zeros((lay["total"],), torch.uint8, self.device, pin_memory)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)

        def region(name: str, dt: torch.dtype) -> torch.Tensor:
            off, n = lay[name]
            return self.data[off : off + n].view(dt)

        k = region("k", kv_quant.code_dtype(k_fmt)).view(shape)
        v = region("v", kv_quant.code_dtype(v_fmt)).view(shape)
        scales = region("scales", torch.float16).view(num_layers, 2, *shape[1:4])
        self.layers = [
            kv_quant.QuantizedPagedKVCache(
                k[i : i + 1], v[i : i + 1], scales[i], k_fmt, v_fmt, dtype, sink_tokens, recent_tokens
            )
            for i in range(num_layers)
        ]
        if overlay_slots and sink_tokens + recent_tokens:
            self.grow_overlay(overlay_slots)

    # -- the full-precision overlay (quantised formats only) ------------------------------------
    @property
    def overlay_rows_per_slot(self) -> int:
        return self.sink_tokens + self.recent_tokens

    @property
    def overlay_bytes(self) -> int:
        return 0 if self.overlay is None else self.overlay.numel() * self.overlay.element_size()

    def grow_overlay(self, num_slots: int) -> None:
        """(Re)allocate the overlay [layers, 2, num_slots * (S + R), H, D], keeping what it holds."""
        rows = num_slots * self.overlay_rows_per_slot
        with torch.inference_mode(False):  # may grow mid-step; it must stay a normal tensor
            new = torch.zeros(
                (self.num_layers, 2, rows, self.num_kv_heads, self.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            if self.overlay is not None:
                new[:, :, : self.overlay.shape[2]] = self.overlay
        self.overlay = new
        self.overlay_slots = num_slots
        for i, layer in enumerate(self.layers):
            layer.overlay_k, layer.overlay_v = new[i, 0], new[i, 1]

    def read_overlay_rows(self, slot: int, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of a slot, all layers: [layers, 2, hi - lo, H, D]."""
        base = slot * self.overlay_rows_per_slot
        return self.overlay[:, :, base + lo : base + hi]

    def write_overlay_rows(self, slot: int, lo: int, values: torch.Tensor) -> None:
        base = slot * self.overlay_rows_per_slot
        self.overlay[:, :, base + lo : base + lo + values.shape[2]] = values

    def copy_overlay_slot(self, src: int, dst: int) -> None:
        n = self.overlay_rows_per_slot
        self.overlay[:, :, dst * n : (dst + 1) * n] = self.overlay[:, :, src * n : (src + 1) * n]

    def populate(self) -> None:
        """Map every page of the pool now (it holds zeros, so writing zeros changes nothing).

        The CPU pool's pages are otherwise mapped on first write, inside the steps that first use
        each block: in a fresh server that is every prefill for its first ~pool-size tokens, and a
        2,044-token prefill of the 60M model took 605-727 ms on a mapped pool vs 744-848 ms on a
        fresh one (docs/measurements/serving_settings.md, "The KV pool mapped at start-up"). A
        server maps it at start-up instead, as vLLM allocates its zeroed cache; resident memory is
        then the whole pool from the start."""
        self.data.zero_()
        if self.overlay is not None:
            self.overlay.zero_()

    def layer(self, i: int) -> LayerKVCache:
        return self.layers[i]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers (K and V)."""
        return sum(
            t[:, 0].numel() * t.element_size() for layer in self.layers for t in layer.storage
        )

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents to block dst, for every (src, dst), all layers.

        Sources are read before any destination is written (one gather, one scatter per tensor),
        so a pair list must not chain (a dst that is also a later src sees the old contents).
        """
        if not pairs:
            return
        src, dst = _pairs_to_index(pairs, self.device, self.device)
        for layer in self.layers:
            for t in layer.storage:
                t.index_copy_(1, dst, t.index_select(1, src))


class HostKVPool(KVCachePool):
    """CPU twin of a device pool for swapped-out blocks (pinned when the device is CUDA), in the
    same storage format; the overlay stays on the device while a request is swapped out."""

    def __init__(self, num_blocks: int, device_pool: KVCachePool) -> None:
        super().__init__(
            device_pool.num_layers,
            num_blocks,
            device_pool.block_size,
            device_pool.num_kv_heads,
            device_pool.head_dim,
            device_pool.dtype,
            device="cpu",
            pin_memory=device_pool.device.type == "cuda",
            kv_cache_dtype=device_pool.kv_cache_dtype,  # swaps move codes and scales verbatim
        )
        self.device_pool = device_pool
        # CUDA: copies run on their own stream through pinned staging buffers, so a swap-in
        # does not block the host and the compute stream only waits where it reads them.
        self._stream = (
            torch.cuda.Stream(device_pool.device) if device_pool.device.type == "cuda" else None
        )

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, for every (device_block, host_block)."""
        if not pairs:
            return
        src, dst = _pairs_to_index(pairs, self.device_pool.device, self.device)
        if self._stream is not None:
            self._swap_out_cuda(src, dst)
            return
        for dev_layer, host_layer in zip(self.device_pool.layers, self.layers, strict=True):
            for d, h in zip(dev_layer.storage, host_layer.storage, strict=True):
                h.index_copy_(1, dst, d.index_select(1, src).to(self.device))

    def _swap_out_cuda(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Gather on the copy stream (after the compute stream's writes), device -> pinned
        staging without blocking, then one wait before the host scatters."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        staged = []
        with torch.cuda.stream(stream):
            for dev_layer in self.device_pool.layers:
                for d in dev_layer.storage:
                    g = d.index_select(1, src)
                    buf = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                    buf.copy_(g, non_blocking=True)
                    staged.append(buf)
        stream.synchronize()
        it = iter(staged)
        for host_layer in self.layers:
            for h in host_layer.storage:
                h.index_copy_(1, dst, next(it))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, for every (host_block, device_block)."""
        if not pairs:
            return
        src, dst = _pairs_to_index(pairs, self.device, self.device_pool.device)
        if self._stream is None:
            for dev_layer, host_layer in zip(self.device_pool.layers, self.layers, strict=True):
                for d, h in zip(dev_layer.storage, host_layer.storage, strict=True):
                    d.index_copy_(1, dst, h.index_select(1, src))
            return
        # CUDA: host gather into pinned staging, then copy + scatter on the copy stream; the
        # compute stream waits for it (the host does not).
        stream, compute = self._stream, torch.cuda.current_stream(self.device_pool.device)
        stream.wait_stream(compute)  # blocks being overwritten may still be read by queued work
        with torch.cuda.stream(stream):
            for dev_layer, host_layer in zip(self.device_pool.layers, self.layers, strict=True):
                for d, h in zip(dev_layer.storage, host_layer.storage, strict=True):
                    staged = h.index_select(1, src).pin_memory()
                    d.index_copy_(1, dst, staged.to(d.device, non_blocking=True))
        compute.wait_stream(stream)
