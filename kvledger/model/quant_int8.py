"""W8A8 on the fly (``quantization="int8"``, vLLM's ``--quantization``): a float checkpoint's
decoder-layer weights stored as int8 with one scale per output channel, activations quantised per
row at each product, int32 accumulation (vLLM's CPU W8A8 and llm-compressor's INT8 scheme:
symmetric, per-channel weights, dynamic per-token activations).

Why: a CPU decode step streams every weight once, so int8 weights move half the bytes of bf16 and
a quarter of float32, and the bytes not spent on weights go to the KV pool. The native kernel
(csrc/int8_gemm.c: VNNI where the CPU has it, exact int16 pairs elsewhere) and the torch reference
here give the same bits; the reference runs where the kernels do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.config import QUANTIZATION_METHODS as SUPPORTED  # int4: model/quant_group.py
from kvledger.kernels import native, native_quant

TILE = 16  # output rows per tile of csrc/int8_gemm.c's layout


@dataclass(frozen=True)
class Int8Weight:
    """A [N, K] weight as int8 codes in csrc/int8_gemm.c's tiled layout (``pack``), float32 scales
    per output row, and the codes' int32 row sums (the VNNI kernel's correction for its unsigned
    activations)."""

    q: torch.Tensor  # [N rounded up to 16, K rounded up to 4], tiled
    scale: torch.Tensor
    wsum: torch.Tensor
    k: int  # input columns (q's are padded to a multiple of 4)

    def codes(self) -> torch.Tensor:
        """The plain [N, K] codes."""
        n, (np_, kp) = self.scale.shape[0], self.q.shape
        tiled = self.q.view(np_ // TILE, kp // 4, TILE, 4).permute(0, 2, 1, 3)
        return tiled.reshape(np_, kp)[:n, : self.k]


def pack(codes: torch.Tensor, alloc=torch.zeros) -> torch.Tensor:
    """[N, K] int8 codes in the tiled layout: per tile of 16 rows, per 4 columns, the 16 rows' 4
    bytes each (padding rows and columns zero), in memory from ``alloc(shape, dtype=)``."""
    n, k = codes.shape
    np_, kp = -(-n // TILE) * TILE, -(-k // 4) * 4
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = codes
    out = alloc((np_, kp), dtype=torch.int8)
    out.view(np_ // TILE, kp // 4, TILE, 4).copy_(padded.view(np_ // TILE, TILE, kp // 4, 4).permute(0, 2, 1, 3))
    return out


def from_codes(codes: torch.Tensor, scale: torch.Tensor, alloc=torch.zeros) -> Int8Weight:
    """An Int8Weight from plain codes [N, K] and scales [N] (a checkpoint's or quantize_weight's)."""
    k = codes.shape[1]
    if k > 65536:
        raise ValueError(f"int8 weights of rows longer than 65,536 are not supported, got {k}")
    wsum = codes.to(torch.int32).sum(dim=1, dtype=torch.int32)
    return Int8Weight(pack(codes, alloc), scale.to(torch.float32).contiguous(), wsum, k)


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: scale = max|x| / 127 (1 for a zero row), codes = round(x / scale)
    half to even, clamped to +-127. ``amax``: the rows' absolute max where x is a slice of them
    (a tensor-parallel rank's columns), so the slice gets the whole row's scale."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1) if amax is None else amax.float()) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(xf / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


def quantize_weight(w: torch.Tensor, alloc=torch.zeros, amax: torch.Tensor | None = None) -> Int8Weight:
    """Per-output-row W8 codes; ``alloc(shape, dtype=)`` holds them (host_memory.zeros: huge
    pages, which a decode step streams through with fewer TLB misses, as the float weights);
    ``amax`` as quantize_rows'."""
    q, s = quantize_rows(w.detach(), amax)
    return from_codes(q, s, alloc)


def int8_gemm_reference(
    xq: torch.Tensor, xs: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The same arithmetic as csrc/int8_gemm.c in torch: int32 sums (int64 here, exact, then
    int32), ((float)acc * xs) * ws (+ bias), rounded once to out_dtype."""
    acc = (xq.to(torch.int64) @ w.codes().to(torch.int64).T).to(torch.int32)
    y = acc.float() * xs[:, None] * w.scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int8_linear(
    x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, row_amax=None
) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) times the int8 weight: the native kernels where they run,
    else the reference. ``row_amax(x2)``: each row's absolute max where x's rows are slices of
    longer ones (a tensor-parallel rank's columns, distributed/sharding.py), so the slice is
    scaled as the whole row is."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if row_amax is not None:
        xq, xs = quantize_rows(x2, row_amax(x2))
    elif native.available(x2):
        xq, xs = native_quant.quantize_rows_i8(x2)
    else:
        xq, xs = quantize_rows(x2)
    if native.available(x2):
        y = native_quant.int8_gemm(xq, xs, w.q, w.scale, w.wsum, bias, x.dtype)
    else:
        y = int8_gemm_reference(xq, xs, w, bias, x.dtype)
    return y.view(*shape[:-1], y.shape[-1])


def check_method(method: str | None) -> str | None:
    """``quantization`` as given: None, or a method kvledger applies on the fly."""
    from kvledger.errors import ConfigError

    if method is None or method == "none":
        return None
    if method not in SUPPORTED:
        raise ConfigError(
            f"quantization {method!r} is not supported on the fly: kvledger applies {', '.join(SUPPORTED)} "
            "(int8: W8A8, per-channel int8 weights and dynamic per-token int8 activations; int4: "
            "weight-only, groups of 32)"
        )
    return method
