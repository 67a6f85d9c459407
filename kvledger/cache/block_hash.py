"""Chained prefix-block hashes that every process computes alike (``--prefix-caching-hash-algo``).

A block's hash covers (parent block's hash, its token ids, the request's cache salt on the first
block), so equal hashes mean equal whole prefixes. The pool and the KV events use the same
function, which is what lets a router in another process (``kvledger.router``) hash a request's
blocks and look them up in a replica's event-fed index.

vLLM's names: ``sha256`` (its default; SHA-256 of the pickled tuple, protocol 5, which is
deterministic for ints, str and None) and ``sha256_cbor`` (SHA-256 of canonical CBOR: any
language can recompute it). ``builtin`` is Python's ``hash()``: cheapest, but salted per process
(PYTHONHASHSEED) for the salt string and ``None`` on Python < 3.12, so routing cannot use it.

Values are the low 64 bits of the big-endian digest as an unsigned int: the form vLLM puts
into KV events (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). 64 bits are enough because the pool
verifies a hit's exact tokens, parent and salt; a collision can cost a miss, never alias.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable

from kvledger.errors import ConfigError

BlockHashFn = Callable[[int | None, tuple[int, ...], str | None], int]

_MASK64 = (1 << 64) - 1
DEFAULT_HASH_ALGO = "sha256"


def _u64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & _MASK64


def sha256(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int:
    return _u64(hashlib.sha256(pickle.dumps((parent_hash, token_ids, salt), protocol=5)).digest())


def sha256_cbor(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int:
    import cbor2

    return _u64(hashlib.sha256(cbor2.dumps([parent_hash, list(token_ids), salt], canonical=True)).digest())


def builtin(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None = None) -> int:
    return hash((parent_hash, token_ids, salt))


HASH_FNS: dict[str, BlockHashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor, "builtin": builtin}
PREFIX_CACHING_HASH_ALGOS = tuple(HASH_FNS)


def get_hash_fn(algo: str) -> BlockHashFn:
    """The block hash function named ``algo`` (looked up when called, so tests can swap one)."""
    if algo not in HASH_FNS:
        raise ConfigError(
            f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, got {algo!r}"
        )
    return HASH_FNS[algo]


def hash_request_blocks(
    token_ids: list[int] | tuple[int, ...],
    block_size: int,
    salt: str | None = None,
    algo: str = DEFAULT_HASH_ALGO,
) -> list[int]:
    """The chained hashes of a prompt's full blocks, as the pool publishes them: what a router
    looks up in a replica's index (the partial last block is never cached)."""
    fn = get_hash_fn(algo)
    out: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        parent = fn(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), salt if i == 0 else None)
        out.append(parent)
    return out
