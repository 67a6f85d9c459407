"""The decoder for every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Mixtral,
Qwen3-MoE) over a flat batch of tokens and a paged KV cache.

One forward per engine step: the tokens of all scheduled requests (prefill chunks and decodes)
are concatenated, and the attention backend maps them to their requests via AttentionMetadata.
The families differ in config facts only (biases, q/k norms, Gemma's norm offset, sandwich
norms, embedding scale, soft-capping, sliding-window layers with their own RoPE, MoE MLPs),
so one class covers them, each option following its HF model's order of operations.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvledger import envs
from kvledger.hf.config import ModelConfig
from kvledger.kernels import native
from kvledger.kernels.gemm_rows import RowInvariance
from kvledger.model.attention.backend import AttentionBackend
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.attention.torch_backend import TorchAttentionBackend
from kvledger.model.fused_layer import FusedLayers
from kvledger.model.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RopeStep,
    RotaryEmbedding,
    apply_rotary,
)
from kvledger.model.moe import SparseMoE
from kvledger.storage.kv_cache import LayerKVCache


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, row_invariance: RowInvariance) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.softcap = cfg.attn_softcap
        self.local_rope = cfg.is_sliding(layer) and cfg.local_rope_theta is not None
        # q, k, v in one matmul: one weight read and one dispatch instead of three.
        rows = row_invariance
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias, row_invariance=rows
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, row_invariance=rows)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset, rows)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset, rows)
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
        if self.window is None and self.softcap is None:
            o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            o = backend.forward(
                q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap
            )
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, row_invariance: RowInvariance) -> None:
        super().__init__()
        rows = row_invariance
        self.self_attn = Attention(cfg, layer, rows)
        if cfg.is_moe(layer):
            self.mlp: nn.Module = SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size or cfg.intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.hidden_act,
                row_invariance=rows,
            )
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                bias=cfg.mlp_bias,
                act=cfg.hidden_act,
                row_invariance=rows,
            )
        eps, offset = cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset, rows)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset, rows)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset, rows)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset, rows)

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
        if self.sandwich:
            h = residual + self.post_attention_layernorm(h)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h))
        return residual + h


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, row_invariance: RowInvariance) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, row_invariance) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset, row_invariance)


class LlamaForCausalLM(nn.Module):
    """Module tree mirrors HF's names except the fused qkv_proj and gate_up_proj, and a MoE
    layer's stacked experts (SparseMoE)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        rope_device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = cfg
        # This model's bf16 batch invariance (gemm_rows.RowInvariance): set around each forward,
        # read by the modules and the attention backend built with it. Per model, never global:
        # a second model in the process (a draft model) has its own. Its GEMM dispatch is set
        # once the weights are packed (model/gemm_calibration.py, by the worker).
        self.row_invariance = RowInvariance(batch_invariant=envs.KVLEDGER_BATCH_INVARIANT)
        self.model = LlamaModel(cfg, self.row_invariance)
        rows = self.row_invariance
        self.lm_head = (
            None
            if cfg.tie_word_embeddings or cfg.head != "lm"
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, row_invariance=rows)
        )
        # transformers' *ForSequenceClassification head: pooled rows -> num_labels logits (the
        # pooling runner applies it to one row per request; a plain matmul, never packed).
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.head == "classify" else None
        # The RoPE tables are computed, not loaded: built on the real device even when the
        # weights are constructed on the meta device.
        positions = max_positions or cfg.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim,
            positions,
            cfg.rope_theta,
            cfg.rope_scaling,
            device=rope_device,
            rotary_dim=cfg.rotary_dim,
            model_max_positions=cfg.max_position_embeddings,
        )
        self.local_rotary_emb = None
        if cfg.local_rope_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(
                cfg.head_dim,
                positions,
                cfg.local_rope_theta,
                cfg.local_rope_scaling,
                device=rope_device,
                model_max_positions=cfg.max_position_embeddings,
            )
        self.attn_backend: AttentionBackend = TorchAttentionBackend(self.row_invariance)
        self.__dict__["tied_head"] = None  # packed copy of a tied LM head, see pack_linears()
        # Tensor parallelism: joins the ranks' vocabulary slices of the logits
        # (kvledger.distributed.sharding); None on one device.
        self.__dict__["vocab_gather"] = None
        # Each layer as one native call where a step allows (fused_layer); made by pack_linears().
        self.__dict__["fused_layers"] = None

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
        cfg = self.config
        h = self.model.embed_tokens(input_ids)
        if cfg.embed_scale is not None:
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        use_native = (
            cfg.head_dim % 16 == 0
            and not cfg.qk_norm
            and (cfg.rotary_dim or cfg.head_dim) == cfg.head_dim
            and native.available(h)
        )
        index = positions
        if self.rotary_emb.long_from is not None:  # LongRoPE: by each request's length
            seq = attn_metadata.rope_seq_lens
            lens = (attn_metadata.seq_lens if seq is None else seq).repeat_interleave(
                torch.diff(attn_metadata.query_start_loc)
            )
            index = self.rotary_emb.table_index(positions, lens)
        rope = RopeStep.make(self.rotary_emb, index, h.dtype, use_native)
        local_rope = None
        if self.local_rotary_emb is not None:
            local_rope = RopeStep.make(self.local_rotary_emb, positions, h.dtype, use_native)
        backend = self.attn_backend
        # Leading single-token queries (the scheduler puts running decodes first).
        lens = attn_metadata.query_lens_list
        decodes = next((i for i, n in enumerate(lens) if n != 1), len(lens))
        per_layer = attn_metadata.per_layer or [attn_metadata] * len(kv_caches)
        with self.row_invariance.leading(decodes):
            fused = self.fused_layers  # every layer in one native call each, where the step allows
            out = None if fused is None else fused.run(h, rope, attn_metadata, kv_caches, backend)
            if out is not None:
                h = out
            else:
                for layer, kv_cache, meta in zip(self.model.layers, kv_caches, per_layer, strict=True):
                    r = local_rope if layer.self_attn.local_rope else rope
                    h = layer(h, r, meta, kv_cache, backend)
        return self.model.norm(h)

    @property
    def head(self) -> Linear | None:
        """The LM head's matmul: lm_head, or a tied head's packed copy (None: unpacked and tied)."""
        return self.lm_head if self.lm_head is not None else self.tied_head

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → float32 logits [N, vocab]; pass only the rows that need logits."""
        head = self.head
        cap = self.config.final_softcap
        if head is not None:
            with self.row_invariance.leading(hidden_states.shape[0]):  # one row per request
                if self.vocab_gather is None and cap is None:
                    return head.forward_float(hidden_states)
                logits = head(hidden_states)
        else:
            logits = F.linear(hidden_states, self.model.embed_tokens.weight)
        if self.vocab_gather is not None:
            logits = self.vocab_gather(logits)
        if cap is not None:  # in the model dtype, as HF
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def quantize_layers(self, method: str) -> None:
        """Store every decoder-layer projection in ``method`` (model/quant_int8.py); the embedding
        and the LM head stay as loaded, as vLLM keeps them."""
        from kvledger.errors import ConfigError
        from kvledger.model.quant_group import GROUP
        from kvledger.model.quant_int8 import check_method

        check_method(method)
        if any(isinstance(m, SparseMoE) for m in self.modules()):
            raise ConfigError(f"quantization {method!r}: mixture-of-experts layers are not supported yet")
        linears = [(name, m) for name, m in self.model.layers.named_modules() if isinstance(m, Linear)]
        # int4 groups run along a row: a projection whose rows are not whole groups stays in the
        # model dtype, as llama.cpp keeps such tensors in a wider type (named in the log).
        kept = [name for name, m in linears if method == "int4" and m.weight.shape[1] % GROUP]
        if kept:
            logging.getLogger("kvledger").info(
                "quantization int4: %d projections keep the model dtype (rows not a multiple of %d "
                "weights): %s", len(kept), GROUP, ", ".join(f"layers.{n}" for n in kept[:4])
                + (" ..." if len(kept) > 4 else ""),
            )  # fmt: skip
        for name, m in linears:
            if name not in kept and m.quant is None:  # a GGUF file's Q8_0 / Q4_0 stay as they are
                m.quantize(method)
        self.tile_group_weights()

    def tile_group_weights(self) -> None:
        """Group-wise weights (on-the-fly int4, GPTQ, AWQ) of a model whose activations are int8
        (quant_q4.int8_activations: bf16 / fp16 models by default) repacked into csrc/q4_gemm.c's
        tiles; run once the weights are loaded (and quantised). A GGUF file's projections are
        read straight into tiles by the loader."""
        from kvledger.model import quant_q4
        from kvledger.model.quant_group import GroupWeight
        from kvledger.storage import host_memory

        if not quant_q4.int8_activations(self.dtype) or self.model.norm.weight.device.type != "cpu":
            return  # (the tiles' kernels are CPU ones)
        for m in self.modules():
            if isinstance(m, Linear) and isinstance(m.quant, GroupWeight) and quant_q4.eligible(m.quant):
                m.set_quantized(quant_q4.pack(m.quant, alloc=host_memory.weight_zeros))

    def pack_linears(self) -> None:
        """Pack every matmul weight for oneDNN and the native kernel (see Linear.pack); a tied
        LM head gets its own packed copies, and the embedding looks tokens up in the head's
        plain weight, or in its native copy once the plain one is dropped (one tensor either way)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None and self.config.head == "lm":
            embed = self.model.embed_tokens.weight
            head = Linear(
                embed.shape[1], embed.shape[0], weight=embed, row_invariance=self.row_invariance
            )
            head.pack()
            emb = self.model.embed_tokens
            if head.weight.is_meta:  # its plain copy dropped (Linear.pack)
                if isinstance(emb, Embedding):  # rows from the native copy; meta for accounting
                    emb.weight, emb.rows_from = head.weight, head.small
                else:  # a tensor-parallel slice reads its plain rows itself: the head keeps them
                    head.weight = emb.weight
            # Not registered as a submodule: the tied weight must not appear twice in state_dict.
            self.__dict__["tied_head"] = head
        self.__dict__["fused_layers"] = FusedLayers.build(self)
