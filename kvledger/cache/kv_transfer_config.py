"""vLLM's ``--kv-transfer-config`` for the one connector kvledger has: ``OffloadingConnector``.

vLLM moves KV between instances and tiers through KV connectors, chosen and configured by this
JSON. kvledger's tiered prefix cache (kvledger/cache/kv_tiers.py) plays the OffloadingConnector's
role (host-memory offloading), so that connector's config is accepted and mapped onto the host
tier: ``kv_connector_extra_config.num_cpu_blocks`` (blocks of ``block_size`` tokens, vLLM's
extra key, default the engine's block size) or ``cpu_bytes_to_use``. Every other connector
(LMCache, NIXL, P2P...) is refused with what is available instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import ConfigError
from kvledger.json_config import json_object

CONNECTOR = "OffloadingConnector"


@dataclass(frozen=True)
class OffloadingRequest:
    """The host tier a kv_transfer_config asks for: ``tokens`` or ``bytes`` (one of them)."""

    tokens: int = 0
    bytes: int = 0


def parse_kv_transfer_config(value: dict | str, block_size: int) -> OffloadingRequest:
    value = json_object("kv_transfer_config", value)
    connector = value.get("kv_connector")
    if connector != CONNECTOR:
        raise ConfigError(
            f"kv_transfer_config: kv_connector {connector!r} is not available; kvledger has "
            f"{CONNECTOR!r} (its host and disk tiers: see --kv-offload-dir)"
        )
    role = value.get("kv_role", "kv_both")
    if role != "kv_both":
        raise ConfigError(f"kv_transfer_config: kv_role must be 'kv_both' for {CONNECTOR}, got {role!r}")
    extra = value.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_transfer_config: kv_connector_extra_config must be an object")
    unknown = set(extra) - {"num_cpu_blocks", "cpu_bytes_to_use", "block_size"}
    if unknown:
        raise ConfigError(f"kv_transfer_config: unknown kv_connector_extra_config key(s) {sorted(unknown)}")
    size = extra.get("block_size", block_size)
    if not isinstance(size, int) or size <= 0 or size % block_size:
        raise ConfigError(
            f"kv_transfer_config: block_size must be a positive multiple of the engine's {block_size}, got {size!r}"
        )
    blocks, nbytes = extra.get("num_cpu_blocks"), extra.get("cpu_bytes_to_use")
    if (blocks is None) == (nbytes is None):
        raise ConfigError(f"kv_transfer_config: {CONNECTOR} needs num_cpu_blocks or cpu_bytes_to_use (one of them)")
    for name, v in (("num_cpu_blocks", blocks), ("cpu_bytes_to_use", nbytes)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"kv_transfer_config: {name} must be a positive integer, got {v!r}")
    return OffloadingRequest(tokens=(blocks or 0) * size, bytes=nbytes or 0)
