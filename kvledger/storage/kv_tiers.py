"""The tiered prefix cache's worker side: moves blocks between the pool, host memory and disk.

It carries out the scheduler's ``TierStore`` / ``TierLoad`` decisions (kvledger.cache.kv_tiers)
in the order that keeps every byte right: evicted blocks are copied out first (this step's
writes may land in them), then cancelled loads are dropped, finished disk reads are installed,
host-tier loads are copied in, and new disk reads are started. Disk reads and writes run on
their own threads (the loader verifies header and checksum off the step loop); only the final
copy of a read block into its pool block happens in the step, so a load cancelled by an abort
never touches a block that was given to someone else. A block is stored as the pool stores it
(each pool tensor's slice, codes and scales for int8 / fp8), so quantised caches round-trip
bit for bit.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvledger.cache import kv_block_file
from kvledger.cache.kv_block_file import BlockFileError, OffloadSpec
from kvledger.cache.kv_tier_messages import TierBlock, TierLoad, TierReport, TierStore
from kvledger.core.sched_output import SchedulerOutput
from kvledger.storage.kv_cache import HostKVPool, KVCachePool

IDLE_WAIT_S = 0.02  # an idle step waits this long for a disk read (no busy loop)


def block_tensors(pool: KVCachePool) -> list[torch.Tensor]:
    """Every pool tensor whose dim 1 indexes blocks, in a fixed order (the file's layout)."""
    return [t for layer in pool.layers for t in layer.storage]


def block_layout(pool: KVCachePool) -> list[list]:
    """Each tensor's per-block shape and dtype: written in every header, checked on read."""
    return [[list(t[:, 0].shape), str(t.dtype).removeprefix("torch.")] for t in block_tensors(pool)]


class _Load:
    """A load in flight: its host part is in place, its disk part is being read."""

    def __init__(self, job: TierLoad) -> None:
        self.job = job
        self.reads: dict[int, Future] = {}  # index in the job -> future of (payload | error)
        self.sinks: tuple[tuple[int, ...], Future] | None = None  # (sink key, its read)


class TierWorker:
    def __init__(self, spec: OffloadSpec, pool: KVCachePool, rank: int = 0) -> None:
        self.spec, self.pool, self.rank = spec, pool, rank
        self.host = HostKVPool(spec.num_host_blocks, pool) if spec.num_host_blocks else None
        self.tensors = block_tensors(pool)
        self.host_tensors = block_tensors(self.host) if self.host is not None else []
        self.disk = spec.directory is not None and spec.num_disk_blocks > 0
        if self.disk:
            try:
                os.makedirs(os.path.join(spec.directory, f"rank{rank}"), exist_ok=True)
            except OSError:
                pass  # a read-only directory: each write fails, the scheduler says so once
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kvledger-kv-write") if self.disk else None
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kvledger-kv-load") if self.disk else None
        self.loads: dict[str, _Load] = {}
        self.writes: list[tuple[int, Future]] = []
        self._lock = threading.Lock()
        self._traffic: list[tuple[str, int, float]] = []  # from the threads
        # Quantised KV: the runner's overlay, whose sink cache holds each prompt's first
        # kv_sink_tokens in full precision; they are kept beside the prompt's first block file
        # (when they fit in it), so a restart reads the same sinks as a recompute.
        self.overlay = None  # set by the worker once the runner exists
        self.sink_tokens = pool.sink_tokens if pool.sink_tokens <= pool.block_size else 0
        # ... and in host memory for first blocks in the host tier (block hash -> sinks; LRU,
        # at most one per host block), for when the overlay's own sink cache has dropped them.
        self.host_sinks: OrderedDict[int, torch.Tensor] = OrderedDict()

    # -- one step ---------------------------------------------------------------------------
    def step(self, so: SchedulerOutput) -> TierReport | None:
        rep = TierReport()
        for rid in so.finished_req_ids:  # aborted while loading: never installed
            self.loads.pop(rid, None)
        for h in so.kv_deletes:
            self.writes.append((h, self.writer.submit(self._delete, h)))
        if so.kv_stores:
            self._store(so.kv_stores, rep)
        if not so.req_ids and self.loads and not so.kv_loads:
            self._wait_any(IDLE_WAIT_S)
        self._install_finished(rep)
        for job in so.kv_loads:
            self._start_load(job, rep)
        self._install_finished(rep)  # loads wholly from host memory finish in this step
        self._collect_writes(rep)
        return None if rep.empty else rep

    def _store(self, stores: list[TierStore], rep: TierReport) -> None:
        host_pairs = [(s.block_id, s.host_slot) for s in stores if s.host_slot >= 0]
        if host_pairs:
            t0 = time.perf_counter()
            self.host.swap_out(host_pairs)
            rep.add_traffic("host_store", len(host_pairs) * self.spec.block_bytes, time.perf_counter() - t0)
        for s in stores:
            sinks = self._sinks_of(s.block)
            if sinks is not None and s.host_slot >= 0:
                self.host_sinks[s.block.block_hash] = sinks
                if len(self.host_sinks) > self.spec.num_host_blocks:
                    self.host_sinks.popitem(last=False)
            if s.to_disk:
                src = (s.host_slot, self.host_tensors) if s.host_slot >= 0 else (s.block_id, self.tensors)
                payload = _gather(*src)
                self.writes.append((s.block.block_hash, self.writer.submit(self._write, s.block, payload)))
                if sinks is not None:
                    self.writer.submit(self._write, s.block, sinks.reshape(-1).view(torch.uint8).clone(), True)

    def _sinks_of(self, blk: TierBlock) -> torch.Tensor | None:
        """A prompt's cached full-precision sinks, if ``blk`` is its first block."""
        if self.overlay is None or not self.sink_tokens or blk.parent_hash is not None:
            return None
        return self.overlay.sink_cache.get(blk.token_ids[: self.sink_tokens])

    def _start_load(self, job: TierLoad, rep: TierReport) -> None:
        load = _Load(job)
        pairs = [(slot, b) for slot, b in zip(job.host_slots, job.block_ids) if slot >= 0]
        if pairs:
            t0 = time.perf_counter()
            self.host.swap_in(pairs)
            rep.add_traffic("host_load", len(pairs) * self.spec.block_bytes, time.perf_counter() - t0)
        for i, (slot, blk) in enumerate(zip(job.host_slots, job.blocks)):
            if slot < 0:
                load.reads[i] = self.loader.submit(self._read, blk)
        first = job.blocks[0]
        if self.overlay is not None and self.sink_tokens and first.parent_hash is None:
            key = first.token_ids[: self.sink_tokens]
            kept = self.host_sinks.get(first.block_hash)
            if key in self.overlay.sink_cache:
                pass
            elif kept is not None:
                self._install_sinks(key, kept)
            elif self.disk:
                load.sinks = (key, self.loader.submit(self._read, first, self._sink_bytes()))
        self.loads[job.req_id] = load

    def _install_finished(self, rep: TierReport) -> None:
        for rid, load in list(self.loads.items()):
            if not all(f.done() for f in load.reads.values()) or (load.sinks and not load.sinks[1].done()):
                continue
            del self.loads[rid]
            if load.sinks is not None and not isinstance(load.sinks[1].result(), str):
                self._install_sinks(load.sinks[0], load.sinks[1].result())
            job, ok = load.job, len(load.job.block_ids)
            for i, f in sorted(load.reads.items()):
                res = f.result()
                if isinstance(res, str):
                    rep.load_errors.append((job.blocks[i].block_hash, res))
                    ok = min(ok, i)
                elif i < ok:
                    _scatter(res, job.block_ids[i], self.tensors)
            rep.loads_done[rid] = ok

    def _sink_bytes(self) -> int:
        p = self.pool
        return p.num_layers * 2 * self.sink_tokens * p.num_kv_heads * p.head_dim * p.dtype.itemsize

    def _install_sinks(self, key: tuple[int, ...], payload: torch.Tensor) -> None:
        """Into the overlay's sink cache, as if this process had computed them (LRU-bounded)."""
        p, ov = self.pool, self.overlay
        shape = (p.num_layers, 2, self.sink_tokens, p.num_kv_heads, p.head_dim)
        if payload.dtype == torch.uint8:  # read from its file
            payload = payload.view(p.dtype).view(shape).to(p.device)
        ov.sink_cache[key] = payload
        if len(ov.sink_cache) > ov.sink_entries:
            ov.sink_cache.popitem(last=False)

    def _wait_any(self, timeout: float) -> None:
        futures = [f for load in self.loads.values() for f in load.reads.values()]
        if futures:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(futures, timeout, return_when=FIRST_COMPLETED)

    def _collect_writes(self, rep: TierReport) -> None:
        left = []
        for h, f in self.writes:
            if not f.done():
                left.append((h, f))
                continue
            res = f.result()
            if res is None:
                continue  # a delete
            if res is True:
                rep.stores_done.append(h)
            else:
                rep.store_errors.append((h, res))
        self.writes = left
        with self._lock:
            traffic, self._traffic = self._traffic, []
        for key, n, s in traffic:
            rep.add_traffic(key, n, s)

    def flush(self) -> TierReport:
        """Wait for every disk write (a graceful shutdown) and report them."""
        for _, f in self.writes:
            f.result()
        rep = TierReport()
        self._collect_writes(rep)
        return rep

    def close(self) -> None:
        for ex in (self.writer, self.loader):
            if ex is not None:
                ex.shutdown(wait=True, cancel_futures=False)

    # -- the threads ------------------------------------------------------------------------
    def _path(self, block_hash: int) -> str:
        return kv_block_file.block_path(self.spec.directory, block_hash, self.rank)

    def _write(self, blk: TierBlock, payload: torch.Tensor, sinks: bool = False) -> bool | str | None:
        """Write one block file (or its sinks' file: None) atomically: True, or why not."""
        t0 = time.perf_counter()
        path = self._path(blk.block_hash) + (kv_block_file.SINK_SUFFIX if sinks else "")
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            data = kv_block_file.encode(self.spec, blk, payload.cpu().numpy().tobytes(), self.rank)
            if not os.path.isdir(os.path.dirname(path)):  # its real error (EROFS, EACCES...)
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return None if sinks else f"{errno.errorcode.get(e.errno, 'OSError')}: {e.strerror or e}"
        with self._lock:
            self._traffic.append(("disk_store", len(data), time.perf_counter() - t0))
        return None if sinks else True

    def _delete(self, block_hash: int) -> None:
        for path in (self._path(block_hash), self._path(block_hash) + kv_block_file.SINK_SUFFIX):
            try:
                os.unlink(path)
            except OSError:
                pass

    def _read(self, blk: TierBlock, sink_bytes: int = 0) -> torch.Tensor | str:
        """One block file's payload (or its sinks' file's) after every check, or why not."""
        t0 = time.perf_counter()
        path = self._path(blk.block_hash) + (kv_block_file.SINK_SUFFIX if sink_bytes else "")
        try:
            with open(path, "rb") as f:
                data = f.read()
            payload = kv_block_file.decode(data, self.spec, blk, self.rank, sink_bytes or None)
        except FileNotFoundError:
            return f"missing: {path}"
        except OSError as e:
            return f"unreadable: {e.strerror or e} ({path})"
        except BlockFileError as e:
            return f"rejected: {e} ({path})"
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        with self._lock:
            self._traffic.append(("disk_load", len(data), time.perf_counter() - t0))
        return out


def _gather(block_id: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    """One block's bytes from every tensor, concatenated (a copy: the block may be reused)."""
    return torch.cat([t[:, block_id].reshape(-1).view(torch.uint8) for t in tensors])


def _scatter(payload: torch.Tensor, block_id: int, tensors: list[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        dst = t[:, block_id]
        n = dst.numel() * dst.element_size()
        dst.copy_(payload[off : off + n].view(t.dtype).view(dst.shape))
        off += n
