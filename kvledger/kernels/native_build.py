"""The native kernels' library: C sources in csrc/, compiled on first use with the system C
compiler, cached per source, instruction set and CPU, and loaded through ctypes (``library()``).
The ops' Python wrappers are kvledger.kernels.native.

Why not a torch C++ extension: building one takes tens of seconds and needs the torch headers;
these kernels are plain C with intrinsics and OpenMP, compile in a few seconds once per machine
(one compiler per source, in parallel), and load in milliseconds, so start-up stays within bounds.

Instruction sets: every source is built for one of ``ISAS`` (csrc/simd.h), chosen at run time
from the CPU's flags, best first: ``avx512`` (AVX-512 F/BW/VL/DQ, with vdpbf16ps and vpdpwssd
where the CPU has avx512_bf16 / avx512_vnni), ``avx512-base`` (the same without those two: what
an AVX-512 CPU lacking them runs), ``avx2-vnni`` (AVX2 with avx_vnni's int8 dot products) or
``avx2`` (AVX2+FMA+F16C). ``KVLEDGER_NATIVE_ISA=avx2`` (or ``avx2-vnni``, ``avx512-base``,
``avx512``) forces one, so that a CPU can test every path it can run (``testable_isas``);
``KVLEDGER_NATIVE=0`` (or ``KVLEDGER_NATIVE_ISA=torch``) turns the kernels off (kvledger.envs).
Everything here is optional: without a compiler, on a CPU without AVX2/FMA/F16C, callers get None
and use torch's own kernels. Torch-free: nothing here needs more than ctypes.
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
import sys
import tempfile
import time
from pathlib import Path

from kvledger import envs
from kvledger.errors import ConfigError

logger = logging.getLogger("kvledger")

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# Instruction sets, best first: the CPU flags each needs, and the compiler flags it is built with.
# "avx512" adds the optional avx512_bf16 / avx512_vnni instructions where the CPU has them
# (isa_flags); "avx512-base" is the same build without them, i.e. what an AVX-512 CPU lacking them
# runs, so those fallbacks are tested (KVLEDGER_NATIVE_ISA=avx512-base) on a CPU that has them.
_AVX512 = (
    ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
)
_AVX2 = (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"))
# "avx2-vnni": the AVX2 build with avx_vnni's 256-bit vpdpbusd / vpdpwssd (Intel's client cores
# from Alder Lake on, without AVX-512): the int8 and 4-bit products' dot products in one
# instruction instead of three.
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": _AVX512,
    "avx512-base": _AVX512,
    "avx2-vnni": ((*_AVX2[0], "avx_vnni"), (*_AVX2[1], "-mavxvnni", "-DKVL_AVXVNNI")),
    "avx2": _AVX2,
}
# avx2-vnni's stand-in on an AVX-512 VNNI CPU without avx_vnni (Zen 4, Ice Lake and Sapphire
# Rapids servers): the same 8-lane code with avx512_vnni's EVEX encoding of the same 256-bit
# instructions (csrc/simd.h: KVL_VW8), so that such a CPU tests the path (testable_isas).
_AVX2_VNNI_EVEX = (
    (*_AVX2[0], "avx512f", "avx512vl", "avx512_vnni"),
    (*_AVX2[1], "-mavx512f", "-mavx512vl", "-mavx512vnni", "-DKVL_VW8", "-DKVL_VNNI_EVEX256"),
)


def _cpuinfo(field: str) -> str | None:
    """The first /proc/cpuinfo line's value for ``field`` (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return _cpuinfo("flags") or ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's word for it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_isas() -> list[str]:
    """The instruction sets of ISAS this CPU runs, best first."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = set(_cpu_flags().split())
    return [isa for isa, (needs, _) in ISAS.items() if flags.issuperset(needs)]


def _stands_in_for_avx_vnni() -> bool:
    """avx2-vnni's code runs here only through its AVX-512 VNNI stand-in."""
    flags = set(_cpu_flags().split())
    return "avx_vnni" not in flags and flags.issuperset(_AVX2_VNNI_EVEX[0])


def testable_isas() -> list[str]:
    """cpu_isas, and avx2-vnni where an AVX-512 VNNI CPU runs its stand-in: every build whose
    kernels this CPU can test (KVLEDGER_NATIVE_ISA takes each)."""
    isas = cpu_isas()
    if "avx2-vnni" not in isas and _stands_in_for_avx_vnni():
        isas.insert(isas.index("avx2") if "avx2" in isas else len(isas), "avx2-vnni")
    return isas


