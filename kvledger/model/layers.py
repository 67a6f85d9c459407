"""Building blocks shared by the Llama-family models, written to match Hugging Face's numerics.

The Hugging Face float32 forward pass is the oracle, so every op here follows its order of
operations and its dtypes (RMSNorm in float32, RoPE tables in float32, rotate-half layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.kernels import native
from kvledger.kernels.gemm_rows import RowInvariance, gemm_rows_bucket, rows_view
from kvledger.model.quant_group import GroupWeight, group_linear
from kvledger.model.quant_int8 import Int8Weight, int8_linear
from kvledger.model.quant_q4 import Q4Split, Q4Weight, q4_linear
from kvledger.storage import host_memory


class Linear(nn.Module):
    """y = x W^T (+ b). No initialisation: every weight comes from the checkpoint, and skipping
    nn.Linear's random init keeps meta-device construction free (it would import torch._dynamo)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        weight: torch.Tensor | None = None,
        row_invariance: RowInvariance | None = None,
    ) -> None:
        """``weight``: use this existing [out, in] tensor (a tied LM head shares the embedding's).
        ``row_invariance``: the owning model's (which leading rows take the row-wise kernel);
        a standalone Linear gets its own, which nothing sets."""
        super().__init__()
        self.in_features = in_features  # the weight's shape says it only while the weight is float
        self.row_invariance = RowInvariance() if row_invariance is None else row_invariance
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN copy of weight, see pack()
        self.small: native.GemmWeight | None = None  # the native few-row kernel's copy, see pack()
        self.quant: Int8Weight | GroupWeight | Q4Weight | Q4Split | None = None  # weight holds the codes, see quantize()

    @property
    def native_small(self) -> bool:
        """Few-row products take kvledger's own kernel (native.small_gemm)."""
        return self.small is not None

    def pack(self) -> None:
        """Prepare the weight for the CPU's fast paths (float32 or bfloat16).

        Decode steps multiply a handful of rows by every weight, so they stream weights from memory;
        on the plain row-major layout MKL's small-M GEMM reaches only a fraction of memory bandwidth
        (3-25 GFLOP/s here), oneDNN's blocked layout 1.5-2.5x that
        (docs/measurements/cpu_kernels.md, the issue-7 section). Same math, different summation
        order. The weight is reordered into that layout once (float32, and bfloat16 where oneDNN has
        native bf16).

        Products of at most gemm_rows.small_gemm_max_rows() rows (decode steps) go to
        native.small_gemm instead when it is available, on its own copy laid out for it
        (native.pack_weight, on huge pages): it streams the weight near memory bandwidth, faster
        still than the packed GEMM at those sizes (in bfloat16 it streams half the bytes and
        accumulates in float32).

        With both copies made, the plain weight is no longer read and is dropped (a meta
        tensor keeps its shape and dtype for accounting), so a weight costs two copies, not
        three (a tied embedding then reads its rows from the native copy, see pack_linears).
        """
        if self.quant is not None:
            return
        dt = self.weight.dtype
        if dt == torch.float32 or (dt == torch.bfloat16 and _onednn_bf16()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        if (
            native.library() is not None
            and dt in (torch.float32, torch.bfloat16)
            and self.weight.shape[1] % 8 == 0
            and (self.bias is None or (self.bias.is_contiguous() and self.bias.dtype == dt))
        ):
            self.small = native.pack_weight(self.weight, alloc=host_memory.weight_zeros)
        if self.packed is not None and self.small is not None:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def quantize(self, method: str) -> None:
        """Store the weight quantised (``int8``: W8A8, model/quant_int8.py; ``int4``: group-wise
        weight-only, model/quant_group.py). ``weight`` becomes the codes and the scales (and W8A8's
        code sums) sit beside it as parameters, so the ledger's weight bytes are what is held.
        Every product then goes through the format's kernel (pack() skips the layer)."""
        from kvledger.model import quant_group, quant_int8

        if method == "int8":
            self.set_quantized(quant_int8.quantize_weight(self.weight.data, alloc=host_memory.weight_zeros))
        elif method == "int4":
            self.set_quantized(quant_group.quantize_weight(self.weight.data, alloc=host_memory.zeros))
        else:
            raise ValueError(f"unknown quantization {method!r}")

    def set_quantized(self, w: GroupWeight | Int8Weight | Q4Weight | Q4Split) -> None:
        """Hold a quantised weight (made on the fly, or read from a GGUF / GPTQ / AWQ /
        compressed-tensors checkpoint) instead of a float one (group-wise ones become tiles for
        int8 activations later: LlamaForCausalLM.tile_group_weights). Its tensors are the
        module's parameters (and only they: a previous format's go), so the ledger counts what is
        held (a Q4Split's pieces after the first as quant_p<i>_*)."""
        for name in [n for n in self._parameters if n.startswith("quant_")]:
            del self._parameters[name]
        parts = w.parts if isinstance(w, Q4Split) else (w,)
        self.weight = nn.Parameter(parts[0].q, requires_grad=False)
        for i, part in enumerate(parts):
            prefix = "quant_" if i == 0 else f"quant_p{i}_"
            extra = {"q": part.q} if i else {}
            extra["scale"] = part.scale
            if isinstance(part, Int8Weight):
                extra["wsum"] = part.wsum
            else:
                extra.update(zero=part.zero, perm=part.perm)
                if isinstance(part, Q4Weight):
                    extra["super_scale"] = part.super_scale
            for name, t in extra.items():
                if t is not None:
                    self.register_parameter(prefix + name, nn.Parameter(t, requires_grad=False))
        self.quant = w

    def _native_takes(self, x: torch.Tensor) -> bool:
        """The native kernel can take x: a weight it packed, a 2-D input of that dtype."""
        small = self.small
        return small is not None and x.dim() == 2 and x.dtype == small.dtype

    def _row_wise(self, x: torch.Tensor) -> bool:
        """Every row of x takes the native row-wise kernel (gemm_rows.row_wise)."""
        return self._native_takes(x) and self.row_invariance.row_wise(x.shape[0], x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quant, Int8Weight):
            return int8_linear(x, self.quant, self.bias)
        if isinstance(self.quant, (Q4Weight, Q4Split)):
            return q4_linear(x, self.quant, self.bias)
        if self.quant is not None:
            return group_linear(x, self.quant, self.bias)
        if not self._native_takes(x):
            return self._big(x)
        small, m = self.small, x.shape[0]
        if self.row_invariance.row_wise(m, x.dtype):
            return native.small_gemm(x, small, self.bias)
        n = self.row_invariance.rows if x.dtype == torch.bfloat16 else 0
        if n > 0 and m >= OVERWRITE_MIN_ROWS and n * OVERWRITE_MAX_FRACTION <= m:
            # A few decode rows beside a long prefill: all rows through oneDNN, then the
            # decode rows overwritten in place by the row-wise kernel. Their products are
            # computed twice, but the output is not concatenated from two parts (a copy of
            # every row) nor the prefill rows copied into a padded bucket of their own.
            y = self._big(x)
            native.small_gemm(x[:n], small, self.bias, out=y[:n])
            return y
        if n > 0:  # the leading decode rows row-wise, the prefill rows through oneDNN
            return torch.cat([native.small_gemm(x[:n], small, self.bias), self._big(x[n:])])
        return self._big(x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float(); a bfloat16 product that takes the row-wise kernel (all rows within
        the model's RowInvariance: the LM head) gets its float32 copy from the kernel, same
        values."""
        if x.dtype == torch.bfloat16 and self._row_wise(x):
            return native.small_gemm(x, self.small, self.bias, float_out=True)
        return self(x).float()

    def _big(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _bucketed_rows(
                x, lambda t: torch.ops.mkldnn._linear_pointwise(t, self.packed, self.bias, "none", [], "")
            )
        if x.device.type == "cpu":
            return _bucketed_rows(x, lambda t: F.linear(t, self.weight, self.bias))
        return F.linear(x, self.weight, self.bias)


# A product of at least OVERWRITE_MIN_ROWS rows whose leading row-wise rows are at most 1/16 of them
# goes whole through oneDNN, those rows then overwritten in place (see Linear.forward). Measured on
# the 60M model's four bf16 shapes, summed, against concatenating the two parts
# (docs/measurements/cpu_kernels.md, "Inside a full-budget step"): 1,024-2,048 rows beside 8-58
# decode rows 0.85-0.99x the time; 136-264 rows beside 8, 1.12-1.18x (the doubly computed rows cost
# more than the copies saved there).
OVERWRITE_MAX_FRACTION = 16
OVERWRITE_MIN_ROWS = 1024


def _onednn_bf16() -> bool:
    """oneDNN runs bf16 natively here (avx512_bf16 / AMX); elsewhere it would emulate it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _bucketed_rows(x: torch.Tensor, matmul) -> torch.Tensor:
    """``matmul(x)`` for a 2-D x, computed on x padded with rows to its bucket: in place where x
    was allocated with room for them (gemm_rows.empty_rows), else a padded copy."""
    if x.dim() != 2:
        return matmul(x)
    m = x.shape[0]
    mp = gemm_rows_bucket(m)
    if mp == m:
        return matmul(x)
    padded = rows_view(x, mp)
    if padded is None:
        # Not F.pad: it fills the whole padded tensor with zeros and then copies x over it, two
        # passes where one copy and a zeroed tail do (5 % of a 2,048-token kvledger-tiny prefill).
        padded = x.new_empty(mp, x.shape[1])
        padded[:m].copy_(x)
        padded[m:].zero_()
    return matmul(padded)[:m]


def warm_up_gemm_shapes(
    model: nn.Module, max_rows: int, head_rows: int, flop_budget: float = 2e10
) -> tuple[int, int]:
    """Run each packed weight once at every row bucket a step can reach, at start-up.

    oneDNN builds a primitive (~400 KB here) per GEMM shape the first time it sees it. Left to
    traffic, the rarer buckets keep appearing for thousands of requests, so resident memory
    creeps towards its bound (buckets x distinct weight shapes: 116 MiB for stories260k's five
    shapes, 100x its weights) and each new shape's first step pays the creation (issue 23).
    Creating them here puts a server at its plateau before the first request, as CUDA-graph
    capture does on GPUs. Buckets go smallest first across all shapes, within ``flop_budget``
    (~0.15 s): small models, where the cache dwarfs the weights, are warmed completely; large
    ones warm their common sizes, and the rest of their cache stays small next to their weights.
    Layer weights see up to ``max_rows`` rows (a step's token budget), the LM head ``head_rows``
    (one per sampled request); row counts the native kernel takes (the model's dispatch, so warm up
    after it is set) need no primitive.
    Returns (GEMMs run, of how many shapes in all).
    """
    head = model.head
    shapes: dict[tuple, tuple[Linear, int]] = {}
    for m in [*model.modules(), head]:
        if isinstance(m, Linear) and m.packed is not None:
            if m is head and m.native_small and m.weight.dtype == torch.bfloat16:
                continue  # bf16 LM-head rows all take the native kernel (RowInvariance)
            key = (tuple(m.weight.shape), m.weight.dtype, m.bias is None)
            rows = head_rows if m is head else max_rows
            shapes[key] = (m, max(rows, shapes.get(key, (m, 0))[1]))
    todo = []
    for lin, rows in shapes.values():
        dt = lin.weight.dtype
        big = (r for r in range(1, rows + 1) if not (lin.native_small and lin.row_invariance.row_wise(r, dt)))
        todo += [(b, lin) for b in sorted({gemm_rows_bucket(r) for r in big})]
    todo.sort(key=lambda t: t[0])
    spent, done = 0.0, 0
    with torch.inference_mode():
        for b, lin in todo:
            spent += 2.0 * b * lin.weight.numel()
            if spent > flop_budget:
                break
            lin._big(torch.zeros(b, lin.weight.shape[1], dtype=lin.weight.dtype))
            done += 1
    return done, len(todo)


def can_pack_linear(dtype: torch.dtype, device: torch.device) -> bool:
    """Linear.pack pays on CPU in float32 and bfloat16 (fp16 would be emulated by oneDNN)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        # Tied to a packed LM head whose plain weight was dropped: rows read from its native copy.
        self.rows_from: native.GemmWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            return native.weight_rows(self.rows_from, ids.reshape(-1)).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF's LlamaRMSNorm.

    ``unit_offset`` (Gemma): the checkpoint stores w and the scale is (1 + w), applied in float32
    before the cast back, as HF's GemmaRMSNorm does.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        unit_offset: bool = False,
        row_invariance: RowInvariance | None = None,
    ) -> None:
        """``row_invariance``: the owning model's, which says whether the GEMM the output feeds
        pads its rows (so whether to allocate them, gemm_rows.empty_rows)."""
        super().__init__()
        self.row_invariance = RowInvariance() if row_invariance is None else row_invariance
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        self._scale: torch.Tensor | None = None  # 1 + w in float32, made on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return self._forward_offset(x)
        input_dtype = x.dtype
        if x.shape[-1] % 8 == 0 and native.available(x) and self.weight.dtype == input_dtype:
            return native.rms_norm(x, self.weight, self.eps, self.row_invariance)
        if input_dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The fused kernel gives the same bits as HF's composite in float32, in one op.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

    def _forward_offset(self, x: torch.Tensor) -> torch.Tensor:
        if self._scale is None or self._scale.device != self.weight.device:
            self._scale = 1.0 + self.weight.detach().float()
        if x.dtype == torch.float32:
            if x.shape[-1] % 8 == 0 and native.available(x):
                return native.rms_norm(x, self._scale, self.eps, self.row_invariance)
            return F.rms_norm(x, self._scale.shape, self._scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self._scale).to(x.dtype)


def _default_inv_freq(dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict, device) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, blend by a linear ramp."""
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope_inv_freq(
    dim: int, theta: float, scaling: dict, max_positions: int, device
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency rescale factors, short ones up to the original context
    and long ones past it; (short inv_freq, long inv_freq, attention scaling)."""
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    out = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32, device=device)
        out.append(1.0 / (ext * theta**shape))
    return out[0], out[1], attention_factor


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Inverse frequencies as HF computes them (default, llama3, linear, dynamic, yarn; the
    short set for longrope). See RotaryEmbedding for the attention scaling and longrope."""
    return _inv_freqs(head_dim, theta, scaling, 0, device)[0]


def _inv_freqs(
    dim: int, theta: float, scaling: dict | None, max_positions: int, device
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(inv_freq, long inv_freq or None, attention scaling) for one RoPE configuration."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK changes the base only past max_position_embeddings, which kvledger's
        # context never exceeds (the loader caps max_model_len there): default frequencies.
        return _default_inv_freq(dim, theta, device), None, 1.0
    if rope_type == "linear":
        return _default_inv_freq(dim, theta, device) / scaling["factor"], None, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(dim, theta, device), scaling), None, 1.0
    if rope_type == "yarn":
        inv, att = _yarn_inv_freq(dim, theta, scaling, device)
        return inv, None, att
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, theta, scaling, max_positions, device)
    raise ValueError(f"unsupported RoPE type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with float32 cos/sin tables precomputed for every position.

    The table entries are the same elementwise ops HF runs per call (position * inv_freq, then
    cos/sin, times the attention scaling), so looking them up by position reproduces HF's
    values. ``rotary_dim`` < head_dim (partial rotary, Phi-4-mini) rotates the first dims only.

    LongRoPE keeps two tables one after the other: rows [0, P) with the short factors and
    rows [P, 2P) with the long ones. HF picks the long set for a whole forward call once its
    sequence exceeds the original context; ``table_index`` reproduces that per request.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None = None,
        device: torch.device | str = "cpu",
        rotary_dim: int | None = None,
        model_max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, long_inv_freq, attention_scaling = _inv_freqs(
            self.rotary_dim, theta, scaling, model_max_positions or max_positions, device
        )
        self.long_from: int | None = None  # sequences longer than this use the long table
        self.num_positions = max_positions
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        tables = [inv_freq] if long_inv_freq is None else [inv_freq, long_inv_freq]
        if long_inv_freq is not None:
            self.long_from = int(scaling["original_max_position_embeddings"])
        cos, sin = [], []
        for inv in tables:
            freqs = positions[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos.append(emb.cos() * attention_scaling)
            sin.append(emb.sin() * attention_scaling)
        self.register_buffer("cos_cache", torch.cat(cos), persistent=False)
        self.register_buffer("sin_cache", torch.cat(sin), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.num_positions

    def table_index(self, positions: torch.Tensor, token_seq_lens: torch.Tensor | None) -> torch.Tensor:
        """Row of each token's cos/sin: its position, or position + P where its request's
        sequence (after this step) is longer than the original context (LongRoPE)."""
        if self.long_from is None or token_seq_lens is None:
            return positions
        return positions + (token_seq_lens > self.long_from).long() * self.num_positions

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim] in the model dtype (computed once per step, shared by all layers)."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


@dataclass
class RopeStep:
    """One step's RoPE inputs, made once and shared by every layer: either the gathered cos/sin
    rows (torch path) or, for the native kernel, the tables it looks positions up in."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor | None = None  # [T, 1, head_dim] (torch path)
    sin: torch.Tensor | None = None
    tables: RotaryEmbedding | None = None  # native path

    @classmethod
    def make(cls, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, use_native: bool) -> RopeStep:
        if use_native:
            return cls(positions, tables=rotary)
        cos, sin = rotary(positions, dtype)
        return cls(positions, cos, sin)

    def rotate_(self, x: torch.Tensor, num_heads: int, head_dim: int) -> None:
        """Native path: rotate the first num_heads heads of each row of 2-D x in place."""
        native.rope_(x, num_heads, head_dim, self.positions, self.tables.cos_cache, self.tables.sin_cache)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, rotary_dim]. Same expression as HF; with a
    partial rotary the dims past rotary_dim pass through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)


def activation(name: str):
    """The MLP activations of the supported families, by their HF names."""
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one matmul ([gate; up] rows)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        act: str = "silu",
        row_invariance: RowInvariance | None = None,
    ) -> None:
        """``row_invariance``: the owning model's, shared with both projections."""
        super().__init__()
        self.row_invariance = RowInvariance() if row_invariance is None else row_invariance
        self.act_name = act
        self.act = activation(act)
        self.intermediate_size = intermediate_size
        rows = self.row_invariance
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias=bias, row_invariance=rows
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, row_invariance=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (
            self.act_name == "silu"
            and self.intermediate_size % 8 == 0
            and gate_up.dim() == 2
            and native.available(gate_up)
        ):
            return self.down_proj(native.silu_mul(gate_up.contiguous(), self.row_invariance))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
