"""The tiered prefix cache's scheduler side: which blocks each lower tier holds, LRU per tier.

Device -> host -> disk. A cached block the device pool evicts (``BlockPool.evicted``) is stored
into host memory (a slot of the worker's host tier) and written through to disk; a request
whose prefix misses on the device but continues in a lower tier gets fresh pool blocks and a
``TierLoad`` for them, and waits (vLLM's WAITING_FOR_REMOTE_KVS) until the worker reports the
bytes in place. Like the device cache, a tier hit is found by the hash chain and verified token
for token: each entry keeps its parent hash, salt and tokens, checked against the request's.
Entries a load is reading are pinned (never evicted under it). Accounting only, no torch; the
worker side is ``kvledger.storage.kv_tiers``.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable

from kvledger.cache import kv_block_file
from kvledger.cache.kv_block_file import OffloadSpec
from kvledger.cache.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvledger.cache.kv_tier_messages import TierBlock, TierLoad, TierReport, TierStore

logger = logging.getLogger("kvledger")

PromptBlocks = Iterable[tuple[int, tuple[int, ...], str | None]]


class KVTiers:
    def __init__(self, spec: OffloadSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.block_bytes = spec.block_bytes * spec.num_ranks  # every rank's share
        self.host: OrderedDict[int, tuple[int, TierBlock]] = OrderedDict()  # hash -> (slot, block)
        self.free_slots = list(range(spec.num_host_blocks - 1, -1, -1))
        self.disk: OrderedDict[int, TierBlock] = OrderedDict()
        self.disk_pending: set[int] = set()  # written by the worker, not yet confirmed
        self.pins: Counter[int] = Counter()  # hashes a load in flight reads
        self.loading: dict[str, list[int]] = {}  # request id -> the hashes it pinned
        self.stores: list[TierStore] = []
        self.loads: list[TierLoad] = []
        self.deletes: list[int] = []
        self.events: list[KVCacheEvent] | None = None  # KV events (medium CPU / DISK) when on
        self._warned: set[str] = set()
        # Counters for the ledger and /metrics.
        self.hits = Counter()  # tier -> blocks served
        self.stored = Counter()  # tier -> blocks stored
        self.query_tokens = 0  # prompt tokens past the device hit, once per request (vLLM's
        # external prefix-cache queries)
        self.hit_tokens = 0  # prompt tokens served by the tiers (not the device)
        self.traffic: dict[str, list[float]] = {}
        self.index_rebuilt = False
        if spec.directory is not None and spec.num_disk_blocks:
            blocks, self.index_rebuilt = kv_block_file.load_index(spec)
            for h, b in list(blocks.items())[-spec.num_disk_blocks :]:
                self.disk[h] = b
            if self.index_rebuilt and blocks:
                logger.info("kv offload: disk index rebuilt from %d block files", len(blocks))

    # -- queries ---------------------------------------------------------------------------
    @property
    def has_disk(self) -> bool:
        """A disk tier (the simulator's has no directory: an index without files)."""
        return self.spec.num_disk_blocks > 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.host or block_hash in self.disk

    @property
    def empty(self) -> bool:
        return not self.host and not self.disk

    def find(
        self, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...], salt: str | None
    ) -> tuple[int, TierBlock] | None:
        """(host slot or -1 for disk, block) for one block, verified (tokens, salt, parent hash);
        None: in no tier (or only as a disk write not yet confirmed)."""
        entry = self.host.get(block_hash)
        if entry is not None and _same(entry[1], parent_hash, tokens, salt):
            return entry
        blk = self.disk.get(block_hash)
        if blk is None or block_hash in self.disk_pending or not _same(blk, parent_hash, tokens, salt):
            return None
        return -1, blk

    def lookup(self, prompt: PromptBlocks, parent_hash: int | None) -> list[tuple[int, TierBlock]]:
        """``find`` for the prompt's blocks that follow ``parent_hash``, up to the first miss."""
        hits: list[tuple[int, TierBlock]] = []
        for h, tokens, salt in prompt:
            hit = self.find(h, parent_hash, tokens, salt)
            if hit is None:
                break
            hits.append(hit)
            parent_hash = h
        return hits

    # -- decisions --------------------------------------------------------------------------
    def on_evicted(self, evicted: list[tuple[int, TierBlock]]) -> None:
        """Device blocks just evicted (reused by this step): keep them in the lower tiers."""
        for block_id, blk in evicted:
            h = blk.block_hash
            slot = -1
            if h in self.host:
                self.host.move_to_end(h)
            elif self.spec.num_host_blocks:
                slot = self._host_slot()
                if slot >= 0:
                    self.host[h] = (slot, blk)
                    self.stored["host"] += 1
                    self._event(BlockStored, blk, "CPU")
            to_disk = False
            if h in self.disk:
                self.disk.move_to_end(h)
            elif self.has_disk and self._disk_room():
                self.disk[h] = blk
                self.disk_pending.add(h)
                to_disk = True
            if slot >= 0 or to_disk:
                self.stores.append(TierStore(block_id, slot, to_disk, blk))

    def store_all(self, cached: list[tuple[int, TierBlock]]) -> None:
        """Write device blocks that are on no disk yet (a graceful shutdown's flush)."""
        for block_id, blk in cached:
            if self.has_disk and blk.block_hash not in self.disk and self._disk_room():
                self.disk[blk.block_hash] = blk
                self.disk_pending.add(blk.block_hash)
                self.stores.append(TierStore(block_id, -1, True, blk))

    def _host_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        for h in self.host:  # LRU first; pinned entries are being read
            if not self.pins[h]:
                slot, blk = self.host.pop(h)
                if h not in self.disk:
                    self._event(BlockRemoved, blk, "CPU")
                return slot
        return -1

    def _disk_room(self) -> bool:
        if len(self.disk) < self.spec.num_disk_blocks:
            return True
        for h in self.disk:
            if not self.pins[h] and h not in self.disk_pending:
                blk = self.disk.pop(h)
                self.deletes.append(h)
                self._event(BlockRemoved, blk, "DISK")
                return True
        return False

    def start_load(self, req_id: str, block_ids: list[int], hits: list[tuple[int, TierBlock]]) -> None:
        """Queue the load of ``hits`` into ``block_ids`` for a request; pin what it reads."""
        hashes = [b.block_hash for _, b in hits]
        for (slot, _), h in zip(hits, hashes):
            self.pins[h] += 1
            self.hits["host" if slot >= 0 else "disk"] += 1
            if slot >= 0:
                self.host.move_to_end(h)
            if h in self.disk:
                self.disk.move_to_end(h)
        self.loading[req_id] = hashes
        self.loads.append(
            TierLoad(req_id, list(block_ids), [s for s, _ in hits], [b for _, b in hits])
        )

    def end_load(self, req_id: str) -> None:
        """The load finished or was cancelled: unpin its entries."""
        for h in self.loading.pop(req_id, ()):
            self.pins[h] -= 1
            if not self.pins[h]:
                del self.pins[h]

    def reset(self, disk: bool = False) -> tuple[int, int]:
        """Forget the host tier (``reset_prefix_cache``), and with ``disk`` the disk tier too
        (its files are deleted by the worker with the next ops). Only while no load is in flight
        (the engine resets when idle). Returns the (host, disk) blocks dropped."""
        host = [blk for _, blk in self.host.values()]
        self.host.clear()
        self.free_slots = list(range(self.spec.num_host_blocks - 1, -1, -1))
        dropped = list(self.disk.values()) if disk else []
        if disk:
            self.deletes += list(self.disk)
            self.disk.clear()
            self.disk_pending.clear()  # a write in flight lands before its delete (one writer)
        for blk in host:
            if blk.block_hash not in self.disk:
                self._event(BlockRemoved, blk, "CPU")
        for blk in dropped:
            self._event(BlockRemoved, blk, "DISK")
        return len(host), len(dropped)

    def take_ops(self) -> tuple[list[TierStore], list[TierLoad], list[int]]:
        ops = self.stores, self.loads, self.deletes
        self.stores, self.loads, self.deletes = [], [], []
        return ops

    # -- the worker's answers ---------------------------------------------------------------
    def on_report(self, rep: TierReport) -> None:
        for h in rep.stores_done:
            if h in self.disk_pending:
                self.disk_pending.discard(h)
                self.stored["disk"] += 1
                self._event(BlockStored, self.disk[h], "DISK")
        for h, why in rep.store_errors:
            self.disk_pending.discard(h)
            self.disk.pop(h, None)
            self._warn_once("store:" + why.split(":")[0], "kv offload: a disk-tier write failed (%s); "
                            "those blocks stay in the device and host tiers only", why)  # fmt: skip
        for h, why in rep.load_errors:
            if self.disk.pop(h, None) is not None:
                self.deletes.append(h)  # the read is over: nothing reads the file any more
            self._warn_once("load:" + why.split(" ")[0], "kv offload: a disk-tier block was "
                            "unusable (%s); it is recomputed (a miss, never wrong output)", why)  # fmt: skip
        for key, (nbytes, secs) in rep.traffic.items():
            t = self.traffic.setdefault(key, [0, 0.0])
            t[0] += nbytes
            t[1] += secs

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def _event(self, kind, blk: TierBlock, medium: str) -> None:
        if self.events is None:
            return
        if kind is BlockStored:
            self.events.append(
                BlockStored(
                    block_hashes=[blk.block_hash], parent_block_hash=blk.parent_hash,
                    token_ids=list(blk.token_ids), block_size=len(blk.token_ids), lora_id=None,
                    medium=medium,
                )
            )  # fmt: skip
        else:
            self.events.append(BlockRemoved(block_hashes=[blk.block_hash], medium=medium))

    def save_index(self) -> None:
        """Persist the confirmed disk blocks (at shutdown; a lost index is rebuilt by a scan)."""
        if self.has_disk and self.spec.directory is not None:
            blocks = [b for h, b in self.disk.items() if h not in self.disk_pending]
            try:
                kv_block_file.save_index(self.spec, blocks)
            except OSError as e:
                code = errno.errorcode.get(e.errno, "OSError")
                self._warn_once(f"store:{code}", "kv offload: the disk index was not saved (%s: "
                                "%s); the next start rebuilds it from the files", code, e)  # fmt: skip

    # -- the ledger -------------------------------------------------------------------------
    def flat_stats(self) -> dict[str, float]:
        """The counters as one flat dict of numbers (what /metrics reads and replicas sum):
        ``<tier>_<figure>``, ``traffic_<tier>_<store|load>_<bytes|seconds>``."""
        st = self.stats()
        out: dict[str, float] = {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens}
        for tier in ("host", "disk"):
            for k in ("blocks", "bytes", "capacity_bytes", "hits", "stored"):
                out[f"{tier}_{k}"] = st[tier][k]
        for key, (nbytes, secs) in self.traffic.items():
            out[f"traffic_{key}_bytes"] = nbytes
            out[f"traffic_{key}_seconds"] = secs
        return out

    def stats(self) -> dict:
        bb = self.block_bytes
        disk_blocks = len(self.disk) - len(self.disk_pending)
        return {
            "host": {"capacity_blocks": self.spec.num_host_blocks, "blocks": len(self.host),
                     "bytes": len(self.host) * bb, "capacity_bytes": self.spec.num_host_blocks * bb,
                     "hits": self.hits["host"], "stored": self.stored["host"]},
            "disk": {"capacity_blocks": self.spec.num_disk_blocks if self.has_disk else 0,
                     "blocks": disk_blocks, "bytes": disk_blocks * bb,
                     "capacity_bytes": (self.spec.num_disk_blocks if self.has_disk else 0) * bb,
                     "hits": self.hits["disk"], "stored": self.stored["disk"],
                     "directory": self.spec.directory},
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "traffic": {k: {"bytes": int(v[0]), "seconds": v[1],
                            "bytes_per_s": v[0] / v[1] if v[1] else None}
                        for k, v in sorted(self.traffic.items())},
        }  # fmt: skip


def _same(blk: TierBlock, parent_hash: int | None, tokens: tuple[int, ...], salt: str | None) -> bool:
    return blk.token_ids == tokens and blk.salt == salt and blk.parent_hash == parent_hash
