"""Tiny random-weight HF model folders and a minimal paged-cache driver for model tests.

The driver stands in for the engine: a shuffled free list of physical blocks (so block tables
are never contiguous), per-request block tables, and AttentionMetadata built by hand, so the
model can be tested without the real block manager.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.loader import LoadedModel
from kvledger.storage.kv_cache import KVCachePool

_COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def tiny_config(kind: str) -> PretrainedConfig:
    """Small configs covering each supported architecture and attention layout."""
    if kind == "llama_mha":
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4)
    if kind == "llama_gqa":
        return LlamaConfig(
            **{**_COMMON, "tie_word_embeddings": True},
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
        )
    if kind == "llama_mqa":
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=1)
    if kind == "llama3_rope":
        return LlamaConfig(
            **_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 48,
            },
            rope_theta=500000.0,
        )
    if kind == "qwen2":
        return Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if kind == "mistral":
        return MistralConfig(
            **_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=4096
        )
    if kind == "mistral_window":  # every layer sliding, a window a few blocks long
        return MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=9)
    if kind in ("llama_linear", "llama_dynamic", "llama_yarn"):
        rope = {"rope_type": kind.removeprefix("llama_"), "factor": 4.0, "rope_theta": 10000.0}
        if kind == "llama_yarn":
            rope |= {"original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2}
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    if kind == "gemma2":  # alternating sliding/full layers, both soft-caps, query scalar != head_dim
        return Gemma2Config(
            **{**_COMMON, "tie_word_embeddings": True, "num_hidden_layers": 3},
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=7,
            query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
            pad_token_id=0,
        )
    if kind == "gemma3":  # two local layers per global one, local/global RoPE bases, linear scaling
        return Gemma3TextConfig(
            **{**_COMMON, "tie_word_embeddings": True, "num_hidden_layers": 3},
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
            query_pre_attn_scalar=24, final_logit_softcapping=8.0, pad_token_id=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    if kind == "phi3":  # LongRoPE with a partial rotary (Phi-4-mini style)
        rd = 4  # head_dim 8, half of it rotated
        return Phi3Config(
            **{**_COMMON, "max_position_embeddings": 256},
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
            original_max_position_embeddings=48,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 256 / 48,
                "short_factor": [1.0 + 0.1 * i for i in range(rd // 2)],
                "long_factor": [2.0 + 0.5 * i for i in range(rd // 2)],
                "original_max_position_embeddings": 48,
            },
        )
    if kind == "mixtral":
        return MixtralConfig(
            **_COMMON, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2,
        )
    if kind == "qwen3_moe":  # a dense layer after a sparse one, no top-k renormalisation
        return Qwen3MoeConfig(
            **_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=5,
            num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
            mlp_only_layers=[1],
        )
    raise ValueError(kind)


def build_hf_model(
    config: PretrainedConfig,
    folder: Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    auto: type = AutoModelForCausalLM,
):
    """Random-weight HF model saved as safetensors in folder; returns the HF model (eval mode).
    ``auto``: AutoModelForSequenceClassification (a ``score`` head) or AutoModel (no head).

    Weights get a larger spread than HF's init (std 0.02) so logits are far from ties and the
    greedy comparison actually exercises the numerics.
    """
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def build_hf_classifier(config: PretrainedConfig, folder: Path, num_labels: int, seed: int = 0, **config_extra):
    """A random-weight *ForSequenceClassification folder (transformers' ``score`` head)."""
    config.num_labels = num_labels
    for k, v in config_extra.items():
        setattr(config, k, v)
    return build_hf_model(config, folder, seed=seed, auto=AutoModelForSequenceClassification)


def build_stories_cross_encoder(folder: Path, stories: Path, seed: int = 0):
    """A one-label LlamaForSequenceClassification (a cross-encoder reranker) over stories260k's
    512-token vocabulary, with its real tokenizer files copied in."""
    import shutil

    cfg = LlamaConfig(**{**_COMMON, "vocab_size": 512}, num_attention_heads=4, num_key_value_heads=2)
    hf = build_hf_classifier(cfg, folder, num_labels=1, seed=seed)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories / f, folder / f)
    return hf


def build_hf_bare_decoder(config: PretrainedConfig, folder: Path, seed: int = 0):
    """A random-weight bare decoder (``LlamaModel``, ``Qwen3Model``), saved without a head and
    without the ``model.`` prefix, as embedders often are."""
    return build_hf_model(config, folder, seed=seed, auto=AutoModel)


@dataclass
class PagedDriver:
    """Runs a LoadedModel over a paged cache like the engine would, with a toy block allocator."""

    loaded: LoadedModel
    block_size: int = 4
    num_blocks: int = 128
    seed: int = 0
    pool: KVCachePool = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[str, list[int]] = field(default_factory=dict)
    lens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.loaded.config
        self.pool = KVCachePool(
            num_layers=cfg.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.loaded.dtype,
        )
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def step(self, batch: list[tuple[str, list[int]]]) -> torch.Tensor:
        """One forward over [(request_id, new token ids), ...]; returns logits of every new token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for rid, ids in batch:
            table = self.tables.setdefault(rid, [])
            start = self.lens.get(rid, 0)
            end = start + len(ids)
            while len(table) * bs < end:
                table.append(self.free.pop())
            for p in range(start, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            input_ids.extend(ids)
            query_lens.append(len(ids))
            seq_lens.append(end)
            self.lens[rid] = end
        tables = [self.tables[rid] for rid, _ in batch]
        width = max(len(t) for t in tables)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        model = self.loaded.model
        hidden = model(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            self.pool.layers,
        )
        return model.compute_logits(hidden)

    def free_request(self, rid: str) -> None:
        self.free.extend(reversed(self.tables.pop(rid)))
        self.lens.pop(rid)

    def greedy(
        self,
        rid: str,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: tuple[int, ...] = (),
        chunk: int | None = None,
    ) -> list[int]:
        """Greedy continuation through the paged cache (prefill in chunks of `chunk` tokens)."""
        chunk = chunk or len(prompt)
        for i in range(0, len(prompt), chunk):
            logits = self.step([(rid, prompt[i : i + chunk])])
        out: list[int] = []
        while True:
            tok = int(logits[-1].argmax())
            out.append(tok)
            if len(out) >= max_new_tokens or tok in stop_ids:
                return out
            logits = self.step([(rid, [tok])])

