"""Native CPU kernels: C sources in csrc/, compiled on first use with the system C compiler
and cached per source and CPU, then called through ctypes.

Why not a torch C++ extension: building one takes tens of seconds and needs the torch headers;
these kernels are plain C with intrinsics and OpenMP, compile in 2-3 s once per machine
(one compiler per source, in parallel), and load in milliseconds, so start-up stays within bounds. Everything here is
optional: without a compiler, on a CPU without AVX2/FMA, or with KVLEDGER_NATIVE=0, callers
get None and use torch's own kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("kvledger")

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# Above this many rows oneDNN's packed GEMM is faster (compute starts to matter).
SMALL_GEMM_MAX_ROWS = 16


def cache_dir() -> Path:
    root = os.environ.get("KVLEDGER_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvledger"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build(cc: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile every csrc/*.c into one shared library (or reuse the cached one); return its path.

    The cache key covers the sources and headers, the flags, the compiler and the CPU's flags,
    because -march=native code must not run on another CPU. Raises OSError / SubprocessError on failure.
    """
    cc = cc or os.environ.get("CC") or "cc"
    cc_path = shutil.which(cc)
    if cc_path is None:
        raise OSError(f"no C compiler {cc!r} on PATH")
    sources = sorted(CSRC.glob("*.c"))
    headers = sorted(CSRC.glob("*.h"))
    h = hashlib.sha256()
    for part in [
        *(p.read_bytes() for p in [*sources, *headers]),
        " ".join(CFLAGS).encode(),
        cc_path.encode(),
        _cpu_flags().encode(),
    ]:
        h.update(part + b"\0")
    out_dir = out_dir or cache_dir()
    target = out_dir / f"kvledger_native-{h.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        # One compiler per source, in parallel (the first start on a machine waits for this).
        objects = [os.path.join(work, f"{p.stem}.o") for p in sources]
        procs = [
            subprocess.Popen(
                [cc_path, *CFLAGS, "-c", "-o", o, str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for p, o in zip(sources, objects, strict=True)
        ]
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=300)
                if proc.returncode != 0:
                    raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        tmp = os.path.join(work, "lib.so")
        subprocess.run([cc_path, *CFLAGS, "-o", tmp, *objects], check=True, capture_output=True, timeout=300)
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    return target


def _supported_cpu() -> bool:
    flags = _cpu_flags().split()
    return platform.machine() in ("x86_64", "AMD64") and "avx2" in flags and "fma" in flags


def enabled() -> bool:
    return os.environ.get("KVLEDGER_NATIVE", "1") != "0"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with their signatures declared, or None where they cannot run here
    (then every caller uses torch's kernels)."""
    if not enabled() or not _supported_cpu():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if getattr(e, "stderr", None) else e
        logger.warning("native kernels unavailable, using torch's: %s", detail)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvl_small_gemm.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    lib.kvl_small_gemm.restype = ctypes.c_int
    lib.kvl_paged_decode.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.kvl_paged_decode.restype = ctypes.c_int
    lib.kvl_rope_inplace.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.kvl_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.kvl_silu_mul.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    for fn in (lib.kvl_rope_inplace, lib.kvl_rms_norm, lib.kvl_silu_mul):
        fn.restype = ctypes.c_int
    return lib


def available(t: torch.Tensor) -> bool:
    """Native kernels run here and take this tensor's dtype and device (float32, CPU)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and library() is not None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: unsupported arguments")


def rope_(
    x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
    cos_table: torch.Tensor, sin_table: torch.Tensor,
) -> None:
    """Rotate-half RoPE in place on the first num_heads * head_dim floats of each row of the 2-D
    float32 x (rows may be strided, e.g. q and k inside a fused qkv output); cos/sin tables are
    [max_positions, head_dim] float32, positions int64 [rows]. head_dim % 16 == 0."""
    assert x.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
    _check(
        library().kvl_rope_inplace(
            x.data_ptr(), x.shape[0], x.stride(0), num_heads, head_dim, positions.data_ptr(),
            cos_table.data_ptr(), sin_table.data_ptr(), torch.get_num_threads(),
        ),
        "rope_",
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (a multiple of 8), float32."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    _check(
        library().kvl_rms_norm(
            x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps, torch.get_num_threads()
        ),
        "rms_norm",
    )
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a contiguous [rows, 2 * inter] float32 tensor of [gate | up] rows."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _check(
        library().kvl_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()),
        "silu_mul",
    )
    return out


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) with the native kernel; float32 CPU, K % 8 == 0,
    weight and bias contiguous (the caller checks, see Linear.forward)."""
    fn = library().kvl_small_gemm
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    rc = fn(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"small_gemm: unsupported shape x {tuple(x.shape)} weight {tuple(weight.shape)}")
    return y


def can_paged_decode(k_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether paged_decode handles this layer cache: float32 on the CPU, contiguous
    [num_blocks, block_size, num_kv_heads, head_dim] with head_dim % 8 == 0 and at most 16
    query heads per KV head."""
    if library() is None or k_cache.dtype != torch.float32 or k_cache.device.type != "cpu":
        return False
    _, _, num_kv_heads, head_dim = k_cache.shape
    return (
        k_cache.is_contiguous()
        and head_dim % 8 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """out[rows[b]] = softmax(q[rows[b]] K_b^T * scale) V_b for each decoding request b, where
    K_b, V_b are the first seq_lens[b] tokens of the blocks block_tables[b] (read in place).

    q [T, H, D] and out [T, H * D] float32 contiguous; block_tables [B, max_blocks], seq_lens and
    rows [B], all int64 with contiguous rows (the caller checks can_paged_decode first)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    rc = library().kvl_paged_decode(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows.data_ptr(),
        rows.shape[0],
        out.data_ptr(),
        out.stride(0),
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported arguments (q {tuple(q.shape)}, cache {tuple(k_cache.shape)})")
