"""Megatron-style sharding of a loaded model for one tensor-parallel rank.

Each rank keeps 1/N of the attention heads and of the MLP's intermediate width:

- ``qkv_proj`` is column-parallel: the rank's q heads and their KV heads (KV heads split
  while N <= num_kv_heads; beyond that each KV head is replicated on N / num_kv_heads ranks,
  as vLLM does, and each rank's pool holds its one head);
- ``o_proj`` and ``down_proj`` are row-parallel: their partial sums are all-reduced
  (``RowParallelLinear``; the bias is added once, by rank 0);
- ``gate_up_proj`` is column-parallel (the rank's gate rows and up rows);
- a mixture-of-experts MLP (Mixtral, Qwen3-MoE) is split the same way inside every expert, as
  vLLM does without expert parallelism: each expert's gate and up rows column-parallel (1/N of
  the expert's intermediate width), its down projection row-parallel, the router replicated
  (every rank routes every token to the same experts, on the same all-reduced input), and one
  all-reduce after the weighted sum over the experts (``ParallelSparseMoE``);
- the embedding is vocabulary-parallel (each rank looks up its slice of rows, zero elsewhere,
  then all-reduce) and so is the LM head (each rank computes its slice of the logits, then
  all-gather); a vocabulary that N does not divide is padded with zero rows on the last rank.

Sharding happens after the weights load and before ``pack_linears``, so the native kernels
and the oneDNN packing see each rank's own (smaller) matrices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.distributed.parallel_state import all_gather_last, all_reduce, all_reduce_max
from kvledger.errors import ConfigError
from kvledger.hf.config import ModelConfig
from kvledger.kernels.gemm_rows import RowInvariance
from kvledger.ledger.spec import ModelSpec
from kvledger.model import quant_int8
from kvledger.model.layers import GatedMLP, Linear
from kvledger.model.llama import LlamaForCausalLM
from kvledger.model.moe import SparseMoE
from kvledger.model.quant_int8 import Int8Weight
from kvledger.storage import host_memory


def check_tensor_parallel(spec: ModelSpec, tp: int, intermediate_size: int | None = None,
                          moe_intermediate_size: int | None = None) -> None:
    """Refuse a degree the model cannot be split by, with the reason (before anything starts).

    ``intermediate_size``: the dense MLP's width (None: no dense layer); ``moe_intermediate_size``:
    each expert's width (None: no mixture-of-experts layer)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    h, k = spec.num_attention_heads, spec.num_kv_heads
    if h % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide {spec.name}'s {h} attention heads"
        )
    if (tp <= k and k % tp) or (tp > k and tp % k):
        raise ConfigError(
            f"tensor_parallel_size={tp} cannot split {spec.name}'s {k} KV heads: it must divide "
            f"them, or be a multiple of them (each KV head then replicated on {tp}/{k} ranks)"
        )
    if intermediate_size is not None and intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide {spec.name}'s MLP width {intermediate_size}"
        )
    if moe_intermediate_size is not None and moe_intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide {spec.name}'s expert MLP width "
            f"{moe_intermediate_size} (each expert's gate/up/down are split over the ranks)"
        )


def tp_mlp_widths(cfg: ModelConfig) -> tuple[int | None, int | None]:
    """(dense MLP width, expert width) that tensor parallelism splits; None where no layer has
    that kind of MLP (a Mixtral has no dense layer, a Qwen3-MoE may have some)."""
    layers = range(cfg.num_layers)
    dense = cfg.intermediate_size if any(not cfg.is_moe(i) for i in layers) else None
    moe = None
    if any(cfg.is_moe(i) for i in layers):
        moe = cfg.moe_intermediate_size or cfg.intermediate_size
    return dense, moe


