"""The ledger: every memory figure kvledger reports, computed from one set of formulas."""

from kvledger.ledger.accounting import (
    PRESETS,
    CapacityPlan,
    DoesNotFitError,
    KVBytes,
    ModelSpec,
    format_bytes,
    kv_bytes_per_token,
    load_model_spec,
    naive_vs_paged,
    parse_size,
    per_request_overhead_bytes,
    plan_capacity,
    prefix_sharing_savings,
)
from kvledger.ledger.snapshot import LedgerSnapshot, RequestBlocks

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
