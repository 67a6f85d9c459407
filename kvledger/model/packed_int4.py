"""GPTQ and AWQ 4-bit checkpoints (``quantization_config.quant_method`` "gptq" / "awq", the
formats AutoGPTQ / GPTQModel / AutoAWQ / llm-compressor write and vLLM's CPU backend loads), read
into model/quant_group.py's group-wise weights: w[n, k] = (q[k, n] - zero[g(k), n]) x scale[g(k), n].

- GPTQ: ``qweight`` int32 [K / 8, N] (eight codes along K per word, low bits first), ``qzeros``
  int32 [K / group, N / 8] (stored minus one in the original "gptq" checkpoint format, as is in
  "gptq_v2"), ``scales`` fp16 [K / group, N], ``g_idx`` int32 [K] (with ``desc_act`` the groups
  are not contiguous in K: the columns are put in group order and the activations gathered the
  same way at each product, as vLLM's kernels do).
- AWQ ("gemm" version): ``qweight`` int32 [K, N / 8] and ``qzeros`` [K / group, N / 8], eight
  codes along N per word in the order 0 2 4 6 1 3 5 7; ``scales`` fp16 [K / group, N].

Groups of 64 or 128 are held as 2 or 4 groups of 32 sharing a scale and zero (the kernels' group).
"""

from __future__ import annotations

from typing import Any

import torch

from kvledger.errors import ConfigError
from kvledger.model.quant_group import GROUP, GroupWeight, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _along_k(words: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 words of eight 4-bit codes (low bits first) -> [R * 8, C]."""
    r, c = words.shape
    return ((words[:, None, :] >> _SHIFTS[None, :, None]) & 0xF).reshape(r * 8, c)


def _along_n(words: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] int32 words of eight codes along the columns -> [R, C * 8]; ``order``: the column
    each nibble holds within its eight (AWQ), else nibble i is column i."""
    r, c = words.shape
    vals = (words[:, :, None] >> _SHIFTS[None, None, :]) & 0xF  # [R, C, nibble]
    if order is not None:
        vals = vals[:, :, torch.tensor(order).argsort()]
    return vals.reshape(r, c * 8)


def to_group_weight(method: str, q: dict[str, Any], t: dict[str, torch.Tensor]) -> GroupWeight:
    """One projection's packed tensors (``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``)
    as a GroupWeight."""
    if method == "gptq":
        codes = _along_k(t["qweight"].to(torch.int32))  # [K, N]
        zeros = _along_n(t["qzeros"].to(torch.int32))  # [groups, N]
        if q.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1
    else:
        codes = _along_n(t["qweight"].to(torch.int32), AWQ_ORDER)
        zeros = _along_n(t["qzeros"].to(torch.int32), AWQ_ORDER)
    k, n = codes.shape
    scales = t["scales"].to(torch.float32)
    if scales.shape[1] != n or zeros.shape[1] < n:
        raise ConfigError(f"{method}: scales {tuple(scales.shape)} / qzeros do not match qweight's {n} outputs")
    zeros = zeros[:, :n]
    group = q.get("group_size", 128)
    group = k if group == -1 else group
    if k % GROUP or k % group:
        raise ConfigError(f"{method}: {k} inputs are not whole groups of {group} (and of {GROUP})")
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // group
    g_idx = g_idx.to(torch.int64)
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act order: put each group's columns together
        perm = torch.argsort(g_idx, stable=True)
        codes, g_idx = codes[perm], g_idx[perm]
    blocks = g_idx[::GROUP]  # the group of each run of 32 columns
    if not torch.equal(g_idx.reshape(-1, GROUP), blocks[:, None].expand(-1, GROUP)):
        raise ConfigError(f"{method}: g_idx does not give whole groups of {GROUP} columns")
    return GroupWeight(
        q=pack_nibbles(codes.T.contiguous() - 8),
        scale=scales[blocks].T.contiguous(),
        bits=4,
        zero=zeros[blocks].T.to(torch.uint8).contiguous(),
        perm=perm,
    )


def concat_rows(parts: list[GroupWeight]) -> GroupWeight:
    """A fused projection (q/k/v, gate/up) from its pieces, stacked along the outputs."""
    perms = [p.perm for p in parts]
    if any((a is None) != (perms[0] is None) or (a is not None and not torch.equal(a, perms[0])) for a in perms):
        raise ConfigError("fused projections whose pieces have different act orders (g_idx) are not supported")
    return GroupWeight(
        torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), 4,
        torch.cat([p.zero for p in parts]), perms[0],
    )  # fmt: skip
