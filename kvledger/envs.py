"""Every environment variable kvledger reads: name, type, default and purpose, in one place.

``from kvledger import envs; envs.KVLEDGER_FUSED_LAYER`` looks the environment up at each access
(module ``__getattr__``, as vLLM's envs.py), never at import: a test that sets a variable with
monkeypatch, or a child process started with its own environment, sees it take effect. A bad value
is a ConfigError naming the variable, raised where it is read. Nothing else in kvledger reads a
``KVLEDGER_*`` variable from ``os.environ`` (tests/test_envs.py checks); variables that belong to
other tools (RANK, WORLD_SIZE, CC, TRITON_INTERPRET, XDG_CACHE_HOME, HF_*) stay with their readers,
except ``VLLM_API_KEY``, which kvledger accepts beside its own ``KVLEDGER_API_KEY``.

Torch-free and dependency-free, so the planner and the kernels' build can both use it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvledger.errors import ConfigError

if TYPE_CHECKING:  # what each attribute returns (read by ``__getattr__`` below)
    KVLEDGER_NATIVE: bool
    KVLEDGER_NATIVE_ISA: str | None
    KVLEDGER_FUSED_LAYER: bool
    KVLEDGER_GEMM_DISPATCH: str
    KVLEDGER_BATCH_INVARIANT: bool
    KVLEDGER_INT4_ACTIVATIONS: str
    KVLEDGER_CACHE_DIR: Path
    KVLEDGER_CACHE: str | None
    KVLEDGER_MALLOPT: bool
    KVLEDGER_GC_FREEZE: bool
    KVLEDGER_ENGINE_START_METHOD: str
    KVLEDGER_STEP_TRACE: str | None
    KVLEDGER_MASK_THREADS: int
    KVLEDGER_TP_AUTHKEY: str | None
    KVLEDGER_WORKER_CONNECT_TIMEOUT: float
    KVLEDGER_API_KEY: str | None
    VLLM_API_KEY: str | None
    KVLEDGER_SERVER_LOAD_REPORT: str | None
    KVLEDGER_CHROMIUM: str

logger = logging.getLogger("kvledger")

START_METHODS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class EnvVar:
    """One variable: its reader (called at each access), its default as the docs show it, and
    what it is for (README.md's table is checked against these)."""

    read: Callable[[], Any]
    type: str
    default: str
    doc: str


def _on_unless_zero(name: str) -> Callable[[], bool]:
    """A switch that is on unless set to "0" (any other value, or none, leaves it on)."""
    return lambda: os.environ.get(name, "1") != "0"


def _text(name: str) -> Callable[[], str | None]:
    """A string; unset and empty both mean None."""
    return lambda: os.environ.get(name) or None


def _mask_threads() -> int:
    raw = os.environ.get("KVLEDGER_MASK_THREADS", "")
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"KVLEDGER_MASK_THREADS must be a positive integer, got {raw!r}")
    return int(raw)


def _connect_timeout() -> float:
    raw = os.environ.get("KVLEDGER_WORKER_CONNECT_TIMEOUT", "")
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"KVLEDGER_WORKER_CONNECT_TIMEOUT must be a positive number of seconds, got {raw!r}"
        )
    return value


GEMM_DISPATCH_MODES = ("calibrated", "builtin", "native", "onednn")


def _gemm_dispatch() -> str:
    value = os.environ.get("KVLEDGER_GEMM_DISPATCH") or "calibrated"
    if value not in GEMM_DISPATCH_MODES:
        raise ConfigError(
            f"KVLEDGER_GEMM_DISPATCH must be one of {', '.join(GEMM_DISPATCH_MODES)}, got {value!r}"
        )
    return value


def _int4_activations() -> str:
    value = os.environ.get("KVLEDGER_INT4_ACTIVATIONS") or "auto"
    if value not in ("auto", "int8", "float"):
        raise ConfigError(f"KVLEDGER_INT4_ACTIVATIONS must be one of auto, int8, float, got {value!r}")
    return value


def _start_method() -> str:
    value = os.environ.get("KVLEDGER_ENGINE_START_METHOD") or "fork"
    if value not in START_METHODS:
        raise ConfigError(
            f"KVLEDGER_ENGINE_START_METHOD must be one of {', '.join(START_METHODS)}, got {value!r}"
        )
    return value


_warned_cache = False


def _deprecated_cache() -> str | None:
    """KVLEDGER_CACHE, the tiny model's old name for the cache directory: still honoured (when
    KVLEDGER_CACHE_DIR is unset), with a DeprecationWarning and one logged warning."""
    global _warned_cache
    value = os.environ.get("KVLEDGER_CACHE") or None
    if value is not None:
        msg = "KVLEDGER_CACHE is deprecated; set KVLEDGER_CACHE_DIR instead (same meaning)"
        warnings.warn(msg, DeprecationWarning, stacklevel=3)
        if not _warned_cache:
            logger.warning(msg)
            _warned_cache = True
    return value


def _cache_dir() -> Path:
    """Where kvledger keeps what it builds once per machine (the native kernels, the tiny model):
    KVLEDGER_CACHE_DIR, else the deprecated KVLEDGER_CACHE, else $XDG_CACHE_HOME/kvledger, else
    ~/.cache/kvledger."""
    root = os.environ.get("KVLEDGER_CACHE_DIR") or _deprecated_cache()
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvledger"


