"""KV-cache sizing on a GPU from a profiling run, as vLLM does with gpu_memory_utilization.

The engine may use ``gpu_memory_utilization x total`` bytes of the device in all. After the
weights load, one forward pass of the largest step the scheduler can issue
(max_num_batched_tokens tokens, logits for max_num_seqs rows) runs over a scratch pool; its peak
allocation beyond the weights and the scratch pool is the activation reserve. What is left --
after weights, that reserve, and the memory the CUDA context and libraries took outside torch's
allocator -- is the KV budget. ``kv_cache_budget`` is the arithmetic (tested on CPU);
``profile`` runs the forward (CUDA only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.errors import ConfigError


@dataclass
class MemoryProfile:
    total: int  # device bytes
    free_at_start: int  # free before the engine loaded anything
    weights: int  # torch-allocated bytes after loading (weights, RoPE tables)
    peak_activation: int  # profile forward's peak beyond weights and the scratch pool
    non_torch: int  # growth of memory outside torch's allocator (CUDA context, cuBLAS, Triton)


def kv_cache_budget(p: MemoryProfile, utilization: float) -> int:
    """Bytes for the KV pool: utilization x total less weights, activations and non-torch use."""
    requested = int(p.total * utilization)
    if requested > p.free_at_start:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} asks for {requested / 2**30:.2f} GiB but only "
            f"{p.free_at_start / 2**30:.2f} GiB of the device's {p.total / 2**30:.2f} GiB were free "
            "at start-up (another process holds the rest); lower gpu_memory_utilization"
        )
    budget = requested - p.weights - p.peak_activation - p.non_torch
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: gpu_memory_utilization={utilization} gives "
            f"{requested / 2**30:.2f} GiB, the weights take {p.weights / 2**30:.2f} GiB, activations "
            f"{p.peak_activation / 2**30:.2f} GiB and CUDA/libraries {p.non_torch / 2**30:.2f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


@torch.inference_mode()
def profile(model, facts, config, dev: torch.device, free_at_start: int) -> MemoryProfile:
    """Run the largest step once over a scratch pool and measure (CUDA only). ``facts``: the
    builder's ModelFacts (shape, dtype, max_model_len); ``config``: the EngineConfig."""
    from kvledger.model.attention.metadata import AttentionMetadata
    from kvledger.storage.kv_cache import KVCachePool

    sc, cc = config.scheduler, config.cache
    spec, max_model_len = facts.spec, facts.max_model_len
    total = torch.cuda.mem_get_info(dev)[1]
    torch.cuda.synchronize(dev)
    weights = torch.cuda.memory_allocated(dev)
    # Prompts of max_model_len tokens (the last one shorter) filling max_num_batched_tokens.
    tokens = sc.max_num_batched_tokens
    lens = [min(max_model_len, tokens - i) for i in range(0, tokens, max_model_len)]
    bs = cc.block_size
    per = [-(-n // bs) for n in lens]
    pool = KVCachePool(
        spec.num_layers, sum(per) + 1, bs, spec.num_kv_heads, spec.head_dim, facts.dtype,
        device=dev,
    )  # fmt: skip
    tables = torch.zeros(len(lens), max(per), dtype=torch.int64)
    slots, positions, nxt = [], [], 1
    for i, (n, nb) in enumerate(zip(lens, per)):
        tables[i, :nb] = torch.arange(nxt, nxt + nb)
        nxt += nb
        p = torch.arange(n)
        slots.append(tables[i, p // bs] * bs + p % bs)
        positions.append(p)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(dev),
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(lens).to(dev),
        block_tables=tables.to(dev),
        block_size=bs,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_lens_list=lens,
        seq_lens_list=lens,
    )
    ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    hidden = model(ids, torch.cat(positions).to(dev), meta, pool.layers)
    rows = torch.arange(min(sc.max_num_seqs, tokens), device=dev)
    model.compute_logits(hidden[rows])
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del pool, hidden
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    used = total - free
    non_torch = max(0, used - (total - free_at_start) - torch.cuda.memory_reserved(dev))
    return MemoryProfile(total, free_at_start, weights, peak, non_torch)
