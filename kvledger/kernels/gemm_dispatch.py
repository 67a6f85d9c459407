"""Which kernel takes a CPU product of m rows: a rule measured on the machine it runs on.

The native row-wise kernel (native.small_gemm) and oneDNN (on the row bucket, gemm_rows) trade
places at row counts that depend on the CPU: on Zen 4 (AVX-512 with vdpbf16ps, no AMX) the native
kernel is within a few per cent of oneDNN up to ~1,000 rows in both dtypes, while on an Intel Xeon
with AMX oneDNN's bf16 tiles run 1.5-7.8x faster past ~8 rows (issue 41). A rule tuned on one of
them and shipped as a constant is wrong on the other, so at start-up kvledger times both kernels on
the model's own layer weights at a few row counts (model/gemm_calibration.py) and keeps the times
here; a product then takes the kernel whose interpolated time is lower, the native one while it is
within TOLERANCE of oneDNN (a product it takes keeps the native decoder layer and bf16 row
invariance, which oneDNN's products lose).

Modes (``KVLEDGER_GEMM_DISPATCH``): ``calibrated`` (default; the measured table, cached per CPU,
flags, threads and shapes), ``builtin`` (the rules measured on Zen 4, small_gemm_max_rows and
small_gemm_whole below), ``native`` (every product the native kernel can take), ``onednn`` (only the
rows batch invariance needs).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvledger.envs import GEMM_DISPATCH_MODES as MODES
from kvledger.errors import ConfigError
from kvledger.kernels.native_build import library

# The native kernel keeps a product while it takes at most this much of oneDNN's time: issue 41's
# bound on what kvledger may lose to the library beside it, spent on keeping the native decoder
# layer and bf16 row invariance where the two are this close.
TOLERANCE = 1.05
# Row counts timed: every one is its own oneDNN bucket (gemm_rows.gemm_rows_bucket), so oneDNN's
# time there is measured, not padded; between them times are interpolated.
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
CACHE_VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _interp(rows: tuple[int, ...], ms: tuple[float, ...], m: int) -> float:
    """Piecewise-linear time at m rows; past the last probe, its time per row times m."""
    if m >= rows[-1]:
        return ms[-1] * m / rows[-1]
    if m <= rows[0]:
        return ms[0]
    i = bisect.bisect_right(rows, m)
    r0, r1, t0, t1 = rows[i - 1], rows[i], ms[i - 1], ms[i]
    return t0 + (t1 - t0) * (m - r0) / (r1 - r0)


@dataclass(frozen=True)
class GemmDispatch:
    """One model's kernel choice per row count, in its dtype (``dtype``: "float32",
    "bfloat16"). Calibrated: ``rows`` timed, ``native_ms`` the native kernel's time on them,
    ``library_ms`` oneDNN's (each summed over one decoder layer's products)."""

    mode: str = "builtin"
    dtype: str = ""
    rows: tuple[int, ...] = ()
    native_ms: tuple[float, ...] = ()
    library_ms: tuple[float, ...] = ()
    seconds: float = 0.0  # what the calibration took (0: read from the cache or not calibrated)
    source: str = ""  # "measured", the cache file's path, or why it is builtin
    noisy: bool = False  # measured while the cores were busy (then not cached)
    _table: bytes = field(default=b"", repr=False, compare=False)
    _torch_dtype: torch.dtype | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"KVLEDGER_GEMM_DISPATCH must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "calibrated":
            n = len(self.rows)
            if n == 0 or n != len(self.native_ms) or n != len(self.library_ms):
                raise ValueError("a calibrated GemmDispatch needs times at its rows")
            if list(self.rows) != sorted(set(self.rows)) or min(self.native_ms + self.library_ms) <= 0:
                raise ValueError("calibrated rows must ascend and times be positive")
            top = self.rows[-1]
            object.__setattr__(self, "_table", bytes(self._decide(m) for m in range(top + 1)))
            object.__setattr__(self, "_torch_dtype", getattr(torch, self.dtype, None))

    def _decide(self, m: int) -> bool:
        if m < 1:
            return True
        t_native = _interp(self.rows, self.native_ms, m)
        t_library = _interp(self.rows, self.library_ms, gemm_rows_bucket(m))
        return t_native <= TOLERANCE * t_library

    def native_takes(self, m: int, dtype: torch.dtype) -> bool:
        """A product of m rows in this dtype takes the native row-wise kernel (where the
        kernel has the weight; the caller checks that). A dtype it was not calibrated in
        follows the builtin rules."""
        if self.mode == "native":
            return True
        if self.mode == "onednn":
            return False
        if self.mode == "calibrated" and dtype == self._torch_dtype:  # per product: no string work
            return bool(self._table[m]) if m < len(self._table) else self._decide(m)
        return builtin_row_wise(m, dtype)

    def ranges(self, top: int, dtype: torch.dtype) -> list[tuple[int, int, bool]]:
        """(first row, last row, native?) runs over 1..top, for logs and `kvledger doctor`."""
        out: list[tuple[int, int, bool]] = []
        for m in range(1, top + 1):
            takes = self.native_takes(m, dtype)
            if out and out[-1][2] == takes:
                out[-1] = (out[-1][0], m, takes)
            else:
                out.append((m, m, takes))
        return out

    def describe(self, top: int, dtype: torch.dtype) -> str:
        """One line: the mode and which kernel takes which rows of 1..top in ``dtype``."""
        parts = [
            f"{'native' if n else 'oneDNN'} {a}" + (f"-{b}" if b > a else "")
            for a, b, n in self.ranges(top, dtype)
        ]
        how = f"{self.mode} ({self.source})" if self.source else self.mode
        return f"GEMM dispatch {how}, {dtype_name(dtype)}: " + ", ".join(parts) + " rows"

    def to_json(self) -> dict:
        return {
            "version": CACHE_VERSION,
            "dtype": self.dtype,
            "rows": list(self.rows),
            "native_ms": list(self.native_ms),
            "library_ms": list(self.library_ms),
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: dict, source: str) -> GemmDispatch:
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"cache version {data.get('version')!r}, expected {CACHE_VERSION}")
        return cls(
            "calibrated",
            str(data["dtype"]),
            tuple(int(r) for r in data["rows"]),
            tuple(float(t) for t in data["native_ms"]),
            tuple(float(t) for t in data["library_ms"]),
            source=source,
        )


# Up to this many rows the native blocked-layout GEMM is at least as fast as oneDNN's packed one
# (AVX-512, bench-60m shapes, 8-64 rows: 1.0-1.6x, docs/measurements/cpu_kernels.md, "The few-row
# GEMM on its own weight layout"); the AVX2 build keeps the 16 rows measured for its row-major
# predecessor (not timed on an AVX2 CPU).
SMALL_GEMM_MAX_ROWS = 64
SMALL_GEMM_MAX_ROWS_AVX2 = 16


def small_gemm_max_rows() -> int:
    """Products of at most this many rows take small_gemm (0 where there is no library)."""
    lib = library()
    if lib is None:
        return 0
    return SMALL_GEMM_MAX_ROWS if lib.vector_width == 16 else SMALL_GEMM_MAX_ROWS_AVX2


# The builtin rules (KVLEDGER_GEMM_DISPATCH=builtin, and where nothing was calibrated): measured on
# Zen 4 only. A start calibrates its own instead (kernels/gemm_dispatch.py).
#
# Past its few-row range the native kernel also takes a product whole where that beats oneDNN on the
# bucket's padded rows (gemm_rows.row_wise). Measured on Zen 4 (the AVX-512 build with vdpbf16ps,
# the 60M model's four layer weights, docs/measurements/cpu_kernels.md, "Past the few-row range"):
# per row it takes 0.87-0.99x oneDNN's time up to 1,024 rows in float32 and 1.02-1.05x above, in
# bf16 1.01-1.08x; a bf16 mixed step all through it also stops computing its decode rows twice.
# Whole steps of 263-1,300 rows took 0.88-0.93x the time in float32, 0.93-0.98x in bf16 (beside only
# seven decodes 0.90-1.02x). bf16 went from 512 to 1,024 rows with the native decoder layer
# (fused_layer), which takes a step only when all its products are row-wise: whole bf16 steps of
# 758-1,008 rows beside 8-58 decodes then took 0.88-0.94x the time, a lone 800-token prompt 0.96x
# (session 16). Other builds keep oneDNN past small_gemm_max_rows() (not measured).
WHOLE_ROWS = {torch.float32: 1024, torch.bfloat16: 1024}  # up to these rows, always
WHOLE_ROW_COST = 1.06  # past them, when rows x this is under the bucket's rows


def small_gemm_whole(m: int, padded: int, dtype: torch.dtype) -> bool:
    """A product of m rows (oneDNN would run ``padded``) is faster in the native kernel whole."""
    lib = library()
    if lib is None or lib.vector_width != 16 or dtype not in WHOLE_ROWS:
        return False
    if dtype == torch.bfloat16 and not lib.bf16_packed:
        return False
    return m <= WHOLE_ROWS[dtype] or m * WHOLE_ROW_COST < padded


def builtin_row_wise(m: int, dtype: torch.dtype) -> bool:
    """The builtin rules: few rows (small_gemm_max_rows), or rows the native kernel computes
    faster than oneDNN computes their bucket (small_gemm_whole)."""
    return m <= small_gemm_max_rows() or small_gemm_whole(m, gemm_rows_bucket(m), dtype)


def gemm_rows_bucket(m: int) -> int:
    """The row count a CPU GEMM of ``m`` rows is padded to.

    oneDNN (and ideep in front of it) build and cache a primitive per GEMM shape, ~250 KB each,
    in LRU caches of 1,024 entries: with every prefill length its own shape, a server's resident
    memory grew by hundreds of MiB over thousands of requests, and each new length paid for a
    primitive's creation (issue 23). Rounding up to a multiple of 16 below 256 rows (where a
    GEMM streams its weight, so extra rows are nearly free) and to 8 steps per power of two
    above (<= 12.5 % padding where it computes) leaves ~40 shapes per weight up to 2,048 rows.
    """
    if m <= 16:
        return m
    step = max(16, 1 << max(0, (m - 1).bit_length() - 4))
    return -(-m // step) * step


BUILTIN = GemmDispatch()


def machine_key(extra: dict) -> tuple[str, dict]:
    """The cache key of a calibration: CPU model and flags, threads, the native build and torch,
    plus ``extra`` (dtype, shapes, rows); a hash of it names the file, the dict goes inside."""
    from kvledger.kernels.native_build import _cpu_flags, cpu_model

    lib = library()
    key = {
        "cpu": cpu_model(),
        "flags": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
        "native_build": None if lib is None else os.path.basename(getattr(lib, "_name", "")),
        **extra,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return digest, key


def cache_path(digest: str) -> Path:
    from kvledger import envs

    return envs.KVLEDGER_CACHE_DIR / "gemm_dispatch" / f"{digest}.json"


def read_cached(digest: str, key: dict) -> GemmDispatch | None:
    """The calibration cached under ``digest`` if it is there, whole and for this key."""
    path = cache_path(digest)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        return GemmDispatch.from_json(data, str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cached(digest: str, key: dict, dispatch: GemmDispatch) -> Path | None:
    """Keep a calibration for the next start (written whole, then renamed into place)."""
    path = cache_path(digest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({**dispatch.to_json(), "key": key}, f)
        os.replace(f.name, path)
        return path
    except OSError:
        return None