environment_variables: dict[str, EnvVar] = {
    # Native CPU kernels (kvledger/kernels/native_build.py).
    "KVLEDGER_NATIVE": EnvVar(
        _on_unless_zero("KVLEDGER_NATIVE"),
        "bool",
        "1",
        "0 turns the native C kernels off: every op uses torch's kernels",
    ),
    "KVLEDGER_NATIVE_ISA": EnvVar(
        _text("KVLEDGER_NATIVE_ISA"),
        "str",
        "the CPU's best",
        "instruction set of the native build: avx512, avx512-base, avx2-vnni or avx2 (tests every path a CPU "
        "can run); torch turns the kernels off",
    ),
    "KVLEDGER_FUSED_LAYER": EnvVar(
        _on_unless_zero("KVLEDGER_FUSED_LAYER"),
        "bool",
        "1",
        "0 runs decoder layers through the modules, not one native call each (read each step)",
    ),
    "KVLEDGER_GEMM_DISPATCH": EnvVar(
        _gemm_dispatch,
        "str",
        "calibrated",
        "which kernel takes a CPU product of m rows: calibrated (timed on this machine at first "
        "start, cached), builtin (rules measured on Zen 4), native or onednn (forced)",
    ),
    "KVLEDGER_BATCH_INVARIANT": EnvVar(
        lambda: os.environ.get("KVLEDGER_BATCH_INVARIANT", "0") not in ("", "0"),
        "bool",
        "0",
        "1: every CPU product the native kernel can take takes it, prefill rows included, so a "
        "request's outputs are the same bits alone and in any batch (vLLM's VLLM_BATCH_INVARIANT)",
    ),
    "KVLEDGER_INT4_ACTIVATIONS": EnvVar(
        _int4_activations,
        "str",
        "auto",
        "what 4-bit weights multiply: int8 (activations quantised per group of 32, llama.cpp's "
        "Q4_0 x Q8_0; auto's choice for bf16/fp16 models) or float (the model dtype; auto's choice "
        "for float32 models, exact against the dequantised weights)",
    ),
    "KVLEDGER_CACHE_DIR": EnvVar(
        _cache_dir,
        "path",
        "$XDG_CACHE_HOME/kvledger or ~/.cache/kvledger",
        "where the compiled kernels and the built-in tiny model are kept",
    ),
    "KVLEDGER_CACHE": EnvVar(
        _deprecated_cache,
        "path",
        "unset",
        "deprecated name of KVLEDGER_CACHE_DIR: still honoured, with a warning",
    ),
    # Memory and the garbage collector.
    "KVLEDGER_MALLOPT": EnvVar(
        _on_unless_zero("KVLEDGER_MALLOPT"),
        "bool",
        "1",
        "0 leaves glibc's malloc thresholds alone (by default freed activation memory is kept in "
        "the heap, so steps do not page-fault it in again)",
    ),
    "KVLEDGER_GC_FREEZE": EnvVar(
        _on_unless_zero("KVLEDGER_GC_FREEZE"),
        "bool",
        "1",
        "0 leaves the garbage collector as it is (no frozen start-up heap, no deferred full "
        "collections)",
    ),
    # Engine processes.
    "KVLEDGER_ENGINE_START_METHOD": EnvVar(
        _start_method,
        "str",
        "fork",
        "how the server starts its engine core process: fork, spawn or forkserver",
    ),
    "KVLEDGER_STEP_TRACE": EnvVar(
        _text("KVLEDGER_STEP_TRACE"),
        "path",
        "unset",
        "a file each engine appends a JSON line per step to (start, end, prefill tokens, decodes)",
    ),
    "KVLEDGER_MASK_THREADS": EnvVar(
        _mask_threads,
        "int",
        "1",
        "threads for a step's grammar-mask work (structured outputs); read at each step",
    ),
    # Tensor parallelism.
    "KVLEDGER_TP_AUTHKEY": EnvVar(
        _text("KVLEDGER_TP_AUTHKEY"),
        "str",
        "unset",
        "the secret tensor-parallel workers present to the driver (required with external workers)",
    ),
    "KVLEDGER_WORKER_CONNECT_TIMEOUT": EnvVar(
        _connect_timeout,
        "float",
        "120",
        "seconds a tensor-parallel worker keeps trying to reach its driver",
    ),
    # The HTTP server.
    "KVLEDGER_API_KEY": EnvVar(
        _text("KVLEDGER_API_KEY"),
        "str",
        "unset",
        "an API key the server accepts when no --api-key is given",
    ),
    "VLLM_API_KEY": EnvVar(
        _text("VLLM_API_KEY"),
        "str",
        "unset",
        "vLLM's name for the same: accepted too, beside KVLEDGER_API_KEY",
    ),
    # Development tools (tests/ and scripts/, not the package).
    "KVLEDGER_SERVER_LOAD_REPORT": EnvVar(
        _text("KVLEDGER_SERVER_LOAD_REPORT"),
        "path",
        "unset",
        "tests/test_server_load.py writes its figures there as JSON",
    ),
    "KVLEDGER_CHROMIUM": EnvVar(
        lambda: os.environ.get("KVLEDGER_CHROMIUM") or "/usr/bin/chromium",
        "path",
        "/usr/bin/chromium",
        "the browser scripts/dashboard_screenshot.py drives",
    ),
}


def __getattr__(name: str) -> Any:
    var = environment_variables.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *environment_variables])
