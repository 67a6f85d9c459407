"""Python wrappers of the native CPU kernels (csrc/), called through ctypes on the library
kvledger.kernels.native_build compiles and loads; each checks what its kernel takes, and callers
fall back to torch's kernels where ``library()`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.kernels.gemm_rows import RowInvariance, empty_rows
from kvledger.kernels.native_build import library

# Element codes of csrc/simd.h.
ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, "int8": 3, "fp8": 4}


def available(t: torch.Tensor) -> bool:
    """Native kernels run here and take this tensor's dtype and device (float32 or bfloat16, CPU)."""
    return t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" and library() is not None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: unsupported arguments")


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


def masked_argmax(
    logits: torch.Tensor, mask: torch.Tensor, rows: list[int], threads: int | None = None
) -> torch.Tensor | None:
    """Per row of ``rows``: the argmax of a float32 logits row over the tokens the packed int32
    grammar bitmask allows (csrc/grammar_mask.c), rows spread over ``threads`` OpenMP threads
    (default: torch's intra-op count); None where the kernels do not run here."""
    lib = library()
    if lib is None or logits.dtype != torch.float32 or logits.stride(1) != 1 or mask.stride(1) != 1:
        return None
    idx = torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(len(rows), dtype=torch.int64)
    _check(
        lib.kvl_masked_argmax(
            logits.data_ptr(), logits.stride(0), logits.shape[1], mask.data_ptr(), mask.stride(0),
            mask.shape[1], idx.data_ptr(), len(rows), out.data_ptr(), threads or torch.get_num_threads(),
        ),
        "masked_argmax",
    )
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) of a 2-D float32 CPU tensor with unit column stride
    (csrc/argmax.c: same first index of the maximum, same NaN rule), rows over torch's intra-op
    threads; None where the kernels do not run here."""
    lib = library()
    if (
        lib is None
        or logits.dim() != 2
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.stride(1) != 1
        or logits.shape[1] == 0
        or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1])  # overlapping rows
    ):
        return None
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    stride = logits.stride(0) if rows > 1 else n
    _check(
        lib.kvl_argmax_rows(logits.data_ptr(), stride, rows, n, out.data_ptr(), torch.get_num_threads()),
        "argmax_rows",
    )
    return out


def rope_(
    x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
    cos_table: torch.Tensor, sin_table: torch.Tensor,
) -> None:
    """Rotate-half RoPE in place on the first num_heads * head_dim values of each row of the 2-D
    float32 or bfloat16 x (rows may be strided, e.g. q and k inside a fused qkv output); cos/sin
    tables are [max_positions, head_dim] float32 (rounded to bf16 for a bf16 x, as the torch
    path does), positions int64 [rows]. head_dim % 16 == 0."""
    assert x.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
    lib = library()
    fn = lib.kvl_rope_inplace_bf16 if _bf16(x) else lib.kvl_rope_inplace
    _check(
        fn(
            x.data_ptr(), x.shape[0], x.stride(0), num_heads, head_dim, positions.data_ptr(),
            cos_table.data_ptr(), sin_table.data_ptr(), torch.get_num_threads(),
        ),
        "rope_",
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows: RowInvariance | None = None
) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (a multiple of 8); x and weight both
    float32 or both bfloat16 (normalised in float32, rounded, then times the weight: HF's order).
    A 2-D result feeds a GEMM: allocated with its padding rows (gemm_rows.empty_rows; the model's
    ``rows`` say which products pad nothing)."""
    x = x.contiguous()
    n = x.shape[-1]
    if x.dim() == 2:  # feeds a GEMM
        y = empty_rows(x.shape[0], n, x.dtype, rows=rows)
    else:
        y = torch.empty_like(x)
    lib = library()
    fn = lib.kvl_rms_norm_bf16 if _bf16(x) else lib.kvl_rms_norm
    _check(
        fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps, torch.get_num_threads()),
        "rms_norm",
    )
    return y