def kv_head_range(rank: int, num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(first KV head, count) that ``rank`` holds."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return rank * per, per
    return rank // (tp // num_kv_heads), 1


class RowParallelLinear(Linear):
    """x_r W_r^T summed over ranks: the input is already split by columns (heads, MLP width).

    W8A8 (``quantization="int8"``) scales whole rows: each rank's slice of a weight row, and of
    an activation row, is quantised with the whole row's absolute max (one all-reduce MAX), so
    the codes are one process's and the int32 sums of the ranks add up to its sums. (W4A8's
    groups of 32 fall inside a rank's columns, checked when quantising, so they need nothing.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quant, Int8Weight):
            return all_reduce(quant_int8.int8_linear(x, self.quant, self.bias, row_amax=_row_amax))
        return all_reduce(super().forward(x))

    def quantize(self, method: str) -> None:
        if method != "int8":
            return super().quantize(method)
        amax = _row_amax(self.weight.data)
        self.set_quantized(quant_int8.quantize_weight(self.weight.data, alloc=host_memory.weight_zeros, amax=amax))


def _row_amax(x: torch.Tensor) -> torch.Tensor:
    """Each row's absolute max over every rank's columns of it."""
    return all_reduce_max(x.float().abs().amax(dim=-1))


class ParallelSparseMoE(SparseMoE):
    """A rank's slice of every expert (see ``shard_moe``): its output is a partial sum over the
    experts' intermediate width, completed by one all-reduce after the sum over the experts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on this rank; other tokens look up zeros, and the
    all-reduce adds the one rank that holds each token's row."""

    def __init__(self, weight: torch.Tensor, start: int, end: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end = start, end

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class _GatherVocab:
    """Concatenates the ranks' logit slices and drops the padding rows' columns."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return all_gather_last(logits)[:, : self.vocab_size]


def _own(t: torch.Tensor) -> nn.Parameter:
    """A contiguous copy (not a view of the checkpoint's memory map, nor of the full weight)."""
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _linear(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: RowInvariance, cls: type[Linear] = Linear
) -> Linear:
    """A rank's slice of a projection; it shares the model's RowInvariance, as the one it replaces."""
    out = cls(
        weight.shape[1], weight.shape[0], bias=False, weight=_own(weight), row_invariance=rows
    )
    if bias is not None:
        out.bias = _own(bias)
    return out


def _rows(t: torch.Tensor, start: int, n: int, padded: int) -> torch.Tensor:
    """Rows [start, start + n) of t, zero-padded to ``padded`` rows."""
    part = t[start : start + n]
    if n == padded:
        return part
    pad = torch.zeros((padded - n, *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([part, pad])


def shard_moe(moe: SparseMoE, rank: int, tp: int) -> None:
    """Columns [rank * I/N, (rank + 1) * I/N) of every expert's intermediate width: its gate and
    up rows (column-parallel) and the matching columns of its down projection (row-parallel).
    The router (``gate``) is kept whole on every rank."""
    E, H, n = moe.num_experts, moe.hidden_size, moe.intermediate_size
    i = n // tp
    mine = slice(rank * i, (rank + 1) * i)
    gu = moe.w_gate_up.view(E, 2 * n, H)
    gate_up = torch.cat([gu[:, :n][:, mine], gu[:, n:][:, mine]], dim=1)  # [E, 2 i, H]
    moe.w_gate_up = _own(gate_up.reshape(E * 2 * i, H))
    down = moe.w_down.view(E, H, n)[:, :, mine]  # [E, H, i]
    moe.w_down = _own(down.reshape(E * H, i))
    moe.intermediate_size = i
    moe.__class__ = ParallelSparseMoE  # same state, plus the all-reduce after the expert sum


def shard_model(model: LlamaForCausalLM, rank: int, tp: int) -> None:
    """Cut the (unpacked) model down to rank ``rank``'s share, in place."""
    cfg: ModelConfig = model.config
    rows = model.row_invariance
    for layer in model.model.layers:
        a = layer.self_attn
        H, K, D = a.num_heads, a.num_kv_heads, a.head_dim
        h = H // tp
        k0, kn = kv_head_range(rank, K, tp)
        q_rows = slice(rank * h * D, (rank + 1) * h * D)
        k_rows = slice(H * D + k0 * D, H * D + (k0 + kn) * D)
        v_rows = slice((H + K) * D + k0 * D, (H + K) * D + (k0 + kn) * D)

        def pick(t: torch.Tensor, q_rows=q_rows, k_rows=k_rows, v_rows=v_rows) -> torch.Tensor:
            return torch.cat([t[q_rows], t[k_rows], t[v_rows]])

        qkv = a.qkv_proj
        a.qkv_proj = _linear(pick(qkv.weight), None if qkv.bias is None else pick(qkv.bias), rows)
        o = a.o_proj
        a.o_proj = _linear(o.weight[:, q_rows], o.bias if rank == 0 else None, rows, RowParallelLinear)
        a.num_heads, a.num_kv_heads = h, kn
        a.q_size, a.kv_size = h * D, kn * D
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            shard_moe(mlp, rank, tp)
            continue
        if not isinstance(mlp, GatedMLP):
            raise ConfigError(f"tensor parallelism cannot split a {type(mlp).__name__} MLP")
        n = mlp.intermediate_size
        i = n // tp
        mine = slice(rank * i, (rank + 1) * i)
        gu = mlp.gate_up_proj
        gate_up = torch.cat([gu.weight[mine], gu.weight[n:][mine]])
        gu_bias = None if gu.bias is None else torch.cat([gu.bias[mine], gu.bias[n:][mine]])
        mlp.gate_up_proj = _linear(gate_up, gu_bias, rows)
        d = mlp.down_proj
        mlp.down_proj = _linear(d.weight[:, mine], d.bias if rank == 0 else None, rows, RowParallelLinear)
        mlp.intermediate_size = i

    vocab = cfg.vocab_size
    per = -(-vocab // tp)
    start = min(rank * per, vocab)
    n = max(0, min(vocab, start + per) - start)
    embed = model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(
        _rows(embed, start, n, per).contiguous().clone(), start, start + n
    )
    if model.lm_head is not None:
        model.lm_head = _linear(_rows(model.lm_head.weight, start, n, per), None, rows)
    model.__dict__["vocab_gather"] = _GatherVocab(vocab)
