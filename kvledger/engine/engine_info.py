"""What a front end needs to know about an engine it does not hold: the served model's facts
(context, vocabulary, sampling defaults, pool size) and the named reads it may ask for.

An engine core in another process cannot run a front end's closures, so every read the server
makes of a live engine is a *named query*: a function of the engine registered here, run
between steps in the process that owns it (in-process: the engine thread). Results are plain
data (dataclasses, dicts, lists), so they cross a process boundary by pickle.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvledger.core.engine import LLMEngine


@dataclass
class EngineInfo:
    """The engine's fixed facts, read once when it is built (the core's handshake)."""

    model: str
    tokenizer: str | None  # where the front end loads its own tokenizer from
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    bytes_per_token: int
    reference_bytes_per_token: int  # KV bytes per token in the model's own dtype
    max_num_batched_tokens: int = 0
    prefix_caching_hash_algo: str = ""
    model_type: str | None = None
    architectures: list[str] | None = None
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    has_tokenizer: bool = True
    tensor_parallel_size: int = 1  # TP ranks behind this engine
    runner: str = "generate"  # "pooling": the model embeds (kvledger/pooling)
    pooler_config: Any = None  # pooling.config.PoolerConfig of a pooling engine

    @classmethod
    def from_engine(cls, eng: LLMEngine) -> EngineInfo:

        name = str(eng.model_dtype).removeprefix("torch.")
        spec = dataclasses.replace(eng.spec, dtype=name) if name != eng.spec.dtype else eng.spec
        cfg = eng.config
        return cls(
            model=str(cfg.model),
            tokenizer=str(cfg.tokenizer or cfg.model),
            max_model_len=eng.max_model_len,
            vocab_size=eng.vocab_size,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            num_blocks=eng.kv.pool.num_blocks,
            block_size=eng.kv.block_size,
            bytes_per_token=eng.bytes_per_token,
            reference_bytes_per_token=_reference_bytes_per_token(eng, spec),
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            prefix_caching_hash_algo=str(eng.kv.hash_algo),
            model_type=eng.hf_config.get("model_type"),
            architectures=eng.hf_config.get("architectures"),
            default_sampling_params=dict(eng.default_sampling_params),
            has_tokenizer=eng.tokenizer is not None,
            tensor_parallel_size=cfg.tensor_parallel_size,
            runner="pooling" if eng.pooler_config is not None else "generate",
            pooler_config=eng.pooler_config,
        )


def _reference_bytes_per_token(eng: LLMEngine, spec) -> int:
    """KV bytes per pool slot in the model's own dtype (what quantised storage is measured
    against); for a hybrid model a slot holds one KV cache group's layers."""
    from kvledger.ledger.accounting import kv_bytes_per_token

    total = kv_bytes_per_token(spec, "auto").total
    lay = eng.kv_layout
    return total // spec.num_layers * lay.group_size if lay.is_hybrid else total


# -- named queries ----------------------------------------------------------------------------


def _ledger(eng: LLMEngine) -> dict[str, Any]:
    """``/v1/ledger``'s body: the live ledger plus the scheduler's queue sizes."""
    from kvledger.ledger.frame import ledger_body

    return ledger_body(eng.ledger(), eng.scheduler)


def _metrics_state(eng: LLMEngine) -> Any:
    """``/metrics``' engine statistics (plain data; the server formats them)."""
    from kvledger.engine.stats import capture_stats

    return capture_stats(eng)


def _dashboard_frame(eng: LLMEngine, reference_bpt: int) -> Any:
    """A dashboard frame less its block map, and the pool state to draw the map from."""
    from kvledger.ledger.frame import capture_frame_parts

    return capture_frame_parts(
        eng.scheduler,
        eng.ledger(),
        time=time.time(),
        max_model_len=eng.max_model_len,
        reference_bytes_per_token=reference_bpt,
    )


def _series_point(eng: LLMEngine) -> dict[str, float]:
    from kvledger.ledger.frame import series_point

    return series_point(eng.scheduler, time.time(), eng.num_generated_tokens)


def _load(eng: LLMEngine) -> dict[str, int]:
    """Queue sizes: what a router balances on."""
    s = eng.scheduler
    return {"running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            "used_blocks": eng.kv.num_used_blocks}  # fmt: skip


ENGINE_QUERIES: dict[str, Callable[..., Any]] = {
    "ledger": _ledger,
    "metrics_state": _metrics_state,
    "dashboard_frame": _dashboard_frame,
    "series_point": _series_point,
    "load": _load,
    "reset_prefix_cache": lambda eng, reset_connector=False: eng.reset_prefix_cache(reset_connector=reset_connector),
}


def run_query(eng: LLMEngine, name: str, args: tuple | list = ()) -> Any:
    fn = ENGINE_QUERIES.get(name)
    if fn is None:
        raise KeyError(f"unknown engine query {name!r}; known: {', '.join(sorted(ENGINE_QUERIES))}")
    return fn(eng, *args)
