"""The wire between a front end and an engine core process: message kinds and their codec.

Each message is two ZMQ frames, a one-byte kind and a body. The hot path (outputs, every
step) is msgpack through msgspec's typed decoder; requests carry their token ids as msgpack
and their ``SamplingParams`` pickled (it holds enums and a parsed grammar's source); rare
messages (handshake, acks, query results, errors) are pickled whole, so an engine's own
exception (``InvalidRequestError``, ``ConfigError``) reaches the front end as itself.
Prompt token ids never travel back: the front end has them and restores them.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec

from kvledger.outputs import PoolingRequestOutput, RequestOutput

# front end -> core
ADD = b"A"  # (request id, prompt ids, prompt text, pickled params, arrival, priority, cache salt)
ABORT = b"X"  # [request id, ...]
QUERY = b"Q"  # pickled (query id, name, args)
SHUTDOWN = b"S"
# core -> front end
READY = b"R"  # pickled EngineInfo
OUTPUTS = b"O"  # msgpack list[RequestOutput]
ACK = b"K"  # pickled (request id, exception or None)
RESULT = b"Q"  # pickled (query id, ok, result or exception)
DEAD = b"D"  # pickled exception: the core stopped

_encoder = msgspec.msgpack.Encoder()
# Generation and pooling outputs travel as two lists (msgpack cannot tell the dataclasses apart).
_outputs_decoder = msgspec.msgpack.Decoder(tuple[list[RequestOutput], list[PoolingRequestOutput]])
_add_decoder = msgspec.msgpack.Decoder(tuple[str, list[int], str | None, bytes, float, int, str | None])
_abort_decoder = msgspec.msgpack.Decoder(list[str])


def encode_outputs(outs: list[RequestOutput | PoolingRequestOutput]) -> bytes:
    pooled = [o for o in outs if isinstance(o, PoolingRequestOutput)]
    if pooled:
        outs = [o for o in outs if not isinstance(o, PoolingRequestOutput)]
    return _encoder.encode((outs, pooled))


def decode_outputs(body: bytes) -> list[RequestOutput | PoolingRequestOutput]:
    generated, pooled = _outputs_decoder.decode(body)
    return [*generated, *pooled] if pooled else generated


def encode_add(
    rid: str, ids: list[int], text: str | None, params: Any, arrival: float, priority: int,
    cache_salt: str | None = None,
) -> bytes:  # fmt: skip
    return _encoder.encode(
        (rid, ids, text, pickle.dumps(params, protocol=5), arrival, priority, cache_salt)
    )


def decode_add_envelope(body: bytes) -> tuple[str, list[int], str | None, bytes, float, int, str | None]:
    """ADD with its SamplingParams still pickled (the core unpickles it under the request's
    own error handling)."""
    return _add_decoder.decode(body)


def decode_add(body: bytes) -> tuple[str, list[int], str | None, Any, float, int, str | None]:
    rid, ids, text, params, arrival, priority, salt = decode_add_envelope(body)
    return rid, ids, text, pickle.loads(params), arrival, priority, salt


def encode_abort(rids: list[str]) -> bytes:
    return _encoder.encode(rids)


def decode_abort(body: bytes) -> list[str]:
    return _abort_decoder.decode(body)


def dump(obj: Any) -> bytes:
    """Pickle a rare message; an exception that will not pickle travels as its text."""
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception:
        if isinstance(obj, tuple):
            return pickle.dumps(
                tuple(RuntimeError(str(x)) if isinstance(x, BaseException) else x for x in obj)
            )
        return pickle.dumps(RuntimeError(str(obj)))


def load(body: bytes) -> Any:
    return pickle.loads(body)
