"""Flat keyword options (vLLM style: ``LLM(model, max_num_seqs=..., kv_cache_dtype=...)``,
``kvledger serve``'s flags) into the engine's config dataclasses, as vLLM's
``engine/arg_utils.py``. Used by the offline ``LLM`` and by ``kvledger serve``, whose front end
builds the config and hands it to its engine core processes: nothing here imports the engine
or torch.
"""

from __future__ import annotations

import logging

from kvledger.config import CacheConfig, EngineConfig, SchedulerConfig
from kvledger.errors import ConfigError

logger = logging.getLogger("kvledger")

_SCHED = {f for f in SchedulerConfig.__dataclass_fields__}
_CACHE = {f for f in CacheConfig.__dataclass_fields__}
_ENGINE = {f for f in EngineConfig.__dataclass_fields__} - {"scheduler", "cache", "model"}

# vLLM keywords that change nothing here, with why (warned about once per process when set to
# a value that would matter in vLLM).
_NO_EFFECT: dict[str, tuple[object, str]] = {
    "trust_remote_code": (False, "kvledger never runs code from a model folder"),
    "disable_log_stats": (True, "kvledger logs no periodic stats"),
    "max_seq_len_to_capture": (None, "kvledger's decode graphs cover every context length"),
    "disable_custom_all_reduce": (True, "kvledger's all-reduce is torch.distributed's"),
    "compilation_config": (None, "kvledger compiles nothing"),
    "tokenizer_mode": ("auto", "kvledger always uses the folder's (fast) tokenizer"),
}
_warned: set[str] = set()

# vLLM's older --task values and the runner each now is (the others are not served here).
_TASK_RUNNER = {
    "auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
    "classify": "pooling", "score": "pooling",
}  # fmt: skip


def _auto_runner(model: str, hf_overrides: dict | None) -> str:
    """vLLM's runner="auto": a classification or bare-decoder checkpoint (config.json's
    architecture) pools; everything else generates."""
    from pathlib import Path

    from kvledger.hf.config import model_head, read_json

    config = Path(model) / "config.json"
    if not config.is_file():
        return "generate"
    return "generate" if model_head({**read_json(config), **(hf_overrides or {})}) == "lm" else "pooling"


def _task_to_runner(kwargs: dict) -> None:
    """``task=`` (vLLM's deprecated spelling) becomes ``runner=``, with a warning once."""
    task = kwargs.pop("task", None)
    if task is None:
        return
    if task not in _TASK_RUNNER:
        raise ConfigError(
            f"task {task!r} is not supported; use runner='generate' or runner='pooling' (embed, classify, score)"
        )
    if "task" not in _warned:
        _warned.add("task")
        logger.warning("task=%r is deprecated (as in vLLM); use runner=%r", task, _TASK_RUNNER[task])
    if kwargs.get("runner", "auto") not in (_TASK_RUNNER[task], "auto"):
        raise ConfigError(f"task={task!r} contradicts runner={kwargs['runner']!r}; pass runner only")
    kwargs["runner"] = _TASK_RUNNER[task]


def build_engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """Split flat keyword options (vLLM style) into the three config dataclasses."""
    from kvledger.hf.gguf_file import find_gguf, gguf_folder
    from kvledger.hf.hub import resolve_model_path
    from kvledger.model.default import resolve_named_model

    revision, download_dir = kwargs.pop("revision", None), kwargs.pop("download_dir", None)
    tokenizer_revision = kwargs.pop("tokenizer_revision", None) or revision
    model = resolve_model_path(resolve_named_model(model), revision, download_dir)
    if kwargs.get("tokenizer"):
        kwargs["tokenizer"] = resolve_model_path(kwargs["tokenizer"], tokenizer_revision, download_dir)
    gguf = find_gguf(model)
    if gguf is not None:  # a llama.cpp file: served from a folder standing for it (hf/gguf_file.py)
        model = str(gguf_folder(gguf, kwargs.get("tokenizer")))
    for name, (neutral, why) in _NO_EFFECT.items():
        if name in kwargs and kwargs.pop(name) != neutral and name not in _warned:
            _warned.add(name)
            logger.warning("%s has no effect: %s", name, why)
    if "gpu_memory_utilization" in kwargs and not str(kwargs.get("device", "cpu")).startswith("cuda"):
        if "gpu_memory_utilization" not in _warned:
            _warned.add("gpu_memory_utilization")
            logger.warning(
                "gpu_memory_utilization has no effect on the CPU; size the KV cache with "
                "kv_cache_memory (bytes) or num_kv_blocks"
            )
    on_cuda = str(kwargs.get("device", "cpu")).startswith("cuda")
    if kwargs.get("enforce_eager") is False and not on_cuda and "enforce_eager" not in _warned:
        _warned.add("enforce_eager")
        logger.warning("enforce_eager has no effect on the CPU: CUDA graphs are captured on CUDA only")
    _task_to_runner(kwargs)
    if kwargs.get("runner", "auto") == "auto":
        kwargs["runner"] = _auto_runner(model, kwargs.get("hf_overrides"))
    if "max_num_batched_tokens" not in kwargs and "max_model_len" in kwargs:
        kwargs["max_num_batched_tokens"] = max(2048, kwargs["max_model_len"])
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED}
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE}
    eng = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE}
    if kwargs:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(kwargs))}")
    return EngineConfig(
        model=str(model), scheduler=SchedulerConfig(**sched), cache=CacheConfig(**cache), **eng
    )
