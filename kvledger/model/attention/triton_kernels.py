"""Triton kernels for the paged KV cache: writing K/V at slot_mapping, and attention over block tables.

Two kernels and a reduction, one design for every step shape (after vLLM's unified Triton attention):

- ``_write_kv_kernel``: one program per new token writes its K and V rows (all KV heads) at its
  pool slot, as model-dtype values or as int8 / fp8 (e4m3) codes with one float16 absmax scale
  per token and head, bit-identical to ``kvledger.storage.kv_quant.quantize``. A negative slot is
  skipped (padding rows of a captured CUDA graph).
- ``_attention_kernel``: a program owns one KV head and a tile of BLOCK_M query rows = BLOCK_Q
  consecutive tokens of one request x the GROUP query heads sharing that KV head (GQA/MQA: K/V
  are read once per group, never expanded). It walks the request's keys in TILE_N tiles through
  its block table (any block size: each key's block is looked up), causal over the step's own
  tokens, so prefill, chunked prefill over a cached prefix (prefix-cache hits) and decode are one
  kernel. Codes are dequantised in-kernel. The grid's first axis is ``num_tokens // BLOCK_Q +
  num_seqs`` (each request's tiles found by binary search in query_start_loc), so a grid depends
  on shapes only -- what a CUDA graph needs.
- split-K: with NUM_SPLITS > 1 the key tiles are cut into NUM_SPLITS ranges whose partial
  (acc, running max, running sum) go to a scratch buffer; ``_reduce_kernel`` merges them
  (flash-decoding), which keeps the GPU busy on small decode batches with long contexts.

Quantised caches with a full-precision overlay (sinks and recent window, see kv_quant): a query at
position q sees key p in full precision iff p < S or q - p < R (and the request's overlay slot
holds p, or p is one of the step's own tokens). The kernel computes both scores (dequantised and
full precision) and picks per (query, key), then splits the probabilities between the two value
tiles -- the same rule as the torch reference, whatever the chunking.

Everything runs on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``, set before
this module is imported), which is how CI proves the kernels without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Element formats of a cache side (constexpr selectors inside the kernels).
FMT_PLAIN, FMT_INT8, FMT_FP8 = 0, 1, 2
_FMT = {"int8": FMT_INT8, "fp8": FMT_FP8}


def interpreted() -> bool:
    """True when this module's kernels run under the Triton interpreter (CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_attention_kernel, InterpretedFunction)


