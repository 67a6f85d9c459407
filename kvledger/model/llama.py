"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch of tokens and a paged KV cache.

One forward per engine step: the tokens of all scheduled requests (prefill chunks and decodes)
are concatenated, and the attention backend maps them to their requests via AttentionMetadata.
The four architectures differ only in config flags (biases, q/k norm), so one class covers them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.model import native
from kvledger.model.attention.backend import AttentionBackend
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.attention.torch_backend import TorchAttentionBackend
from kvledger.model.kv_cache import LayerKVCache
from kvledger.model.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RopeStep,
    RotaryEmbedding,
    apply_rotary,
)


@dataclass
class ModelConfig:
    """The architecture facts the model needs, normalised from an HF config.json by the loader."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, None for default RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k, v in one matmul: one weight read and one dispatch instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeStep,
        meta: AttentionMetadata,
        kv_cache: LayerKVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope.cos, rope.sin
        if rope.tables is not None:
            # Native: q and k rotated in place inside the fused output (same bits as below).
            rope.rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim)
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        elif self.q_norm is None:
            # q and k are adjacent in the fused output: rotate them as one [T, H + K, D] tensor.
            qk = qkv[:, :qk_size].view(
                num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
            q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            q = apply_rotary(self.q_norm(q), cos, sin)
            k = apply_rotary(self.k_norm(k), cos, sin)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: RopeStep,
        meta: AttentionMetadata,
        kv_cache: LayerKVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        # Same residual order as HF, so bf16/fp16 rounding matches too.
        residual = h
        h = self.self_attn(self.input_layernorm(h), rope, meta, kv_cache, backend)
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h))
        return residual + h


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Module tree mirrors HF's names except the fused qkv_proj and gate_up_proj."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        rope_device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # The RoPE tables are computed, not loaded: built on the real device even when the
        # weights are constructed on the meta device.
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            device=rope_device,
        )
        self.attn_backend: AttentionBackend = TorchAttentionBackend()
        self.__dict__["tied_head"] = None  # packed copy of a tied LM head, see pack_linears()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[LayerKVCache],
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 → final-normed hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        use_native = (
            self.config.head_dim % 16 == 0 and not self.config.qk_norm and native.available(h)
        )
        rope = RopeStep.make(self.rotary_emb, positions, h.dtype, use_native)
        backend = self.attn_backend
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, rope, attn_metadata, kv_cache, backend)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → float32 logits [N, vocab]; pass only the rows that need logits."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if head is not None:
            return head(hidden_states).float()
        return F.linear(hidden_states, self.model.embed_tokens.weight).float()

    def pack_linears(self) -> None:
        """Pack every matmul weight for oneDNN (see Linear.pack); a tied LM head gets its own
        packed copy, and the embedding looks tokens up in the head's plain weight (one tensor)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None:
            embed = self.model.embed_tokens.weight
            head = Linear(embed.shape[1], embed.shape[0], weight=embed)
            head.pack()
            self.model.embed_tokens.weight = head.weight  # still one tensor if pack() copied it
            # Not registered as a submodule: the tied weight must not appear twice in state_dict.
            self.__dict__["tied_head"] = head
