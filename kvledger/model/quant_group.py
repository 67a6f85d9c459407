"""Group-wise weight-only formats: each group of 32 consecutive weights of a row shares a float32
scale; activations stay in the model dtype (csrc/group_gemm.c).

- 4 bits (``quantization="int4"`` on the fly; GGUF Q4_0): codes -8..7 packed two a byte in
  llama.cpp's Q4_0 order (byte j of a group: weight j in the low nibble, j + 16 in the high), code
  + 8 stored; on the fly the scale is max|w| / 7.
- 8 bits (GGUF Q8_0): int8 codes, one byte each.

Why: a decode step streams every weight, and 4.625 bits a weight (the nibble and its share of the
scale) move 0.29x the bytes of bf16, 8.5 bits 0.53x. Few-row products (decodes) unpack the codes in
registers; many-row products (prefill) dequantise the weight once per product and run the float
GEMM, where the arithmetic, not the weight traffic, is the cost. The torch reference
(``dequantize``) gives the exact values the kernels multiply by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.kernels import native, native_quant

GROUP = 32
# Up to this many rows the register kernel takes a product; past it, dequantise + float GEMM
# (a fixed bound, not tuned: the register kernel re-unpacks every weight per 4 rows).
DECODE_ROWS = 16


@dataclass(frozen=True)
class GroupWeight:
    q: torch.Tensor  # 4 bits: uint8 [N, K / 2] nibbles; 8 bits: int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / 32]
    bits: int = 4
    zero: torch.Tensor | None = None  # 4 bits: uint8 [N, K / 32] zero points (None: all 8)
    perm: torch.Tensor | None = None  # input columns in the order the groups hold them (GPTQ act order)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -8..7 as [N, K / 2] bytes in Q4_0 order."""
    n, k = codes.shape
    c = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(n, k // GROUP, GROUP)
    return (c[..., : GROUP // 2] | (c[..., GROUP // 2 :] << 4)).reshape(n, k // 2)


def quantize_weight(w: torch.Tensor, alloc=torch.zeros) -> GroupWeight:
    """4 bits, on the fly: scale = max|w| / 7 rounded to fp16 per group of 32 (1 for a zero group), code =
    round(w / scale) half to even, clamped to -8..7. ``alloc(shape, dtype=)`` holds the codes
    (host_memory.zeros: huge pages, as the float weights)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs rows of a multiple of {GROUP} weights, got {k}")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    s = (g.abs().amax(dim=-1) / 7.0).half().float()  # an fp16 value, as Q4_0's: the W4A8 tiles hold fp16
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.round(g / s[..., None]).clamp(-8, 7).reshape(n, k)
    packed = alloc((n, k // 2), dtype=torch.uint8)
    packed.copy_(pack_nibbles(codes))
    return GroupWeight(packed, s.contiguous(), 4)


def codes(w: GroupWeight) -> torch.Tensor:
    """The int32 codes [N, K] of a group-wise weight."""
    if w.bits == 8:
        return w.q.to(torch.int32)
    n, half = w.q.shape
    b = w.q.reshape(n, -1, GROUP // 2)
    zero = 8 if w.zero is None else w.zero.to(torch.int32)[..., None]
    return (torch.cat([b & 0x0F, b >> 4], dim=-1).to(torch.int32) - zero).reshape(n, half * 2)


def dequantize(w: GroupWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the codes stand for: (code - zero) x its group's scale (the reference), its
    columns in the order of ``perm`` where there is one (x[:, perm] is what it multiplies)."""
    n, k = w.shape
    c = codes(w).reshape(n, k // GROUP, GROUP)
    return (c.float() * w.scale[..., None]).reshape(n, k).to(dtype)


def group_linear(x: torch.Tensor, w: GroupWeight, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if native.available(x2) and x2.shape[0] <= DECODE_ROWS:
        y = native_quant.group_gemm(x2, w.q, w.bits, w.scale, bias, w.zero)
    else:
        native_deq = native.available(x2)
        deq = native_quant.group_dequantize(w.q, w.bits, w.scale, x.dtype, w.zero) if native_deq else dequantize(w, x.dtype)
        y = F.linear(x2, deq, bias)
    return y.view(*shape[:-1], y.shape[-1])
