"""4-bit weights with 8-bit activations (W4A8; llama.cpp's Q4_0 x Q8_0 arithmetic): the group-wise
4-bit weights of model/quant_group.py (on-the-fly int4, GGUF Q4_0, GPTQ, AWQ) repacked at load
into csrc/q4_gemm.c's tiles, multiplied with activations quantised to int8 per group of 32 at each
product. GGUF Q8_0's 8-bit groups take the same path (Q8_0 x Q8_0).

Why: on a CPU a decode step streams every weight once; 4 bits a weight is a quarter of bf16's
traffic, but widening nibbles to floats (group_gemm.c) costs more than the traffic saved. Integer
u8 x s8 dot products (vpdpbusd) keep up with memory. The price is the activations' rounding to
int8 per group of 32 (llama.cpp's Q8_0), so this path is taken for bf16 / fp16 models, whose
activations are rounded anyway; float32 models keep the float-activation kernel, whose products
are exactly the dequantised weights' (``KVLEDGER_INT4_ACTIVATIONS`` overrides either way).
``reference_gemm`` is the kernel's arithmetic in torch, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.kernels import native
from kvledger.ledger.weights import int4_tiles
from kvledger.model.quant_group import GROUP, GroupWeight, codes

TILE = 16  # output rows per tile


@dataclass(frozen=True)
class Q4Weight:
    """Group-wise codes in csrc/q4_gemm.c's tiles (4 bits: W4A8; 8 bits, GGUF Q8_0: W8A8 in groups)."""

    q: torch.Tensor  # uint8 [tiles, K / 32, 256 (4 bits) or 512 (8 bits)]: per group 4 or 8 vectors of 16 rows x 4 bytes
    scale: torch.Tensor  # int16 [tiles, K / 32, 16]: fp16 bits
    zero: torch.Tensor | None  # 4 bits: uint8 [tiles, K / 32, 16], None: every zero is 8 (8 bits: 128)
    n: int  # output rows (the tiles pad to 16)
    perm: torch.Tensor | None = None  # as GroupWeight.perm
    bits: int = 4
    # GGUF Q4_K: float32 [tiles, K / 32, 16] mins, the weight nibble x scale - min (scale then
    # float32 [tiles, K / 32, 16] too, no zero points)
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.q.shape[1] * GROUP

    def stored(self) -> torch.Tensor:
        """The stored codes [n, K] in column order: nibbles 0..15, or 8-bit codes + 128."""
        t, groups, _ = self.q.shape
        if self.bits == 8:
            b = self.q.view(t, groups, 8, TILE, 4)  # tile, group, vector, row, byte
            return b.permute(0, 3, 1, 2, 4).reshape(t * TILE, groups * GROUP)[: self.n]
        b = self.q.view(t, groups, 4, TILE, 4)
        cols = torch.stack([b & 0x0F, b >> 4], dim=2)  # tile, group, half, vector, row, byte
        return cols.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE, groups * GROUP)[: self.n]

    def zeros(self) -> torch.Tensor:
        """Zero points [n, K / 32] (int32)."""
        if self.zero is None:
            return torch.full((self.n, self.q.shape[1]), 128 if self.bits == 8 else 8, dtype=torch.int32)
        return self.zero.permute(0, 2, 1).reshape(-1, self.q.shape[1])[: self.n].to(torch.int32)

    def _per_row(self, t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(-1, self.q.shape[1])[: self.n]

    def scales(self) -> torch.Tensor:
        """float32 scales [n, K / 32]."""
        return self._per_row(self.scale if self.mins is not None else self.scale.view(torch.float16)).float()

    def min_values(self) -> torch.Tensor:
        """Q4_K's float32 mins [n, K / 32]."""
        return self._per_row(self.mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        c = self.stored().to(torch.int32).view(n, k // GROUP, GROUP)
        if self.mins is not None:  # llama.cpp's d x q - m, in float32
            return (c.float() * self.scales()[..., None] - self.min_values()[..., None]).reshape(n, k).to(dtype)
        c = (c - self.zeros()[..., None]).float()
        return (c * self.scales()[..., None]).reshape(n, k).to(dtype)


def eligible(w: GroupWeight) -> bool:
    """Scales that are fp16 values (GGUF, GPTQ, AWQ and on-the-fly int4 all are)."""
    return bool(torch.equal(w.scale.half().float(), w.scale))


def _tile_codes(stored: torch.Tensor, bits: int, alloc) -> torch.Tensor:
    """Stored codes [N, K] (nibbles 0..15, or 8-bit codes + 128) in the kernel's tiles, padding
    rows zero, in memory from ``alloc(shape, dtype=)``."""
    n, k = stored.shape
    tiles, groups = -(-n // TILE), k // GROUP
    full = torch.zeros(tiles * TILE, groups, GROUP, dtype=torch.uint8)
    full[:n] = stored.view(n, groups, GROUP)
    if bits == 8:  # tile, row, group, vector, byte -> tile, group, vector, row, byte
        packed = full.view(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 512)
    else:  # tile, row, group, half (lo: columns 0-15, hi: 16-31), vector, byte -> tile, group, vector, row, byte
        parts = full.view(tiles, TILE, groups, 2, 4, 4)
        packed = (parts[:, :, :, 0] | (parts[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 256)
    q = alloc(tuple(packed.shape), dtype=torch.uint8)
    q.copy_(packed)
    return q


def _tile_rows(t: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """[n, K / 32] per-row values as [tiles, K / 32, 16] (padding rows ``fill``)."""
    tiles = -(-n // TILE)
    full = torch.full((tiles * TILE, t.shape[1]), fill, dtype=t.dtype)
    full[:n] = t
    return full.view(tiles, TILE, t.shape[1]).permute(0, 2, 1).contiguous()


def pack(w: GroupWeight, alloc=torch.zeros) -> Q4Weight:
    """Repack a GroupWeight into the kernel's tiles (same codes, scales and zeros)."""
    if not eligible(w):
        raise ValueError("W4A8 / W8A8 group tiles take weights with fp16 scales")
    n, k = w.shape
    if w.bits == 8:
        stored = (codes(w) + 128).to(torch.uint8)
    else:
        zero = 8 if w.zero is None else w.zero.to(torch.int32)[..., None]
        stored = (codes(w).view(n, k // GROUP, GROUP) + zero).to(torch.uint8).view(n, k)
    scale = _tile_rows(w.scale.half(), n).view(torch.int16)
    zero = None if w.zero is None else _tile_rows(w.zero, n, fill=8)
    return Q4Weight(_tile_codes(stored, w.bits, alloc), scale, zero, n, w.perm, w.bits)


def pack_k(nibbles: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, alloc=torch.zeros) -> Q4Weight:
    """GGUF Q4_K's values (nibbles [N, K] 0..15, float32 scales d x sc and mins dmin x m [N, K / 32])
    in the kernel's tiles."""
    n = nibbles.shape[0]
    q = _tile_codes(nibbles, 4, alloc)
    return Q4Weight(q, _tile_rows(scale.float(), n), None, n, None, 4, _tile_rows(mins.float(), n))


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of native.q4_quantize_act: per group of 32, s = max|x| / 127 (1 for zeros),
    q = round(x / s) half to even clamped to +-127, and the codes' sum."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    s = g.abs().amax(dim=-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(g / s[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), s, q.sum(dim=-1).to(torch.int32)


def reference_gemm(x: torch.Tensor, w: Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """csrc/q4_gemm.c's arithmetic in torch (same bits): per group an exact integer dot product
    less zero x code sum, then acc = acc + d * (weight scale * activation scale), group by group."""
    m = x.shape[0]
    n, k = w.shape
    xq, xs, xsum = quantize_act(x)
    groups = k // GROUP
    nib = w.stored().to(torch.int64).view(n, groups, GROUP)
    d = torch.einsum("ngj,mgj->mng", nib, xq.to(torch.int64).view(m, groups, GROUP))
    sw = w.scales()
    acc = torch.zeros(m, n, dtype=torch.float32)
    if w.mins is not None:
        mn = w.min_values()
        for g in range(groups):
            sx = xs[:, None, g]
            t1 = d[:, :, g].float() * (sw[None, :, g] * sx)
            acc = acc + (t1 - mn[None, :, g] * (xsum[:, None, g].float() * sx))
    else:
        d = d - w.zeros().to(torch.int64)[None] * xsum.to(torch.int64)[:, None, :]
        for g in range(groups):
            acc = acc + d[:, :, g].float() * (sw[None, :, g] * xs[:, None, g])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def int8_activations(dtype: torch.dtype) -> bool:
    """Whether a model in ``dtype`` multiplies its 4-bit weights with int8 activations: by default
    for bf16 / fp16 models, not float32 ones (KVLEDGER_INT4_ACTIVATIONS=int8|float overrides)."""
    return int4_tiles(dtype.itemsize)


def q4_linear(x: torch.Tensor, w: Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Every product, decode or prefill, through the W4A8 kernel: it beats dequantise-then-GEMM
    at every row count measured (1-256 rows, benchmarks/quant_decode.py's shapes), and a row's
    result never depends on the batch it is in."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if native.available(x2):
        xq, xs, xsum = native.q4_quantize_act(x2)
        y = native.q4_gemm(xq, xs, xsum, w.q, w.scale, w.zero, w.n, bias, x2.dtype, w.bits, w.mins)
    else:
        y = reference_gemm(x2, w, bias)
    return y.view(*shape[:-1], y.shape[-1])
