"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks top-k experts
per token, and the experts run as two batched GEMMs over the experts the step hit.

Tokens are sorted by expert and laid out as [experts hit, most tokens per expert, hidden]
(padding rows are zeros), so each GEMM is one torch.bmm whatever the number of experts,
instead of a Python loop with one small matmul per expert (HF's way). Decode steps hit only
top_k experts per token; only those experts' weights take part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvledger.kernels.gemm_rows import RowInvariance
from kvledger.model.layers import Linear, activation


class SparseMoE(nn.Module):
    """Expert weights are stored stacked and flat (rows of all experts one after the other), so
    the loader fills them like any fused matmul weight: w_gate_up [E * 2I, H] holds each expert's
    [gate; up] rows, w_down [E * H, I] each expert's down projection."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        normalize_top_k: bool,
        act: str = "silu",
        row_invariance: RowInvariance | None = None,
    ) -> None:
        """``row_invariance``: the owning model's, for the router's matmul."""
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.act = activation(act)
        self.gate = Linear(hidden_size, num_experts, row_invariance=row_invariance)  # the router
        self.w_gate_up = nn.Parameter(
            torch.empty(num_experts * 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w_down = nn.Parameter(
            torch.empty(num_experts * hidden_size, intermediate_size), requires_grad=False
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as HF's top-k router computes them:
        softmax in float32, top k, optionally renormalised to sum to one."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden = x.shape
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [T * k]: pair p is token p // k
        order = torch.argsort(flat, stable=True)
        sorted_experts = flat.index_select(0, order)
        counts = torch.bincount(flat, minlength=self.num_experts)
        hit = counts.nonzero().squeeze(1)
        width = int(counts.max())
        # Each pair's row within its expert's group, and its expert's index among those hit.
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(flat.numel(), device=x.device) - starts.index_select(0, sorted_experts)
        compact = torch.full((self.num_experts,), -1, dtype=torch.int64, device=x.device)
        compact[hit] = torch.arange(hit.numel(), device=x.device)
        group = compact.index_select(0, sorted_experts)
        tokens = order // self.top_k

        inter = self.intermediate_size
        w_gate_up = self.w_gate_up.view(self.num_experts, 2 * inter, hidden)
        w_down = self.w_down.view(self.num_experts, hidden, inter)
        if 2 * hit.numel() <= self.num_experts:
            # Few experts hit (a small decode batch): gather their weights. Otherwise run every
            # expert (idle ones on zero rows): reading all weights once costs less than copying most.
            w_gate_up = w_gate_up.index_select(0, hit)
            w_down = w_down.index_select(0, hit)
            xin = x.new_zeros(hit.numel(), width, hidden)
        else:
            group = sorted_experts
            xin = x.new_zeros(self.num_experts, width, hidden)
        xin[group, slot] = x.index_select(0, tokens)
        gate_up = torch.bmm(xin, w_gate_up.transpose(1, 2))  # [experts, width, 2I]
        h = self.act(gate_up[..., :inter]) * gate_up[..., inter:]
        y = torch.bmm(h, w_down.transpose(1, 2))  # [experts, width, H]
        # Back to (token, k) order, weighted, and summed over each token's k experts.
        pair_out = y.new_empty(flat.numel(), hidden)
        pair_out[order] = y[group, slot]
        pair_out = pair_out.view(num_tokens, self.top_k, hidden) * weights[..., None]
        return pair_out.sum(dim=1)
