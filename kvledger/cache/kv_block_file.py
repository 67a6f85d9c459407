"""The disk tier's file format and index (no torch: the scheduler side scans and indexes it).

One file per block and tensor-parallel rank: ``<dir>/<key>/rank<r>/<hash>.kvblk``, where ``key``
is the first 16 hex digits of the model fingerprint (so two models never share a folder). A file
is an 8-byte magic, a 4-byte little-endian header length, a JSON header and the payload: the
block's tensors exactly as the pool stores them (codes and scales for int8 / fp8 KV), layer by
layer. The header carries the fingerprint (config.json and the weight files' names, sizes and
mtimes, plus dtype, KV dtype, block size, hash algorithm, layer layout), the rank, the block's
hash, parent hash, salt and token ids, the payload's length and its CRC-32. A reader checks all
of it against what it expected; any difference is a miss, never a wrong block. Files are written
to a temporary name and renamed, so a crash mid-write leaves at most a ``*.tmp`` file, which the
scan ignores (and removes when its writer is gone).

``index.json`` beside the rank folders lists the blocks (hash, parent, salt, tokens) so a restart
does not read every header; it is rebuilt by a scan when missing, unreadable, of another
fingerprint, or not matching the files present.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass, field

from kvledger.cache.kv_tier_messages import TierBlock

MAGIC = b"KVLBLK01"
SUFFIX = ".kvblk"
INDEX = "index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class BlockFileError(Exception):
    """A block file that cannot be used (the message says why)."""


@dataclass(frozen=True)
class OffloadSpec:
    """What both sides of the tiered cache agree on; plain data, sent to every worker.

    ``block_bytes``: one rank's share of a block (its KV heads: a file's payload).
    ``directory``: this model's folder under ``--kv-offload-dir`` (None: no disk tier).
    ``facts``: what every header carries and every reader checks (dtype, KV dtype, block size,
    hash algorithm, the pool's per-block tensor layout). ``num_ranks``: tensor-parallel ranks,
    each keeping its own share of every block; the byte budgets are summed over them (vLLM's
    kv_offloading_size is too)."""

    fingerprint: str
    num_host_blocks: int
    num_disk_blocks: int
    block_bytes: int
    directory: str | None = None
    facts: dict = field(default_factory=dict)
    num_ranks: int = 1


def model_fingerprint(model_dir: str, facts: dict) -> str:
    """SHA-256 over config.json, the weight files' names / sizes / mtimes and ``facts``: a block
    computed under anything else never matches."""
    h = hashlib.sha256()
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            h.update(f.read())
        names = sorted(os.listdir(model_dir))
    except OSError:
        names = []
    for name in names:
        if name.endswith(_WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(model_dir, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps(facts, sort_keys=True).encode())
    return h.hexdigest()


def model_directory(root: str, fingerprint: str) -> str:
    return os.path.join(root, fingerprint[:16])


def block_path(directory: str, block_hash: int, rank: int = 0) -> str:
    return os.path.join(directory, f"rank{rank}", f"{block_hash:016x}{SUFFIX}")


SINK_SUFFIX = ".sink"  # beside a prompt's first block: its full-precision sinks (quantised KV)


def encode(spec: OffloadSpec, block: TierBlock, payload: bytes, rank: int = 0) -> bytes:
    """The whole file: magic, header length, header, payload."""
    header = {
        "fingerprint": spec.fingerprint,
        **spec.facts,
        "tp_rank": rank,
        "block_hash": block.block_hash,
        "parent_hash": block.parent_hash,
        "salt": block.salt,
        "token_ids": list(block.token_ids),
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + payload


def read_header(f) -> tuple[dict, int]:
    """(header, offset of the payload) from an open file; BlockFileError if malformed."""
    head = f.read(12)
    if len(head) < 12 or head[:8] != MAGIC:
        raise BlockFileError("not a kvledger block file (bad magic)")
    (n,) = struct.unpack("<I", head[8:])
    raw = f.read(n)
    if len(raw) != n:
        raise BlockFileError("truncated header")
    try:
        header = json.loads(raw)
    except ValueError:
        raise BlockFileError("corrupt header") from None
    if not isinstance(header, dict):
        raise BlockFileError("corrupt header")
    return header, 12 + n


def tier_block(header: dict) -> TierBlock:
    return TierBlock(
        int(header["block_hash"]),
        None if header["parent_hash"] is None else int(header["parent_hash"]),
        tuple(int(t) for t in header["token_ids"]),
        header["salt"],
    )


def decode(
    data: bytes, spec: OffloadSpec, block: TierBlock, rank: int = 0, payload_bytes: int | None = None
) -> memoryview:
    """The payload of a whole file after checking every header field and the CRC against what
    the reader expected (BlockFileError names the first difference). ``payload_bytes``: its
    size when it is not a block (a prompt's full-precision sinks)."""
    import io

    header, off = read_header(io.BytesIO(data))
    expect = {"fingerprint": spec.fingerprint, **spec.facts, "tp_rank": rank}
    for key, want in expect.items():
        if header.get(key) != want:
            raise BlockFileError(f"{key} differs ({header.get(key)!r}, expected {want!r})")
    try:
        got = tier_block(header)
    except (KeyError, TypeError, ValueError):
        raise BlockFileError("corrupt header") from None
    if got != block:
        raise BlockFileError("block identity differs (hash, parent, salt or tokens)")
    payload = memoryview(data)[off:]
    want = spec.block_bytes if payload_bytes is None else payload_bytes
    if len(payload) != header.get("payload_bytes") or len(payload) != want:
        raise BlockFileError(f"payload is {len(payload)} bytes, expected {want}")
    if zlib.crc32(payload) != header.get("crc32"):
        raise BlockFileError("checksum mismatch")
    return payload


# -- the index ---------------------------------------------------------------------------------
def _block_files(directory: str, rank: int = 0) -> list[str]:
    d = os.path.join(directory, f"rank{rank}")
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        if name.endswith(SUFFIX):
            out.append(os.path.join(d, name))
        elif ".tmp." in name:
            _remove_orphan(os.path.join(d, name), name)
    return out


def _remove_orphan(path: str, name: str) -> None:
    """A temporary file whose writer is gone (killed mid-write): never read, removed."""
    try:
        pid = int(name.rsplit(".", 1)[1])
        os.kill(pid, 0)
        return  # its writer still runs
    except (ValueError, ProcessLookupError):
        pass
    except OSError:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def scan(spec: OffloadSpec, rank: int = 0) -> dict[int, TierBlock]:
    """Read every block file's header: the blocks of this fingerprint (others are skipped)."""
    found: list[tuple[int, TierBlock]] = []
    for path in _block_files(spec.directory, rank):
        try:
            with open(path, "rb") as f:
                header, _ = read_header(f)
                mtime = os.fstat(f.fileno()).st_mtime_ns
            if header.get("fingerprint") != spec.fingerprint:
                continue
            found.append((mtime, tier_block(header)))
        except (OSError, BlockFileError, KeyError, TypeError, ValueError):
            continue  # a bad file is found (and reported) when a load reads it
    found.sort(key=lambda x: x[0])  # oldest first: the LRU order
    return {b.block_hash: b for _, b in found}


def load_index(spec: OffloadSpec) -> tuple[dict[int, TierBlock], bool]:
    """The disk tier's blocks, oldest first, and whether the index had to be rebuilt by a scan."""
    files = {os.path.basename(p) for p in _block_files(spec.directory)}
    try:
        with open(os.path.join(spec.directory, INDEX)) as f:
            doc = json.load(f)
        if doc["fingerprint"] != spec.fingerprint:
            raise ValueError("another fingerprint")
        blocks = {}
        for row in doc["blocks"]:
            blk = TierBlock(int(row[0]), None if row[1] is None else int(row[1]), tuple(row[3]), row[2])
            blocks[blk.block_hash] = blk
        if {f"{h:016x}{SUFFIX}" for h in blocks} != files:
            raise ValueError("index does not match the files")
        return blocks, False
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return scan(spec), True


def save_index(spec: OffloadSpec, blocks: list[TierBlock]) -> None:
    """Write index.json atomically (oldest block first: the LRU order survives the restart)."""
    doc = {
        "fingerprint": spec.fingerprint,
        "facts": spec.facts,
        "blocks": [[b.block_hash, b.parent_hash, b.salt, list(b.token_ids)] for b in blocks],
    }
    os.makedirs(spec.directory, exist_ok=True)  # raises the real cause (EROFS, EACCES...)
    path = os.path.join(spec.directory, INDEX)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def spec_dict(spec: OffloadSpec) -> dict:
    return asdict(spec)