def silu_mul(gate_up: torch.Tensor, rows: RowInvariance | None = None) -> torch.Tensor:
    """silu(gate) * up for a contiguous [rows, 2 * inter] float32/bfloat16 tensor of [gate | up]
    rows, allocated as the down projection's input (see rms_norm)."""
    m, width = gate_up.shape
    out = empty_rows(m, width // 2, gate_up.dtype, rows=rows)
    lib = library()
    fn = lib.kvl_silu_mul_bf16 if _bf16(gate_up) else lib.kvl_silu_mul
    _check(fn(gate_up.data_ptr(), out.data_ptr(), m, width // 2, torch.get_num_threads()), "silu_mul")
    return out


@dataclass(frozen=True)
class GemmWeight:
    """A matmul weight [n, k] as the native few-row kernel reads it: in the blocked layout of
    csrc/small_gemm.c (float32 always; bfloat16 where the build has vdpbf16ps), else row-major."""

    data: torch.Tensor
    n: int
    k: int
    blocked: bool
    tile: int  # outputs per tile of the build that laid it out (its vector width sets it)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def pack_weight(weight: torch.Tensor, alloc=torch.empty) -> GemmWeight:
    """``weight`` [N, K] (float32 or bfloat16, K % 8 == 0) laid out for small_gemm, in memory
    from ``alloc(shape, dtype=...)`` (host_memory.zeros puts it on huge pages)."""
    n, k = weight.shape
    lib = library()
    w = weight.detach().contiguous()
    if _bf16(w) and not lib.bf16_packed:
        out = alloc((n, k), dtype=w.dtype)
        out.copy_(w)
        return GemmWeight(out, n, k, blocked=False, tile=lib.tile_width)
    out = alloc((lib.kvl_packed_weight_numel(n, k),), dtype=w.dtype)
    _check(lib.kvl_pack_weight(w.data_ptr(), out.data_ptr(), n, k, w.element_size()), "pack_weight")
    return GemmWeight(out, n, k, blocked=True, tile=lib.tile_width)


def weight_rows(weight: GemmWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (1-D) of the [n, k] weight, read back from its layout: the lookup of an
    embedding tied to a packed LM head, so that the plain copy need not be kept for it."""
    if not weight.blocked:
        return weight.data[ids]
    tile = weight.tile
    t, i = ids // tile, ids % tile
    if weight.dtype == torch.float32:  # [tile][k][lane]
        return weight.data.view(-1, weight.k, tile)[t, :, i]
    pairs = weight.data.view(-1, weight.k // 2, tile, 2)[t, :, i]  # [tile][k / 2][lane][k % 2]
    return pairs.reshape(ids.shape[0], weight.k)


def small_gemm(
    x: torch.Tensor,
    weight: GemmWeight | torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    float_out: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) with the native kernel; CPU, float32 or bfloat16 (x,
    weight and bias of one dtype; bf16 accumulates in float32), K % 8 == 0, bias contiguous
    (the caller checks, see Linear.forward). A plain tensor is packed first (tests; layers keep
    their GemmWeight). ``out``: a contiguous [M, N] tensor of x's dtype to write into (rows of
    a larger result), returned. ``float_out`` (bfloat16, not with out): the bf16 result as
    float32, written so by the kernel where the weight is blocked."""
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 2 or weight.shape[1] % 8 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"small_gemm: unsupported shape x {tuple(x.shape)} weight {tuple(weight.shape)}")
        weight = pack_weight(weight)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"small_gemm: x {x.dtype} and weight {weight.dtype} must share one dtype")
    lib = library()
    if weight.blocked and weight.tile != lib.tile_width:
        raise ValueError(
            f"small_gemm: weight laid out in tiles of {weight.tile} outputs, the loaded build's "
            f"are {lib.tile_width} (pack it again after changing KVLEDGER_NATIVE_ISA)"
        )
    float_out = float_out and _bf16(x) and out is None
    if float_out:
        if not weight.blocked:
            return small_gemm(x, weight, bias).float()
        fn = lib.kvl_small_gemm_bf16_packed_f32out
    elif _bf16(x):
        fn = lib.kvl_small_gemm_bf16_packed if weight.blocked else lib.kvl_small_gemm_bf16
    else:
        fn = lib.kvl_small_gemm_packed
    x = x.contiguous()
    m, k = x.shape
    if k != weight.k:
        raise ValueError(f"small_gemm: x {tuple(x.shape)} against a weight of {weight.k} columns")
    if out is None:
        y = torch.empty(m, weight.n, dtype=torch.float32 if float_out else x.dtype)
    elif out.shape != (m, weight.n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"small_gemm: out {tuple(out.shape)} {out.dtype} must be a contiguous ({m}, {weight.n}) {x.dtype}"
        )
    else:
        y = out
    rc = fn(
        x.data_ptr(),
        weight.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        weight.n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"small_gemm: unsupported shape x {tuple(x.shape)} weight ({weight.n}, {weight.k})")
    return y


def can_quantize_write(k: torch.Tensor) -> bool:
    """quantize_write takes these new rows: CPU, float32 or bfloat16, head_dim <= 256."""
    return k.device.type == "cpu" and k.dtype in (torch.float32, torch.bfloat16) and k.shape[-1] <= 256 and library() is not None


def _new_kv_rows(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's new k, v [T, Hkv, D] as the write kernels take them (rows of one stride, heads
    packed: views of the fused qkv output pass as they are) and the slots as contiguous int64."""
    if k.stride() != v.stride() or k.stride(2) != 1 or k.stride(1) != k.shape[2]:
        k, v = k.contiguous(), v.contiguous()
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    return k, v, slots.contiguous()


def write_kv(layer_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """PagedKVCache.write in one native call (csrc/kv_write.c): rows k, v [T, Hkv, D] copied to
    their slots. False (nothing written) where the call does not apply: not CPU, another dtype
    than the cache's, a cache that is not one contiguous [slots, Hkv, D] block, or no native
    library; raises ValueError naming a slot out of range."""
    kc, vc = layer_cache.k, layer_cache.v
    if (
        k.device.type != "cpu"
        or k.dtype != kc.dtype
        or kc.dtype not in (torch.float32, torch.bfloat16)
        or not (kc.is_contiguous() and vc.is_contiguous())
    ):
        return False
    lib = library()
    if lib is None:
        return False
    k, v, slots = _new_kv_rows(k, v, slot_mapping)
    num_blocks, block_size, hkv, d = kc.shape
    rc = lib.kvl_write_kv(
        k.data_ptr(), v.data_ptr(), k.stride(0), k.element_size(), slots.data_ptr(), k.shape[0], hkv * d,
        num_blocks * block_size, kc.data_ptr(), vc.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"write_kv: a slot outside the cache's {num_blocks * block_size} (k {tuple(k.shape)})")
    return True


def quantize_write(layer_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_quant.QuantizedPagedKVCache.write in one native call: codes and float16 scales of the
    new rows k, v [T, Hkv, D] at their slots, bit-identical to kv_quant.quantize (csrc/kv_quant.c)."""
    k, v, slots = _new_kv_rows(k, v, slot_mapping)
    t, hkv, d = k.shape
    _check(
        library().kvl_quantize_write(
            k.data_ptr(), v.data_ptr(), k.stride(0), ELEM[k.dtype], slots.data_ptr(), t, hkv, d,
            layer_cache.k_codes.data_ptr(), layer_cache.v_codes.data_ptr(), ELEM[layer_cache.k_fmt],
            ELEM[layer_cache.v_fmt], layer_cache.k_scales.data_ptr(), layer_cache.v_scales.data_ptr(),
            torch.get_num_threads(),
        ),
        "quantize_write",
    )


def cache_elems(layer_cache) -> tuple[int, int] | None:
    """Element codes (K, V) of a layer cache that paged_decode reads in place, or None."""
    if getattr(layer_cache, "quantized", False):
        return ELEM[layer_cache.k_fmt], ELEM[layer_cache.v_fmt]
    k = getattr(layer_cache, "k", None)
    if k is None or k.dtype not in ELEM:
        return None
    return ELEM[k.dtype], ELEM[k.dtype]


def can_paged_decode(layer_cache, num_heads: int, dtype: torch.dtype) -> bool:
    """Whether paged_decode handles this layer cache for queries of `dtype`: CPU, q in float32
    or bfloat16, the cache unquantised in the same dtype or int8/fp8 codes with scales,
    contiguous [num_blocks, block_size, num_kv_heads, head_dim] with head_dim % 8 == 0 and at
    most 16 query heads per KV head."""
    lib = library()
    if lib is None or dtype not in (torch.float32, torch.bfloat16):
        return False
    quantized = getattr(layer_cache, "quantized", False)
    k = layer_cache.k_codes if quantized else getattr(layer_cache, "k", None)
    if k is None or k.device.type != "cpu" or (not quantized and k.dtype != dtype):
        return False
    if quantized and getattr(layer_cache, "dtype", dtype) != dtype:
        return False
    _, _, num_kv_heads, head_dim = k.shape
    return (
        cache_elems(layer_cache) is not None
        and k.is_contiguous()
        and head_dim % 8 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
    )


# Threads for work large enough to split (0: torch's count). An engine core that computes
# with one torch thread (core_threads.py: a small model's decode matmuls are not worth a second
# thread, whose core the front end needs) still splits what grows with the load and not the
# model: a decode attention reading megabytes of K/V (one parallel region per layer; 41 % of
# the tiny model's core at 64 streams, on one thread beside an idle core), and a step of more
# than a handful of tokens (one carrying a prompt's prefill, or 32+ decoding rows), whose
# matmuls a second thread halves. The step threshold was 256 tokens; at 32, the tiny model's
# prefill-carrying steps no longer run on one thread, which set its inter-token p99 at 8
# streams (21-23 -> 14-17.5 ms, docs/measurements/serving_settings.md, "Prefill steps of 32 or
# more tokens over both threads").
_split_threads = 0
DECODE_SPLIT_BYTES = 2 << 20  # K/V bytes one paged_decode call reads before it splits
SPLIT_STEP_TOKENS = 32  # tokens in a step before its whole forward splits


def set_split_threads(n: int) -> None:
    """Let large decode attentions and large steps use ``n`` threads (0: never more than torch's)."""
    global _split_threads
    _split_threads = max(0, int(n))


def attention_threads(kv_tokens: int, bytes_per_token: int) -> int:
    """Threads for an attention call reading kv_tokens context tokens of bytes_per_token K/V:
    set_split_threads' count from DECODE_SPLIT_BYTES on, else torch's (each work item is one
    thread's, so the result is the same either way)."""
    threads = torch.get_num_threads()
    if _split_threads > threads and kv_tokens * bytes_per_token >= DECODE_SPLIT_BYTES:
        return _split_threads
    return threads


def step_threads(num_tokens: int) -> int:
    """Threads for a forward over ``num_tokens`` tokens, where that differs from torch's (else 0)."""
    if _split_threads > torch.get_num_threads() and num_tokens >= SPLIT_STEP_TOKENS:
        return _split_threads
    return 0


def paged_decode(
    q: torch.Tensor,
    layer_cache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    fp_spans: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    kv_tokens: int = 0,
) -> None:
    """out[rows[b]] = softmax(q[rows[b]] K_b^T * scale) V_b for each decoding request b, where
    K_b, V_b are the first seq_lens[b] tokens of the blocks block_tables[b] (read in place, in
    the cache's stored format; quantised codes are scaled per token and KV head).

    q [T, H, D] and out [T, H * D] contiguous in the model dtype; block_tables [B, max_blocks],
    seq_lens and rows [B], all int64 with contiguous rows (the caller checks can_paged_decode
    first). Quantised caches with an overlay: fp_spans [B, 5] int64 (see csrc/paged_decode.c)
    and this step's k/v [T, Hkv, D] (rows of one stride, heads contiguous) name the positions
    read in full precision. ``kv_tokens``: the sum of seq_lens, if the caller knows it (a
    large sum may take more threads, see set_split_threads; the result is the same)."""
    if fp_spans is not None and (
        k_new.stride(0) != v_new.stride(0) or k_new.stride(2) != 1 or k_new.stride(1) != k_new.shape[2]
        or v_new.stride(2) != 1 or v_new.stride(1) != v_new.shape[2]
    ):
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    quantized = getattr(layer_cache, "quantized", False)
    kt, vt = cache_elems(layer_cache)
    if quantized:
        kc, vc = layer_cache.k_codes, layer_cache.v_codes
        ks, vs = layer_cache.k_scales.data_ptr(), layer_cache.v_scales.data_ptr()
    else:
        kc, vc = layer_cache.k, layer_cache.v
        ks = vs = None
    num_blocks, block_size, num_kv_heads, head_dim = kc.shape
    ov = fp_spans is not None
    threads = attention_threads(kv_tokens, num_kv_heads * head_dim * 2 * kc.element_size())
    rc = library().kvl_paged_decode(
        q.data_ptr(),
        q.stride(0),
        kc.data_ptr(),
        vc.data_ptr(),
        kt,
        vt,
        ks,
        vs,
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows.data_ptr(),
        rows.shape[0],
        out.data_ptr(),
        out.stride(0),
        ELEM[q.dtype],
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        fp_spans.data_ptr() if ov else None,
        layer_cache.overlay_k.data_ptr() if ov else None,
        layer_cache.overlay_v.data_ptr() if ov else None,
        layer_cache.sink_tokens if ov else 0,
        layer_cache.recent_tokens if ov else 0,
        k_new.data_ptr() if ov else None,
        v_new.data_ptr() if ov else None,
        k_new.stride(0) if ov else 0,
        threads,
    )
    if rc != 0:
        raise ValueError(f"paged_decode: unsupported arguments (q {tuple(q.shape)}, cache {tuple(kc.shape)})")


def paged_prefill(
    q: torch.Tensor,
    layer_cache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    row0: torch.Tensor,
    nrows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    kv_tokens: int = 0, tree: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Causal attention of prefill chunks over an unquantised paged cache, read in place: chunk
    c's rows q[row0[c] : row0[c] + nrows[c]] end a context of seq_lens[c] tokens in blocks
    block_tables[c] (this step's K/V already written), each row attending to the tokens up to its
    own position (``tree``: int64 [T] token trees' ancestor masks, see csrc/paged_prefill.c);
    a chunk's rows are computed together. q [T, H, D] with contiguous heads and out [T, H * D],
    in the model dtype, which is the cache's; block_tables [C, max_blocks], seq_lens, row0 and
    nrows [C], int64 with contiguous rows (the caller checks can_paged_decode first).
    ``kv_tokens``: the context tokens the rows read in all (the thread rule of paged_decode;
    the result is the same)."""
    kc, vc = layer_cache.k, layer_cache.v
    _, block_size, num_kv_heads, head_dim = kc.shape
    threads = attention_threads(kv_tokens, num_kv_heads * head_dim * 2 * kc.element_size())
    rc = library().kvl_paged_prefill_tree(
        q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), ELEM[kc.dtype], block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), row0.data_ptr(), nrows.data_ptr(), row0.shape[0],
        out.data_ptr(), out.stride(0), ELEM[q.dtype], q.shape[1], num_kv_heads, head_dim, block_size, scale,
        threads, None if tree is None else tree.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"paged_prefill: unsupported arguments (q {tuple(q.shape)}, cache {tuple(kc.shape)})")
