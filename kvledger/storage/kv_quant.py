"""Quantised KV storage: int8 / fp8 (e4m3) / fp8_int8 codes with one scale per token per KV head,
plus a small full-precision overlay for attention sinks and the recent window.

Scales are absmax per (token, KV head), computed online as each token is written:

- online: a token's scale depends on its own K/V only, so writing needs no statistics and never
  re-scales a block when a later token has a larger magnitude (per-block or per-tensor scales would
  have to, or would clip it);
- exact for prefix sharing, copy-on-write and swap: a token's code never changes once written, so a
  block copied verbatim (COW, swap, a prefix-cache hit) is bit-identical to recomputing it;
- an outlier token (attention sinks reach 10-100x the others) only coarsens its own row.

Model side only (the pool, attention, the runner); the scheduler and the simulator never import it.
The full-precision overlay of sinks and the recent window is ``kvledger.storage.kv_overlay``.
"""

from __future__ import annotations

import torch

# K format, V format of each kv_cache_dtype.
KV_FORMATS: dict[str, tuple[str, str]] = {
    "int8": ("int8", "int8"),
    "fp8": ("fp8", "fp8"),
    "fp8_int8": ("fp8", "int8"),  # K is the more sensitive (softmax logits), fp8 keeps its range
}
QMAX = {"int8": 127.0, "fp8": 448.0}  # e4m3's largest finite value is 448
_SCALE_MIN = 2.0**-24  # smallest positive float16: absmax = 0 gives codes 0, never 0/0
_SCALE_MAX = 65504.0  # largest float16


def code_dtype(fmt: str) -> torch.dtype:
    """Storage dtype of a format's codes. fp8 codes are kept as the raw e4m3 bytes (uint8): CPU
    torch has no index_copy_ for float8, and copies/swaps only move bytes anyway."""
    if fmt == "int8":
        return torch.int8
    if fmt == "fp8":
        return torch.uint8
    raise ValueError(f"unknown element format {fmt!r} (expected int8 or fp8)")


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in ``code_dtype(fmt)``, scales [...] float16), absmax over D.

    int8: s = absmax / 127, code = clamp(round(x / s), -127, 127): error <= s / 2 = absmax / 254.
    fp8:  s = absmax / 448, code = e4m3(x / s): relative error <= 2^-4 in e4m3's normal range.
    The scale is rounded to float16 before dividing, so dequantising with the stored scale is
    exactly the value the error bounds describe.
    """
    qmax = QMAX[fmt]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / qmax).clamp_(_SCALE_MIN, _SCALE_MAX).to(torch.float16)
    y = (xf / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)
    if fmt == "int8":
        codes = torch.round(y).to(torch.int8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp8_table(device: torch.device) -> torch.Tensor:
    """The 256 e4m3 values as float32. A gather from it is ~5x faster on CPU than torch's
    float8 -> float32 conversion, and gives the same values."""
    t = _FP8_TABLES.get(device)
    if t is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        t = _FP8_TABLES[device] = codes.view(torch.float8_e4m3fn).to(torch.float32).to(device)
    return t


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes [..., D], scales [...] -> values [..., D] in ``dtype`` (computed in float32)."""
    if fmt == "fp8":
        if codes.device.type == "cpu":
            idx = codes.reshape(-1).to(torch.int32)
            values = _fp8_table(codes.device).index_select(0, idx).view(codes.shape)
        else:
            values = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        values = codes.to(torch.float32)
    out = values * scales.to(torch.float32).unsqueeze(-1)
    return out if dtype == torch.float32 else out.to(dtype)


class QuantizedPagedKVCache:
    """One layer's quantised K/V (the LayerKVCache protocol).

    storage = (k_codes [1, N, bs, H, D], v_codes [1, N, bs, H, D], scales [2, N, bs, H] float16):
    every tensor has its blocks on dim 1, so the pools' COW copy and swaps move codes and scales
    verbatim, one batched op per tensor. ``read`` dequantises only the blocks asked for (the blocks
    of the requests in the step), never the whole cache.
    """

    quantized = True

    def __init__(
        self,
        k_codes: torch.Tensor,
        v_codes: torch.Tensor,
        scales: torch.Tensor,
        k_fmt: str,
        v_fmt: str,
        dtype: torch.dtype,
        sink_tokens: int = 0,
        recent_tokens: int = 0,
    ) -> None:
        _, num_blocks, block_size, num_kv_heads, head_dim = k_codes.shape
        self.block_size = block_size
        self.k_fmt, self.v_fmt, self.dtype = k_fmt, v_fmt, dtype
        self.storage = (k_codes, v_codes, scales)
        self.k_codes, self.v_codes = k_codes[0], v_codes[0]
        self.k_scales, self.v_scales = scales[0], scales[1]
        n = num_blocks * block_size
        self._k_slots = self.k_codes.view(n, num_kv_heads, head_dim)
        self._v_slots = self.v_codes.view(n, num_kv_heads, head_dim)
        self._ks_slots = self.k_scales.view(n, num_kv_heads)
        self._vs_slots = self.v_scales.view(n, num_kv_heads)
        # Full-precision overlay rows [num_slots * (S + R), H, D] (set by the pool; None: no overlay).
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.overlay_k: torch.Tensor | None = None
        self.overlay_v: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        from kvledger.kernels import native  # imported on first write, not by the scheduler

        if native.can_quantize_write(k) and k.dtype == self.dtype:
            native.quantize_write(self, k, v, slot_mapping)  # the same codes and scales, one call
            return
        kc, ks = quantize(k, self.k_fmt)
        vc, vs = quantize(v, self.v_fmt)
        self._k_slots.index_copy_(0, slot_mapping, kc)
        self._v_slots.index_copy_(0, slot_mapping, vc)
        self._ks_slots.index_copy_(0, slot_mapping, ks)
        self._vs_slots.index_copy_(0, slot_mapping, vs)

    def read(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*block_ids.shape, *self.k_codes.shape[1:])
        flat = block_ids.reshape(-1)
        k = dequantize(
            self.k_codes.index_select(0, flat), self.k_scales.index_select(0, flat), self.k_fmt, self.dtype
        )
        v = dequantize(
            self.v_codes.index_select(0, flat), self.v_scales.index_select(0, flat), self.v_fmt, self.dtype
        )
        return k.view(shape), v.view(shape)

    def write_overlay(
        self, k: torch.Tensor, v: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor
    ) -> None:
        """Keep full-precision copies of the step's rows src_rows at overlay rows dst_rows."""
        if self.overlay_k is None or dst_rows.numel() == 0:
            return
        self.overlay_k.index_copy_(0, dst_rows, k.index_select(0, src_rows))
        self.overlay_v.index_copy_(0, dst_rows, v.index_select(0, src_rows))


def layout_bytes(num_layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int) -> dict:
    """Byte offsets of k codes, v codes and scales inside the pool's single uint8 buffer."""
    codes = num_layers * num_blocks * block_size * heads * head_dim
    scales = num_layers * 2 * num_blocks * block_size * heads * 2
    v_off = _align(codes)
    s_off = _align(v_off + codes)
    return {"k": (0, codes), "v": (v_off, codes), "scales": (s_off, scales), "total": s_off + scales}


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a
