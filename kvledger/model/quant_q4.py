"""4-bit weights with 8-bit activations (W4A8; llama.cpp's Q4_0 x Q8_0 arithmetic): the group-wise
4-bit weights of model/quant_group.py (on-the-fly int4, GGUF Q4_0, GPTQ, AWQ) repacked at load
into csrc/q4_gemm.c's tiles, multiplied with activations quantised to int8 per group of 32 at each
product. GGUF Q8_0's 8-bit groups take the same path (Q8_0 x Q8_0), and so do GGUF's K-quants
Q4_K, Q5_K and Q6_K (their exact values in their own bits: the nibbles, then planes of the high
bits, with their own scales: ``pack_k``, ``pack_q6``). A fused projection whose GGUF pieces differ in type (Q4_K_M's
qkv: Q4_K q and k, Q6_K v) is a ``Q4Split``: each piece's tiles write their columns of one output.

Why: on a CPU a decode step streams every weight once; 4 bits a weight is a quarter of bf16's
traffic, but widening nibbles to floats (group_gemm.c) costs more than the traffic saved. Integer
u8 x s8 dot products (vpdpbusd) keep up with memory. The price is the activations' rounding to
int8 per group of 32 (llama.cpp's Q8_0), so this path is taken for bf16 / fp16 models, whose
activations are rounded anyway; float32 models keep the float-activation kernel, whose products
are exactly the dequantised weights' (``KVLEDGER_INT4_ACTIVATIONS`` overrides either way).
``reference_gemm`` is the kernel's arithmetic in torch, bit for bit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from kvledger.kernels import native, native_quant
from kvledger.ledger.weights import int4_tiles
from kvledger.model.quant_group import GROUP, GroupWeight, codes
from kvledger.storage import host_memory

TILE = 16  # output rows per tile


@dataclass(frozen=True)
class Q4Weight:
    """Group-wise codes in csrc/q4_gemm.c's tiles: 4 bits (W4A8), 8 bits (GGUF Q8_0: W8A8 in
    groups), or one of GGUF's K-quants (``kquant``) in its own bits and scales."""

    q: torch.Tensor  # uint8 [tiles, K / 32, native_quant.GROUP_BYTES]: per group 4 vectors of 16 rows x 4 bytes of nibbles (8 bits: 8 of bytes), then the K-quants' high bits
    # fp16 bits (int16) [tiles, K / 32 >> sgs, 16]; Q4_K / Q5_K: uint8 sc [tiles, K / 32, 16];
    # Q6_K: int8 sc per 16 columns [tiles, K / 32, 32] (columns 0-15 of the 16 rows, then 16-31)
    scale: torch.Tensor
    zero: torch.Tensor | None  # 4 bits: uint8 [tiles, K / 32 >> sgs, 16] or None (every zero 8); Q4_K / Q5_K: uint8 m
    n: int  # output rows (the tiles pad to 16)
    perm: torch.Tensor | None = None  # as GroupWeight.perm
    bits: int = 4  # bits a code: 4, 5 (Q5_K), 6 (Q6_K) or 8
    kquant: str | None = None  # "Q4_K", "Q5_K" or "Q6_K"
    # the K-quants' fp16 bits (int16) per 256 columns: [tiles, K / 256, 32] d for the 16 rows then
    # dmin (Q4_K, Q5_K), or [tiles, K / 256, 16] d (Q6_K)
    super_scale: torch.Tensor | None = None
    # 4 and 8 bits: one scale (and zero) per 2^sgs groups of 32, the checkpoint's group (pack())
    sgs: int = 0

    @property
    def fmt(self) -> str:
        return self.kquant or ("q8" if self.bits == 8 else "q4")

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.q.shape[1] * GROUP

    def stored(self) -> torch.Tensor:
        """The stored codes [n, K] in column order: 0 .. 2^bits - 1 (Q8_0's: code + 128)."""
        t, groups, _ = self.q.shape
        if self.bits == 8:
            b = self.q.view(t, groups, 8, TILE, 4)  # tile, group, vector, row, byte
            return b.permute(0, 3, 1, 2, 4).reshape(t * TILE, groups * GROUP)[: self.n]
        b = self.q[..., :256].reshape(t, groups, 4, TILE, 4)
        cols = torch.stack([b & 0x0F, b >> 4], dim=2)  # tile, group, half, vector, row, byte
        if self.kquant in ("Q5_K", "Q6_K"):
            width = 1 if self.kquant == "Q5_K" else 2
            cols = cols | (_high_bits(self.q[..., 256:], width) << 4)
        return cols.permute(0, 4, 1, 2, 3, 5).reshape(t * TILE, groups * GROUP)[: self.n]

    def zeros(self) -> torch.Tensor:
        """Zero points [n, K / 32] (int32)."""
        if self.zero is None:
            return torch.full((self.n, self.q.shape[1]), {8: 128, 6: 32}.get(self.bits, 8), dtype=torch.int32)
        return self._per_row(self.zero).repeat_interleave(1 << self.sgs, dim=1).to(torch.int32)

    def _per_row(self, t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(-1, t.shape[1])[: self.n]

    def _super(self, i: int) -> torch.Tensor:
        """The K-quants' d (i 0) or dmin (i 1) per group, float32 [n, K / 32]."""
        t = self.super_scale.view(torch.float16).float()[..., i * TILE : (i + 1) * TILE]
        return self._per_row(t).repeat_interleave(256 // GROUP, dim=1)

    def scales(self) -> torch.Tensor:
        """float32 scales [n, K / 32]: the weight's (Q4_K, Q5_K: d x sc; Q6_K: d)."""
        if self.kquant == "Q6_K":
            return self._super(0)
        if self.kquant:  # d x sc, exact in float32 (an fp16 d times a 6-bit sc)
            return self._super(0) * self._per_row(self.scale).float()
        return self._per_row(self.scale.view(torch.float16)).float().repeat_interleave(1 << self.sgs, dim=1)

    def min_values(self) -> torch.Tensor:
        """Q4_K's / Q5_K's float32 mins dmin x m [n, K / 32]."""
        return self._super(1) * self._per_row(self.zero).float()

    def sub_scales(self) -> torch.Tensor:
        """Q6_K's int32 scales per 16 columns [n, K / 16]."""
        t, groups, _ = self.scale.shape
        return self.scale.view(t, groups, 2, TILE).permute(0, 3, 1, 2).reshape(t * TILE, groups * 2)[: self.n].to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        c = self.stored().to(torch.int32).view(n, k // GROUP, GROUP)
        if self.kquant in ("Q4_K", "Q5_K"):  # llama.cpp's (d x sc) x q - dmin x m, in float32
            return (c.float() * self.scales()[..., None] - self.min_values()[..., None]).reshape(n, k).to(dtype)
        c = (c - self.zeros()[..., None]).float()
        if self.kquant == "Q6_K":  # (code - 32) x (d x sc): exact in float32
            per16 = self.scales().repeat_interleave(2, dim=1) * self.sub_scales().float()
            return (c.view(n, k // 16, 16) * per16[..., None]).reshape(n, k).to(dtype)
        return (c * self.scales()[..., None]).reshape(n, k).to(dtype)


def _high_bits(planes: torch.Tensor, width: int) -> torch.Tensor:
    """The K-quants' high bits from their planes [tiles, K / 32, 64 x width] as [tiles, K / 32,
    half, vector, row, byte]: Q5_K (width 1) bit v (columns 0-15) or 4 + v (16-31) of byte (row,
    byte); Q6_K (width 2) bits 2v..2v+1 of the first plane (columns 0-15) or the second."""
    t, groups, _ = planes.shape
    v = torch.arange(4, dtype=torch.uint8).view(1, 1, 1, 4, 1, 1)
    if width == 1:
        b = planes.reshape(t, groups, 1, 1, TILE, 4)
        shift = v + torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1, 1, 1)
        return (b >> shift) & 1
    b = planes.reshape(t, groups, 2, 1, TILE, 4)
    return (b >> (2 * v)) & 3


@dataclass(frozen=True)
class Q4Split:
    """A fused projection held as pieces of different formats (a GGUF file's q, k and v of
    different types), each run by its own kernel into its columns of one output."""

    parts: tuple[Q4Weight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.n for p in self.parts), self.parts[0].shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def eligible(w: GroupWeight) -> bool:
    """Scales that are fp16 values (GGUF, GPTQ, AWQ and on-the-fly int4 all are)."""
    return bool(torch.equal(w.scale.half().float(), w.scale))


def _tile_codes(stored: torch.Tensor, bits: int, alloc) -> torch.Tensor:
    """Stored codes [N, K] (0 .. 2^bits - 1, Q8_0's + 128) in the kernel's tiles, padding rows
    zero, in memory from ``alloc(shape, dtype=)``: nibbles (and Q5_K's / Q6_K's high-bit planes
    after them), or bytes."""
    n, k = stored.shape
    tiles, groups = -(-n // TILE), k // GROUP
    full = torch.zeros(tiles * TILE, groups, GROUP, dtype=torch.uint8)
    full[:n] = stored.view(n, groups, GROUP)
    if bits == 8:  # tile, row, group, vector, byte -> tile, group, vector, row, byte
        packed = full.view(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 512)
    else:  # tile, row, group, half (lo: columns 0-15, hi: 16-31), vector, byte -> tile, group, half, vector, row, byte
        parts = (full.view(tiles, TILE, groups, 2, 4, 4) & 0x0F).permute(0, 2, 3, 4, 1, 5)
        planes = [(parts[:, :, 0] | (parts[:, :, 1] << 4)).reshape(tiles, groups, 256)]
        high = (full.view(tiles, TILE, groups, 2, 4, 4) >> 4).permute(0, 2, 3, 4, 1, 5)  # as parts
        v = torch.arange(4, dtype=torch.uint8).view(1, 1, 4, 1, 1)
        if bits == 5:  # bit v: column 4v + byte of the first half; bit 4 + v: of the second
            planes.append(((high[:, :, 0] << v) | (high[:, :, 1] << (v + 4))).sum(2, dtype=torch.uint8).reshape(tiles, groups, 64))
        elif bits == 6:  # bits 2v..2v+1: column 4v + byte, one plane a half
            planes.append((high << (2 * v).unsqueeze(1)).sum(3, dtype=torch.uint8).reshape(tiles, groups, 128))
        packed = torch.cat(planes, dim=2)
    return host_memory.copy_of(packed, alloc)


def _tile_rows(t: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """[n, K / 32] per-row values as [tiles, K / 32, 16] (padding rows ``fill``)."""
    tiles = -(-n // TILE)
    full = torch.full((tiles * TILE, t.shape[1]), fill, dtype=t.dtype)
    full[:n] = t
    return full.view(tiles, TILE, t.shape[1]).permute(0, 2, 1).contiguous()


def _held(t: torch.Tensor | None, alloc) -> torch.Tensor | None:
    """t in memory from ``alloc`` (the codes' scales and zeros stream beside them)."""
    return None if t is None else host_memory.copy_of(t, alloc)


def scale_run(w: GroupWeight) -> int:
    """log2 of the longest run of groups (a power of two dividing their count, at most 256) over
    which every row's scale and zero repeat: a checkpoint's own group (GPTQ / AWQ 64 or 128 columns
    are 2 or 4 groups of 32 in a GroupWeight), held once a run in the tiles."""
    n, groups = w.scale.shape
    s = 0  # runs of 2^(s+1) that repeat are runs of 2^s that do: the first longer run that fails ends it
    while s < 8 and groups % (r := 2 << s) == 0 and all(
        t is None or bool((v := t.reshape(n, groups // r, r)).eq(v[..., :1]).all()) for t in (w.scale, w.zero)
    ):
        s += 1
    return s


def pack(w: GroupWeight, alloc=torch.zeros) -> Q4Weight:
    """Repack a GroupWeight into the kernel's tiles (same codes, scales and zeros; a scale and zero
    per run of groups that share them, ``scale_run``), in memory from ``alloc(shape, dtype=)``."""
    if not eligible(w):
        raise ValueError("W4A8 / W8A8 group tiles take weights with fp16 scales")
    n, k = w.shape
    if w.bits == 8:
        stored = (codes(w) + 128).to(torch.uint8)
    else:
        zero = 8 if w.zero is None else w.zero.to(torch.int32)[..., None]
        stored = (codes(w).view(n, k // GROUP, GROUP) + zero).to(torch.uint8).view(n, k)
    if w.zero is not None and bool((w.zero == 8).all()):
        w = replace(w, zero=None)  # a symmetric checkpoint's (GPTQ sym): the kernel's own 8, no stream of zeros
    sgs = scale_run(w)
    scale = _tile_rows(w.scale[:, :: 1 << sgs].half(), n).view(torch.int16)
    zero = None if w.zero is None else _tile_rows(w.zero[:, :: 1 << sgs], n, fill=8)
    return Q4Weight(_tile_codes(stored, w.bits, alloc), _held(scale, alloc), _held(zero, alloc), n, w.perm, w.bits,
                    sgs=sgs)  # fmt: skip


def _tile_super(values: list[torch.Tensor], n: int) -> torch.Tensor:
    """The K-quants' fp16 [n, K / 256] d (and dmin) as [tiles, K / 256, 16 x their count] (int16)."""
    return torch.cat([_tile_rows(v.half(), n) for v in values], dim=2).view(torch.int16).contiguous()


def pack_k(
    codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
    kquant: str = "Q4_K", alloc=torch.zeros,
) -> Q4Weight:
    """GGUF Q4_K's (codes 0..15) or Q5_K's (0..31) values in the kernel's tiles: codes [N, K],
    6-bit sc and m [N, K / 32], fp16 d and dmin [N, K / 256]; the weight code x (d x sc) - dmin x m."""
    n = codes.shape[0]
    bits = 4 if kquant == "Q4_K" else 5
    return Q4Weight(_tile_codes(codes, bits, alloc), _held(_tile_rows(sc.to(torch.uint8), n), alloc),
                    _held(_tile_rows(m.to(torch.uint8), n), alloc), n, None, bits, kquant,
                    _held(_tile_super([d, dmin], n), alloc))  # fmt: skip


def pack_q6(codes: torch.Tensor, sub: torch.Tensor, d: torch.Tensor, alloc=torch.zeros) -> Q4Weight:
    """GGUF Q6_K's values (codes [N, K] 0..63, int8 scales [N, K / 16], fp16 d [N, K / 256]) in the
    kernel's tiles: the weight (code - 32) x d x sub."""
    n, k = codes.shape
    # per 16 columns as _tile_rows lays them, two a group: [tiles, K / 32, columns 0-15's 16 rows, 16-31's]
    per16 = _tile_rows(sub.to(torch.int8), n).view(-(-n // TILE), k // GROUP, 2 * TILE)
    return Q4Weight(_tile_codes(codes, 6, alloc), _held(per16, alloc), None, n, None, 6, "Q6_K",
                    _held(_tile_super([d], n), alloc))  # fmt: skip


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of native_quant.q4_quantize_act: per group of 32, s = max|x| / 127 (1 for zeros),
    q = round(x / s) half to even clamped to +-127, and the codes' sum."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    s = g.abs().amax(dim=-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(g / s[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), s, q.sum(dim=-1).to(torch.int32)


def reference_gemm(x: torch.Tensor, w: Q4Weight | Q4Split, bias: torch.Tensor | None) -> torch.Tensor:
    """csrc/q4_gemm.c's arithmetic in torch (same bits): per group an exact integer dot product
    less zero x code sum, then acc = acc + d * (weight scale * activation scale), group by group
    (Q4_K / Q5_K: less the min's term in float; Q6_K: the halves' sums weighted by their int8
    scales, in integers)."""
    if isinstance(w, Q4Split):
        cols = [0, *itertools.accumulate(p.n for p in w.parts)]
        return torch.cat([reference_gemm(x, p, None if bias is None else bias[a:b])
                          for p, a, b in zip(w.parts, cols, cols[1:])], dim=1)  # fmt: skip
    m = x.shape[0]
    n, k = w.shape
    xq, xs, xsum = quantize_act(x)
    groups = k // GROUP
    if w.kquant == "Q6_K":  # integer dot products per 16 columns, weighted by the int8 scales
        halves = w.stored().to(torch.int64).view(n, groups * 2, 16)
        xh = xq.to(torch.int64).view(m, groups * 2, 16)
        d = torch.einsum("ngj,mgj->mng", halves, xh) - 32 * xh.sum(-1)[:, None, :]
        d = (d * w.sub_scales().to(torch.int64)[None]).view(m, n, groups, 2).sum(-1)
    else:
        nib = w.stored().to(torch.int64).view(n, groups, GROUP)
        d = torch.einsum("ngj,mgj->mng", nib, xq.to(torch.int64).view(m, groups, GROUP))
    sw = w.scales()
    acc = torch.zeros(m, n, dtype=torch.float32)
    if w.kquant in ("Q4_K", "Q5_K"):
        mn = w.min_values()
        for g in range(groups):
            sx = xs[:, None, g]
            t1 = d[:, :, g].float() * (sw[None, :, g] * sx)
            acc = acc + (t1 - mn[None, :, g] * (xsum[:, None, g].float() * sx))
    else:
        if w.kquant != "Q6_K":
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


def q4_linear(x: torch.Tensor, w: Q4Weight | Q4Split, bias: torch.Tensor | None) -> torch.Tensor:
    """Every product, decode or prefill, through the W4A8 kernel: it beats dequantise-then-GEMM
    at every row count measured (1-256 rows, benchmarks/quant_decode.py's shapes), and a row's
    result never depends on the batch it is in."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    parts = w.parts if isinstance(w, Q4Split) else (w,)
    if parts[0].perm is not None:
        x2 = x2.index_select(1, parts[0].perm)
    if native.available(x2):
        xq, xs, xsum = native_quant.q4_quantize_act(x2)
        y = torch.empty(x2.shape[0], sum(p.n for p in parts), dtype=x2.dtype)
        col = 0
        for p in parts:
            b = None if bias is None else bias[col : col + p.n]
            native_quant.q4_gemm(xq, xs, xsum, p, b, x2.dtype, out=y, col=col)
            col += p.n
    else:
        y = reference_gemm(x2, w, bias)
    return y.view(*shape[:-1], y.shape[-1])
