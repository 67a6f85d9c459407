"""The ledger: every memory figure kvledger reports, computed from one set of formulas."""

from kvledger.ledger.accounting import (
    CapacityPlan,
    DoesNotFitError,
    KVBytes,
    format_bytes,
    kv_bytes_per_token,
    naive_vs_paged,
    parse_size,
    per_request_overhead_bytes,
    plan_capacity,
    prefix_sharing_savings,
)
from kvledger.ledger.snapshot import LedgerSnapshot, RequestBlocks
from kvledger.ledger.spec import PRESETS, ModelSpec, load_model_spec

__all__ = [
    "PRESETS",
    "CapacityPlan",
    "DoesNotFitError",
    "KVBytes",
    "LedgerSnapshot",
    "RequestBlocks",
    "ModelSpec",
    "format_bytes",
    "kv_bytes_per_token",
    "load_model_spec",
    "naive_vs_paged",
    "parse_size",
    "per_request_overhead_bytes",
    "plan_capacity",
    "prefix_sharing_savings",
]
