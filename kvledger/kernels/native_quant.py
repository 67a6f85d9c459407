"""Python wrappers of the native quantised-product kernels (csrc/int8_gemm.c, group_gemm.c,
q4_gemm.c), called through ctypes as kernels/native.py's are: W8A8, group-wise weight-only, and
W4A8 / the GGUF formats in tiles. Callers check ``native.available`` first."""

from __future__ import annotations

import torch

from kvledger.kernels.native import _bf16, _check
from kvledger.kernels.native_build import library

# csrc/q4_gemm.c's tile formats: their fmt codes, and bytes of codes a group of 16 rows and 32 columns
FMT = {"q4": 0, "Q4_K": 1, "q8": 2, "Q5_K": 3, "Q6_K": 4}
GROUP_BYTES = {"q4": 256, "Q4_K": 256, "q8": 512, "Q5_K": 320, "Q6_K": 384}


def quantize_rows_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of a [M, K] float32/bfloat16 tensor: (codes int8 [M, K], scales
    float32 [M]), exactly model/quant_int8.quantize_rows' values."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    lib = library()
    _check(lib.kvl_quantize_rows_i8(x.data_ptr(), int(_bf16(x)), q.data_ptr(), s.data_ptr(), m, k,
                                    torch.get_num_threads()), "quantize_rows_i8")
    return q, s


def int8_gemm(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, wsum: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """((xq @ W^T as int32) * xs[:, None]) * ws[None, :] (+ bias) in out_dtype (float32 or
    bfloat16; bias of that dtype): int8 activation codes [M, K]; the weight's codes ``wq`` in
    csrc/int8_gemm.c's tiled layout (quant_int8.pack: [N rounded up to 16, K rounded up to 4]),
    its float32 scales ``ws`` [N] and int32 row sums ``wsum``."""
    m, k = xq.shape
    n = ws.shape[0]
    if tuple(wq.shape) != (-(-n // 16) * 16, -(-k // 4) * 4) or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int8_gemm: x {tuple(xq.shape)} against a packed weight {tuple(wq.shape)} of {n} rows to {out_dtype}")
    y = torch.empty(m, n, dtype=out_dtype)
    lib = library()
    _check(
        lib.kvl_int8_gemm(
            xq.contiguous().data_ptr(), xs.data_ptr(), wq.data_ptr(), ws.data_ptr(), wsum.data_ptr(),
            None if bias is None else bias.data_ptr(), int(out_dtype == torch.bfloat16), y.data_ptr(),
            m, n, k, torch.get_num_threads(),
        ),
        "int8_gemm",
    )  # fmt: skip
    return y


def group_gemm(
    x: torch.Tensor, qw: torch.Tensor, bits: int, scales: torch.Tensor, bias: torch.Tensor | None,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (float32/bfloat16) times a group-wise weight (csrc/group_gemm.c: ``qw`` uint8
    [N, K / 2] nibbles for 4 bits, int8 [N, K] for 8; ``scales`` float32 [N, K / 32]; 4-bit
    ``zeros`` uint8 [N, K / 32], None: 8), in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = qw.shape[0]
    if qw.shape[1] * 8 // bits != k or scales.shape != (n, k // 32):
        raise ValueError(f"group_gemm: x {tuple(x.shape)} against weight {tuple(qw.shape)} / scales {tuple(scales.shape)}")
    y = torch.empty(m, n, dtype=x.dtype)
    _check(
        library().kvl_group_gemm(
            x.data_ptr(), int(_bf16(x)), qw.data_ptr(), bits, scales.data_ptr(),
            None if zeros is None else zeros.data_ptr(), None if bias is None else bias.data_ptr(),
            y.data_ptr(), m, n, k, torch.get_num_threads(),
        ),
        "group_gemm",
    )  # fmt: skip
    return y


def group_dequantize(
    qw: torch.Tensor, bits: int, scales: torch.Tensor, dtype: torch.dtype, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """The [N, K] weight a group-wise one stands for ((code - zero) x scale, rounded to dtype)."""
    n, k = qw.shape[0], qw.shape[1] * 8 // bits
    out = torch.empty(n, k, dtype=dtype)
    _check(library().kvl_group_dequantize(qw.data_ptr(), bits, scales.data_ptr(),
                                          None if zeros is None else zeros.data_ptr(), out.data_ptr(),
                                          int(dtype == torch.bfloat16), n, k, torch.get_num_threads()), "group_dequantize")
    return out


def q4_quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations [M, K] (float32/bfloat16) as int8 in groups of 32 (csrc/q4_gemm.c): codes
    [M, K], float32 scales [M, K / 32], int32 code sums [M, K / 32]."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, k // 32, dtype=torch.float32)
    sums = torch.empty(m, k // 32, dtype=torch.int32)
    _check(library().kvl_q4_quantize_act(x.data_ptr(), int(_bf16(x)), q.data_ptr(), s.data_ptr(), sums.data_ptr(),
                                         m, k, torch.get_num_threads()), "q4_quantize_act")
    return q, s, sums


def q4_gemm(
    xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, w, bias: torch.Tensor | None, out_dtype: torch.dtype,
    out: torch.Tensor | None = None, col: int = 0,
) -> torch.Tensor:
    """W4A8 / grouped W8A8 / the K-quants (csrc/q4_gemm.c): q4_quantize_act's (codes, scales,
    sums) times ``w``, a model/quant_q4.Q4Weight, in out_dtype (float32 or bfloat16; bias of that
    dtype). ``out``: write columns col..col+n of this [m, N] tensor instead (a piece of a fused
    product)."""
    m, k = xq.shape
    n = w.n
    if tuple(w.q.shape) != (-(-n // 16), k // 32, GROUP_BYTES[w.fmt]) or w.scale.shape[1] != (k // 32) >> w.sgs:
        raise ValueError(f"q4_gemm: x {tuple(xq.shape)} against {w.fmt} tiles {tuple(w.q.shape)} of {n} rows")
    y = torch.empty(m, n, dtype=out_dtype) if out is None else out
    if y.dtype != out_dtype or not y.is_contiguous() or y.shape[0] != m or col + n > y.shape[1]:
        raise ValueError(f"q4_gemm: output {tuple(y.shape)} {y.dtype} cannot take columns {col}..{col + n} of {m} rows")
    _check(
        library().kvl_q4_gemm(
            xq.data_ptr(), xs.data_ptr(), xsum.data_ptr(), w.q.data_ptr(), FMT[w.fmt], w.sgs, w.scale.data_ptr(),
            _ptr(w.zero), _ptr(w.super_scale), _ptr(bias),
            int(out_dtype == torch.bfloat16), y.data_ptr() + col * y.element_size(), y.shape[1], m, n, k,
            torch.get_num_threads(),
        ),
        "q4_gemm",
    )  # fmt: skip
    return y


def q4_dequantize(w, dtype: torch.dtype) -> torch.Tensor:
    """The [n, K] weight a model/quant_q4.Q4Weight stands for, rounded to dtype."""
    n, k = w.shape
    out = torch.empty(-(-n // 16) * 16, k, dtype=dtype)
    _check(library().kvl_q4_dequantize(w.q.data_ptr(), FMT[w.fmt], w.sgs, w.scale.data_ptr(), _ptr(w.zero),
                                       _ptr(w.super_scale), out.data_ptr(), int(dtype == torch.bfloat16), out.shape[0],
                                       k, torch.get_num_threads()), "q4_dequantize")  # fmt: skip
    return out[:n]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
