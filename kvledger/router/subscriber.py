"""Feeds a replica's ``KVIndex`` from its KV-event stream (vLLM's transport: ZMQ SUB, multipart
``(topic, 8-byte big-endian seq, msgpack KVEventBatch)``), inside the front end's event loop,
so the index is only touched there and needs no lock. Lost batches (a sequence gap) are fetched
from the replay socket when one is known."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from kvledger.router.index import KVIndex

logger = logging.getLogger("kvledger.router")


def _connectable(endpoint: str) -> str:
    """A publisher binds ``tcp://*:5557``; a subscriber on the same host connects to loopback."""
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:").replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


class EventSubscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        index: KVIndex,
        replay_endpoint: str | None = None,
        topic: str = "",
    ) -> None:
        self.endpoint = _connectable(endpoint)
        self.replay_endpoint = _connectable(replay_endpoint) if replay_endpoint else None
        self.index = index
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(self.endpoint)
        self._ctx = ctx
        self._task: asyncio.Task | None = None
        self.batches = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                _topic, seq_b, payload = await self.sub.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            seq = int.from_bytes(seq_b, "big", signed=True)
            if self.replay_endpoint and self.index.last_seq >= 0 and seq > self.index.last_seq + 1:
                await self._replay(self.index.last_seq + 1, seq)
            self.index.apply_payload(seq, payload)
            self.batches += 1

    async def _replay(self, start: int, stop: int) -> None:
        """Ask the replay socket for batches ``start..stop-1`` (vLLM's protocol: send the start
        sequence as 8 bytes, receive ``(seq, payload)`` frames until seq -1)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), 2.0)
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0 or seq >= stop:
                    if seq < 0:
                        break
                    continue
                self.index.apply_payload(seq, frames[-1])
        except TimeoutError:
            logger.warning("KV events replay from %s timed out", self.replay_endpoint)
        finally:
            sock.close()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sub.close()