def interpreter_consistent() -> bool:
    """False when triton was imported before TRITON_INTERPRET=1 but this module after: Triton's
    own library functions (tl.cdiv, tl.max, ...) are then compiled-only and the interpreted
    kernels cannot call them."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction) == interpreted()


# -- element codecs ---------------------------------------------------------------------------
@triton.jit
def _round_half_even(x):
    """torch.round's rounding (ties to even) for float32."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _e4m3_encode(y):
    """float32 |y| <= 448 -> e4m3 byte, round to nearest even (torch's float8_e4m3fn cast)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    abits = a.to(tl.int32, bitcast=True)
    exp = (abits >> 23) - 127
    keep = (abits & 0x7FFFFF) >> 20
    rem = abits & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    normal = ((exp + 7) << 3) + keep + up.to(tl.int32)
    sub = _round_half_even(a * 512.0).to(tl.int32)  # subnormals: multiples of 2^-9
    code = tl.where(a < 0.015625, sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _e4m3_decode(c):
    """e4m3 bytes -> float32 (bit assembly: no float8 type needed, also under the interpreter)."""
    c = c.to(tl.int32) & 0xFF
    e = (c >> 3) & 15
    m = c & 7
    sign = tl.where((c & 0x80) != 0, -1.0, 1.0)
    bits = ((c & 0x80) << 24) | ((e + 120) << 23) | (m << 20)
    return tl.where(e == 0, sign * m.to(tl.float32) * 0.001953125, bits.to(tl.float32, bitcast=True))


@triton.jit
def _store_rows(x, ptr, mask, scale_ptr, scale_mask, FMT: tl.constexpr):
    """x [H, D] float32 -> the cache at ptr (codes + per-row scales for int8 / fp8)."""
    if FMT == 0:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
    else:
        qmax = 127.0 if FMT == 1 else 448.0
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.minimum(tl.maximum(tl.math.div_rn(amax, qmax), 5.960464477539063e-08), 65504.0)
        s = s.to(tl.float16)
        y = tl.math.div_rn(x, s.to(tl.float32)[:, None])
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if FMT == 1:
            tl.store(ptr, _round_half_even(y).to(tl.int8), mask=mask)
        else:
            tl.store(ptr, _e4m3_encode(y), mask=mask)
        tl.store(scale_ptr, s, mask=scale_mask)


@triton.jit
def _load_rows(ptr, mask, scale_ptr, scale_mask, FMT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Cache rows [N, D] -> OUT_DTYPE (codes dequantised with their per-row scales)."""
    raw = tl.load(ptr, mask=mask, other=0)
    if FMT == 0:
        out = raw.to(OUT_DTYPE)
    else:
        s = tl.load(scale_ptr, mask=scale_mask, other=0.0).to(tl.float32)
        if FMT == 1:
            x = raw.to(tl.float32)
        else:
            x = _e4m3_decode(raw)
        out = (x * s[:, None]).to(OUT_DTYPE)
    return out


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32: exact float32 products for float32 models (no TF32);
    UPCAST: bfloat16 operands multiplied as float32 (the interpreter's bf16 dot is wrong)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# -- writing the cache ------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr,
    kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch, stride_ss,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    hm = h < NUM_KV_HEADS
    mask = hm[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    sdst = slot * stride_ss + h
    _store_rows(k.to(tl.float32), kc_ptr + dst, mask, ks_ptr + sdst, hm, K_FMT)
    _store_rows(v.to(tl.float32), vc_ptr + dst, mask, vs_ptr + sdst, hm, V_FMT)


# -- attention --------------------------------------------------------------------------------
@triton.jit
def _attention_kernel(
    out_ptr, part_ptr, ml_ptr,
    q_ptr, kn_ptr, vn_ptr,
    kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    ovk_ptr, ovv_ptr, ov_base_ptr, sink_from_ptr, window_from_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale, num_seqs, sinks, recent, window, softcap,
    stride_qt, stride_qh, stride_nt, stride_nh, stride_vnt, stride_vnh, stride_ot, stride_oh,
    stride_cs, stride_ch, stride_ss, stride_bt, stride_ovr, stride_ovh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, OVERLAY: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Request of this query tile: the last i with query_start_loc[i] // BLOCK_Q + i <= pid.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    qb = pid - (q_start // BLOCK_Q + req)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    p0 = seq_len - q_len  # position of the step's first token of this request

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    dm = d < HEAD_DIM
    tok = qb * BLOCK_Q + m // GROUP  # token index within the request's new tokens
    head = kvh * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (tok < q_len)
    qpos = p0 + tok
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & dm[None, :],
        other=0.0,
    )
    kv_end = p0 + tl.minimum(qb * BLOCK_Q + BLOCK_Q, q_len)  # causal: keys < kv_end
    num_tiles = tl.cdiv(kv_end, TILE_N)
    kv_start = kv_end * 0  # sliding window: no key below the tile's first query's window
    if HAS_WINDOW:
        kv_start = tl.maximum(p0 + qb * BLOCK_Q - window + 1, 0)
    first_tile = kv_start // TILE_N
    per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    t_lo = first_tile + split * per_split
    t_hi = tl.minimum(t_lo + per_split, num_tiles)

    if OVERLAY:
        ov_base = tl.load(ov_base_ptr + req)
        sink_from = tl.load(sink_from_ptr + req)
        window_from = tl.load(window_from_ptr + req)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for t in range(t_lo, t_hi):
        n = t * TILE_N + tl.arange(0, TILE_N)
        n_ok = (n < kv_end) & (n >= kv_start)  # blocks outside a window may be gone: not read
        blk = tl.load(block_tables_ptr + req * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & dm[None, :]
        off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        soff = slot * stride_ss + kvh
        kt = _load_rows(kc_ptr + off, kv_mask, ks_ptr + soff, n_ok, K_FMT, q_ptr.dtype.element_ty)
        s = _dot(q, tl.trans(kt), IEEE, UPCAST)
        if OVERLAY:
            # Full-precision rows: the step's own tokens from k/v, earlier ones from the slot.
            is_new = n >= p0
            sink_ok = (n < sinks) & (is_new | (n >= sink_from))
            win_ok = (n >= sinks) & (n * 0 + recent > 0)
            win_ok = win_ok & (is_new | ((n >= window_from) & (n > p0 - recent)))
            avail = n_ok & (sink_ok | win_ok)
            ring = n % tl.maximum(recent, 1)
            ov_row = tl.where(n < sinks, ov_base + n, ov_base + sinks + ring).to(tl.int64)
            new_row = (q_start + n - p0).to(tl.int64)
            new_off = new_row[:, None] * stride_nt + kvh * stride_nh + d[None, :]
            vnew_off = new_row[:, None] * stride_vnt + kvh * stride_vnh + d[None, :]
            ov_off = ov_row[:, None] * stride_ovr + kvh * stride_ovh + d[None, :]
            use_new = (avail & is_new)[:, None] & dm[None, :]
            use_ov = (avail & ~is_new)[:, None] & dm[None, :]
            kf = tl.load(kn_ptr + new_off, mask=use_new, other=0.0) + tl.load(
                ovk_ptr + ov_off, mask=use_ov, other=0.0
            )
            s_full = _dot(q, tl.trans(kf), IEEE, UPCAST)
            full = avail[None, :] & ((n[None, :] < sinks) | (qpos[:, None] - n[None, :] < recent))
            s = tl.where(full, s_full, s)
        s = s * scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), before the mask (Gemma 2)
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = s * 1.4426950408889634  # log2(e): exp2 below
        visible = n_ok[None, :] & (n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        vt = _load_rows(vc_ptr + off, kv_mask, vs_ptr + soff, n_ok, V_FMT, q_ptr.dtype.element_ty)
        if OVERLAY:
            vf = tl.load(vn_ptr + vnew_off, mask=use_new, other=0.0) + tl.load(
                ovv_ptr + ov_off, mask=use_ov, other=0.0
            )
            p_full = tl.where(full, p, 0.0).to(vt.dtype)
            p = tl.where(full, 0.0, p)
            acc += _dot(p_full, vf, IEEE, UPCAST)
        acc += _dot(p.to(vt.dtype), vt, IEEE, UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dm[None, :],
        )
    else:
        # Partials [T, H, NUM_SPLITS, HEAD_PAD] and (max, sum) [T, H, NUM_SPLITS, 2], float32.
        num_heads = tl.num_programs(1) * GROUP
        base = (q_rows * num_heads + head) * NUM_SPLITS + split
        tl.store(part_ptr + base[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_kernel(
    out_ptr, part_ptr, ml_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Merge the NUM_SPLITS partial softmaxes of one (token, head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * tl.num_programs(1) + h) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_PAD)
    m = tl.load(ml_ptr + (base + s) * 2)
    ls = tl.load(ml_ptr + (base + s) * 2 + 1)
    w = tl.exp2(m - tl.max(m, axis=0))
    acc = tl.load(part_ptr + (base + s)[:, None] * HEAD_PAD + d[None, :])
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(ls * w, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# -- launchers --------------------------------------------------------------------------------
@dataclass
class CacheView:
    """One layer's cache as the kernels address it: flat [slots, H, D] values or codes, and
    [slots, H] float16 scales for quantised sides."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    k_fmt: int
    v_fmt: int
    block_size: int
    overlay_k: torch.Tensor | None = None  # [rows, H, D] model dtype
    overlay_v: torch.Tensor | None = None

    @classmethod
    def of(cls, layer_cache) -> CacheView:
        """From a PagedKVCache or a QuantizedPagedKVCache (kvledger.storage.kv_cache, model.kv_quant)."""
        bs = layer_cache.block_size
        if getattr(layer_cache, "quantized", False):
            return cls(
                layer_cache.k_codes.flatten(0, 1),
                layer_cache.v_codes.flatten(0, 1),
                layer_cache.k_scales.flatten(0, 1),
                layer_cache.v_scales.flatten(0, 1),
                _FMT[layer_cache.k_fmt],
                _FMT[layer_cache.v_fmt],
                bs,
                layer_cache.overlay_k,
                layer_cache.overlay_v,
            )
        return cls(layer_cache.k.flatten(0, 1), layer_cache.v.flatten(0, 1), None, None, 0, 0, bs)


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: CacheView, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, H, D] at their slots (slot < 0: skipped)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and cache.k.is_contiguous()
    ks = cache.k_scales if cache.k_scales is not None else cache.k
    vs = cache.v_scales if cache.v_scales is not None else cache.v
    _write_kv_kernel[(num_tokens,)](
        k, v, slot_mapping, cache.k, cache.v, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.k.stride(0), cache.k.stride(1),
        cache.k_scales.stride(0) if cache.k_scales is not None else 0,
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim, 16),
        K_FMT=cache.k_fmt, V_FMT=cache.v_fmt,
    )  # fmt: skip


@dataclass
class Overlay:
    """Per-request overlay rows of a quantised cache (int32 [B] each), with S and R."""

    base: torch.Tensor  # first overlay row of the request's slot
    sink_from: torch.Tensor
    window_from: torch.Tensor
    sinks: int
    recent: int


def tile_shape(num_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program = tokens x the query heads of one KV head."""
    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else triton.next_power_of_2(group)
    if max_query_len > 1 and block_m < 64 and group <= 16:
        block_m = 64 if max_query_len >= 64 // group else 16  # prefill: more tokens per program
    return block_m, block_m // group


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: CacheView,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int = 1,
    overlay: Overlay | None = None,
    tile_n: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] over each request's cached context (k/v [T, K, D] already written; read here
    only for overlay rows) -> out [T, H * D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    if num_tokens == 0:
        return out
    head_pad = _pow2(head_dim, 16)
    group = num_heads // num_kv_heads
    block_m, block_q = tile_shape(num_heads, num_kv_heads, max_query_len)
    if tile_n is None:
        tile_n = max(64, cache.block_size)  # keys per iteration; any block size (looked up per key)
    num_splits = _pow2(num_splits)
    out3 = out.view(num_tokens, num_heads, head_dim)
    if num_splits > 1:
        part = torch.empty(num_tokens * num_heads * num_splits * head_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_tokens * num_heads * num_splits * 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    ks = cache.k_scales if cache.k_scales is not None else cache.k
    vs = cache.v_scales if cache.v_scales is not None else cache.v
    if overlay is not None:
        ovk, ovv = cache.overlay_k, cache.overlay_v
        ov = (ovk, ovv, overlay.base, overlay.sink_from, overlay.window_from)
        sinks, recent = overlay.sinks, overlay.recent
        ov_strides = (ovk.stride(0), ovk.stride(1))
    else:
        ov = (k, v, seq_lens, seq_lens, seq_lens)
        sinks = recent = 0
        ov_strides = (0, 0)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _attention_kernel[grid](
        out3, part, ml, q, k, v, cache.k, cache.v, ks, vs, *ov,
        block_tables, seq_lens, query_start_loc,
        scale, num_seqs, sinks, recent, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out3.stride(0), out3.stride(1),
        cache.k.stride(0), cache.k.stride(1),
        cache.k_scales.stride(0) if cache.k_scales is not None else 0,
        block_tables.stride(0), *ov_strides,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        TILE_N=tile_n, BLOCK_SIZE=cache.block_size,
        K_FMT=cache.k_fmt, V_FMT=cache.v_fmt, OVERLAY=overlay is not None,
        NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
        UPCAST=q.dtype == torch.bfloat16 and interpreted(),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        num_warps=8 if block_m * head_pad >= 64 * 128 else 4,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out3, part, ml, out3.stride(0), out3.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K factor for a decode step: enough programs to fill the GPU (2 per SM), no split
    shorter than 256 keys, a power of two <= 16."""
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, (2 * num_sms) // programs)
    cap = max(1, max_seq_len // 256)
    return min(16, 1 << int(math.log2(max(1, min(want, cap)))))