def isa_flags(isa: str) -> list[str]:
    """Compiler flags of one instruction set; avx512 adds vdpbf16ps and vpdpwssd where the CPU
    has them (avx512-base never does); avx2-vnni is its stand-in's on a CPU without avx_vnni."""
    if isa == "avx2-vnni" and _stands_in_for_avx_vnni():
        return list(_AVX2_VNNI_EVEX[1])
    flags = list(ISAS[isa][1])
    cpu = _cpu_flags().split()
    if isa == "avx512" and "avx512_bf16" in cpu:
        flags += ["-mavx512bf16", "-DKVL_AVX512BF16"]
    if isa == "avx512" and "avx512_vnni" in cpu:
        flags += ["-mavx512vnni", "-DKVL_AVX512VNNI"]
    return flags


def build(cc: str | None = None, out_dir: Path | None = None, isa: str = "avx2") -> Path:
    """Compile every csrc/*.c for one instruction set into one shared library (or reuse the
    cached one); return its path.

    The cache key covers the sources and headers, the flags, the compiler and the CPU's flags.
    Raises OSError / SubprocessError on failure.
    """
    cc = cc or os.environ.get("CC") or "cc"
    cc_path = shutil.which(cc)
    if cc_path is None:
        raise OSError(f"no C compiler {cc!r} on PATH")
    flags = [*CFLAGS, *isa_flags(isa)]
    sources = sorted(CSRC.glob("*.c"))
    headers = sorted(CSRC.glob("*.h"))
    h = hashlib.sha256()
    for part in [
        *(p.read_bytes() for p in [*sources, *headers]),
        " ".join(flags).encode(),
        cc_path.encode(),
        _cpu_flags().encode(),
    ]:
        h.update(part + b"\0")
    out_dir = out_dir or envs.KVLEDGER_CACHE_DIR
    target = out_dir / f"kvledger_native-{isa}-{h.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    _notice(f"compiling kvledger's native CPU kernels ({isa}; once per CPU, cached in {out_dir}) ...")
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        # One compiler per source, in parallel (the first start on a machine waits for this).
        objects = [os.path.join(work, f"{p.stem}.o") for p in sources]
        procs = [
            subprocess.Popen(
                [cc_path, *flags, "-c", "-o", o, str(p)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
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
        subprocess.run([cc_path, *flags, "-o", tmp, *objects, "-lm"], check=True, capture_output=True, timeout=300)
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    _notice(f"native CPU kernels compiled in {time.monotonic() - t0:.1f} s")
    return target


def _notice(message: str) -> None:
    """INFO through logging where the application configured it (``kvledger serve``); else on
    stderr, so that the first start's wait for the compiler is never silent (vLLM, too, logs
    INFO to stderr by default)."""
    if logging.getLogger().handlers or logger.handlers:
        logger.info(message)
    else:
        print(f"INFO kvledger: {message}", file=sys.stderr, flush=True)


def _supported_cpu() -> bool:
    return bool(cpu_isas())


def enabled() -> bool:
    """The kernels are on: KVLEDGER_NATIVE is not 0 and KVLEDGER_NATIVE_ISA not torch."""
    return envs.KVLEDGER_NATIVE and envs.KVLEDGER_NATIVE_ISA != "torch"


def selected_isa() -> str | None:
    """The instruction set library() loads: KVLEDGER_NATIVE_ISA if this CPU runs it (or its
    stand-in: testable_isas), else the best this CPU runs; None when the kernels are off or no variant runs here."""
    if not enabled():
        return None
    isas = cpu_isas()
    want = envs.KVLEDGER_NATIVE_ISA
    if want:
        if want not in ISAS:
            choices = ", ".join([*ISAS, "torch"])
            raise ConfigError(f"KVLEDGER_NATIVE_ISA={want!r}: expected one of {choices}")
        if want in testable_isas():
            return want
        best = isas[0] if isas else "torch"
        logger.warning("KVLEDGER_NATIVE_ISA=%s: this CPU lacks it; using %s", want, best)
    return isas[0] if isas else None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with their signatures declared, or None where they cannot run here
    (then every caller uses torch's kernels)."""
    isa = selected_isa()
    if isa is None:
        return None
    try:
        lib = ctypes.CDLL(str(build(isa=isa)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if getattr(e, "stderr", None) else e
        logger.warning("native kernels unavailable, using torch's: %s", detail)
        return None
    i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for fn in (lib.kvl_small_gemm_packed, lib.kvl_small_gemm_bf16_packed, lib.kvl_small_gemm_bf16,
               lib.kvl_small_gemm_bf16_packed_f32out):
        fn.argtypes = [ptr] * 4 + [i64] * 3 + [c_int]
    lib.kvl_packed_weight_numel.argtypes = [i64, i64]
    lib.kvl_packed_weight_numel.restype = i64
    lib.kvl_pack_weight.argtypes = [ptr, ptr, i64, i64, c_int]
    lib.kvl_paged_decode.argtypes = [
        ptr, i64, ptr, ptr, c_int, c_int, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, c_int,
        i64, i64, i64, i64, c_float, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, c_int,
    ]  # fmt: skip
    lib.kvl_paged_prefill.argtypes = [
        ptr, i64, ptr, ptr, c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, c_int, i64, i64, i64, i64, c_float,
        c_int,
    ]  # fmt: skip
    lib.kvl_paged_prefill_tree.argtypes = [*lib.kvl_paged_prefill.argtypes, ptr]
    for fn in (lib.kvl_rope_inplace, lib.kvl_rope_inplace_bf16):
        fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, c_int]
    for fn in (lib.kvl_rms_norm, lib.kvl_rms_norm_bf16):
        fn.argtypes = [ptr, ptr, ptr, i64, i64, c_float, c_int]
    for fn in (lib.kvl_silu_mul, lib.kvl_silu_mul_bf16):
        fn.argtypes = [ptr, ptr, i64, i64, c_int]
    lib.kvl_write_kv.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, c_int]
    for fn in (lib.kvl_add_rms_norm, lib.kvl_add_rms_norm_bf16):
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, c_float, c_int]
    lib.kvl_decoder_layer.argtypes = [ptr, ptr, ptr]  # structs of kvledger.model.fused_layer
    lib.kvl_quantize_write.argtypes = [ptr, ptr, i64, c_int, ptr, i64, i64, i64, ptr, ptr, c_int, c_int, ptr, ptr, c_int]
    lib.kvl_masked_argmax.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, c_int]
    lib.kvl_masked_argmax.restype = c_int
    lib.kvl_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, c_int]
    lib.kvl_argmax_rows.restype = c_int
    lib.kvl_quantize_rows_i8.argtypes = [ptr, c_int, ptr, ptr, i64, i64, c_int]
    lib.kvl_int8_gemm.argtypes = [ptr] * 6 + [c_int, ptr, i64, i64, i64, c_int]
    lib.kvl_group_gemm.argtypes = [ptr, c_int, ptr, c_int, ptr, ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.kvl_group_dequantize.argtypes = [ptr, c_int, ptr, ptr, ptr, c_int, i64, i64, c_int]
    lib.kvl_q4_quantize_act.argtypes = [ptr, c_int, ptr, ptr, ptr, i64, i64, c_int]
    lib.kvl_q4_gemm.argtypes = [ptr] * 4 + [c_int, c_int, ptr, ptr, ptr, ptr, c_int, ptr, i64, i64, i64, i64, c_int]
    lib.kvl_q4_dequantize.argtypes = [ptr, c_int, c_int, ptr, ptr, ptr, ptr, c_int, i64, i64, c_int]
    for fn in (lib.kvl_small_gemm_packed, lib.kvl_small_gemm_bf16_packed, lib.kvl_small_gemm_bf16,
               lib.kvl_small_gemm_bf16_packed_f32out, lib.kvl_pack_weight, lib.kvl_bf16_packed_available,
               lib.kvl_paged_decode, lib.kvl_paged_prefill, lib.kvl_rope_inplace, lib.kvl_rope_inplace_bf16,
               lib.kvl_paged_prefill_tree,
               lib.kvl_rms_norm, lib.kvl_rms_norm_bf16, lib.kvl_silu_mul, lib.kvl_silu_mul_bf16,
               lib.kvl_quantize_write, lib.kvl_write_kv, lib.kvl_add_rms_norm, lib.kvl_add_rms_norm_bf16,
               lib.kvl_decoder_layer, lib.kvl_quantize_rows_i8, lib.kvl_int8_gemm, lib.kvl_int8_vnni,
               lib.kvl_group_gemm, lib.kvl_group_dequantize, lib.kvl_q4_quantize_act, lib.kvl_q4_gemm,
               lib.kvl_q4_dequantize):
        fn.restype = c_int
    lib.isa = isa
    lib.bf16_packed = bool(lib.kvl_bf16_packed_available())
    lib.tile_width = lib.kvl_packed_tile_width()
    lib.vector_width = lib.kvl_vector_width()
    lib.int8_vnni = bool(lib.kvl_int8_vnni())
    return lib
