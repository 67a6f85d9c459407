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

from kvledger.model import host_memory, native


class Linear(nn.Module):
    """y = x W^T (+ b). No initialisation: every weight comes from the checkpoint, and skipping
    nn.Linear's random init keeps meta-device construction free (it would import torch._dynamo)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, weight: torch.Tensor | None = None
    ) -> None:
        """``weight``: use this existing [out, in] tensor (a tied LM head shares the embedding's)."""
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN copy of weight, see pack()
        self.native_small = False  # few-row products use kvledger's own kernel, see pack()

    def pack(self) -> None:
        """Reorder the weight once into oneDNN's blocked layout (CPU, float32).

        Decode steps multiply a handful of rows by every weight, so they stream weights
        from memory; on the plain row-major layout MKL's small-M GEMM reaches only a fraction
        of memory bandwidth (3-25 GFLOP/s here), the packed layout 1.5-2.5x that
        (docs/benchmarks.md, issue 7). Same float32 math, different summation order.

        Products of at most SMALL_GEMM_MAX_ROWS rows (decode steps) go to native.small_gemm
        instead when it is available: it streams the plain row-major weight near memory
        bandwidth, faster still than the packed GEMM at those sizes.
        """
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        self.native_small = (
            native.library() is not None
            and self.weight.shape[1] % 8 == 0
            and (self.bias is None or self.bias.is_contiguous())
        )
        if self.native_small:
            # The native kernel streams this copy: on huge pages (host_memory), not a view of
            # the checkpoint's memory-mapped file.
            self.weight = nn.Parameter(host_memory.copy_of(self.weight.detach()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if self.native_small and x.dim() == 2 and x.shape[0] <= native.SMALL_GEMM_MAX_ROWS:
                return native.small_gemm(x, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack_linear(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing pays on CPU in float32 (bf16/fp16 on AVX2 CPUs would be emulated)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if x.shape[-1] % 8 == 0 and native.available(x) and self.weight.dtype == torch.float32:
            return native.rms_norm(x, self.weight, self.eps)
        if input_dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The fused kernel gives the same bits as HF's composite in float32, in one op.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Inverse frequencies as HF computes them: default RoPE, or Llama 3.1's piecewise rescaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
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


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with float32 cos/sin tables precomputed for every position.

    The table entries are the same elementwise ops HF runs per call (position * inv_freq, then
    cos/sin), so looking them up by position reproduces HF's values.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_cache.shape[0]

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] in the model dtype (computed once per step, shared by all layers)."""
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
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]. Same expression as HF."""
    return (x * cos) + (rotate_half(x) * sin)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one matmul ([gate; up] rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.intermediate_size % 8 == 0 and gate_up.dim() == 2 and native.available(gate_up):
            return self.down_proj(native.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
