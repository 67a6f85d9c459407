"""KV-cache events in vLLM's wire format, so routers built for vLLM (llm-d, Dynamo, Ray Serve)
can follow a kvledger engine's prefix cache exactly.

The block pool records a ``BlockStored`` when a full block enters its prefix index, a
``BlockRemoved`` when one leaves it (eviction) and ``AllBlocksCleared`` when a prefix-cache
reset empties it; the engine collects them per step into a ``KVEventBatch`` and hands the batch
to a publisher. The ZMQ publisher sends ``(topic, 8-byte big-endian sequence number, msgpack
payload)`` on a PUB socket from a background thread (the step loop never waits on a socket) and
keeps the last ``buffer_steps`` batches for a ROUTER replay socket: a client sends the first
sequence number it missed and gets ``(seq, payload)`` for each buffered batch from there on,
then ``(-1, b"")`` as the end marker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from kvledger.errors import ConfigError
from kvledger.json_config import json_object, refuse_unknown

logger = logging.getLogger(__name__)

# Where vLLM's blocks live; kvledger's prefix index is on the model's device pool only.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (the class name) leads each encoded event."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same keys and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """From a KVEventsConfig, a dict or a JSON string (the CLI flag); names the bad key."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object("kv_events_config", value)
        refuse_unknown("kv_events_config", value, cls)
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "hwm" else 1):
                raise ConfigError(f"kv_events_config.{name} must be a positive integer, got {v!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv_events_config.{name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ConfigError("kv_events_config.replay_endpoint must be a string or null")


class EventPublisher:
    """Null publisher: events are dropped (vLLM's "null")."""

    def publish(self, batch: KVEventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _bind_or_connect(sock, endpoint: str) -> None:
    # As vLLM: a wildcard host or a local transport is ours to bind; anything else is a peer.
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class ZmqEventPublisher(EventPublisher):
    """PUB socket plus optional ROUTER replay socket, both owned by one background thread."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        import zmq

        self._zmq = zmq
        self.cfg = cfg
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = cfg.topic.encode()
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._replay = None
        try:
            _bind_or_connect(self._pub, cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"kv_events_config: cannot open ZMQ endpoint: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kvledger-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if self.data_parallel_rank is not None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)  # bounded (max_queue_size); the PUB socket itself never blocks

    def _run(self) -> None:
        while True:
            self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload), copy=False)
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        sock = self._replay
        if sock is None:
            return
        zmq = self._zmq
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events replay: malformed request (%d frames) ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            sock.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=100)
        self._ctx.term()


def make_publisher(cfg: KVEventsConfig | None, data_parallel_rank: int | None = None) -> EventPublisher | None:
    """None when events are off (the pool then records nothing)."""
    if cfg is None or not cfg.enable_kv_cache_events:
        return None
    if cfg.publisher == "null":
        return EventPublisher()
    return ZmqEventPublisher(cfg, data_parallel_rank)


def make_batch(events: list[KVCacheEvent]) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=events)
