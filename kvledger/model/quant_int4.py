"""4-bit weights on the fly (``quantization="int4"``): weight-only, group-wise, symmetric — each
group of 32 consecutive weights of a row shares a float32 scale (max|w| / 7), codes -8..7 packed two
a byte in llama.cpp's Q4_0 order (csrc/int4_gemm.c). Activations stay in the model dtype.

Why: a decode step streams every weight, and 4.625 bits a weight (the nibble and its share of the
scale) move 0.29x the bytes of bf16. Few-row products (decodes) unpack the nibbles in registers;
many-row products (prefill) dequantise the weight once per product and run the float GEMM, where
the arithmetic, not the weight traffic, is the cost. The torch reference (``dequantize``) gives
the exact values the kernels multiply by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.kernels import native

GROUP = 32
# Up to this many rows the register kernel takes a product; past it, dequantise + float GEMM
# (a fixed bound, not tuned: the register kernel re-unpacks every weight per 4 rows).
DECODE_ROWS = 16


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # uint8 [N, K / 2]
    scale: torch.Tensor  # float32 [N, K / 32]


def quantize_weight(w: torch.Tensor) -> Int4Weight:
    """Group-wise symmetric 4-bit: scale = max|w| / 7 per group of 32 (1 for a zero group), code
    = round(w / scale) half to even, clamped to -8..7; stored as code + 8 in nibbles."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs rows of a multiple of {GROUP} weights, got {k}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    s = g.abs().amax(dim=-1) / 7.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = (torch.round(g / s[..., None]).clamp(-8, 7) + 8).to(torch.uint8)  # [n, groups, 32]
    packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
    return Int4Weight(packed.reshape(n, k // 2).contiguous(), s.contiguous())


def dequantize(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the codes stand for: (code - 8) x its group's scale (the reference)."""
    n, half = w.q.shape
    b = w.q.reshape(n, -1, GROUP // 2)
    codes = torch.cat([b & 0x0F, b >> 4], dim=-1).to(torch.int32) - 8  # [n, groups, 32]
    return (codes.float() * w.scale[..., None]).reshape(n, half * 2).to(dtype)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if native.available(x2) and x2.shape[0] <= DECODE_ROWS:
        y = native.int4_gemm(x2, w.q, w.scale, bias)
    else:
        deq = native.int4_dequantize(w.q, w.scale, x.dtype) if native.available(x2) else dequantize(w, x.dtype)
        y = F.linear(x2, deq, bias)
    return y.view(*shape[:-1], y.shape[-1])
