"""A GPTQ 4-bit checkpoint written from an HF float folder, in the layout AutoGPTQ saves (its
default ``sym=True``, ``desc_act=False``; ``checkpoint_format: gptq``, zeros stored minus one).

Why here: issue 42's 4-bit decode is measured on the format 4-bit checkpoints come in for vLLM
(GPTQ / AWQ, groups of 128 columns) as well as on kvledger's on-the-fly ``int4`` (groups of 32),
and neither AutoGPTQ nor a published checkpoint of the benchmark's random model is at hand. The
codes are round-to-nearest (no Hessian-based error correction: GPTQ's algorithm changes which codes
are chosen, not the format or the bytes a decode step streams):

- per group of ``group`` input columns and output row, scale = 2 max|w| / 15 (fp16), zero 8,
  code = round(w / scale) + 8 clamped to 0..15;
- ``qweight`` int32 [K / 8, N] (eight codes along K a word, low bits first), ``qzeros`` int32
  [K / group, N / 8] (eight zeros along N a word, each minus one), ``scales`` fp16 [K / group, N],
  ``g_idx`` int32 [K].

    python -m benchmarks.gptq_checkpoint SRC_DIR DST_DIR [--group 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.w8a8_checkpoint import ensure_checkpoint, rewrite_projections


def pack_k(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight: [K, N] codes 0..15 as int32 [K / 8, N], eight along K a word, low bits first."""
    k, n = codes.shape
    c = codes.to(torch.int32).reshape(k // 8, 8, n)
    return sum(c[:, j] << (4 * j) for j in range(8)).to(torch.int32)


def pack_n(codes: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, N] codes as int32 [R, N / 8], eight along N a word (nibble i holds column order[i] of its
    eight: AWQ's 0 2 4 6 1 3 5 7; GPTQ's qzeros in order)."""
    r, n = codes.shape
    c = codes.to(torch.int32).reshape(r, n // 8, 8)
    order = order or list(range(8))
    return sum(c[:, :, order[i]] << (4 * i) for i in range(8)).to(torch.int32)


def rtn_sym(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit per group of input columns: (codes [K, N] 0..15, scales fp16 [K / group, N])."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scale = (2 * g.abs().amax(dim=-1) / 15).clamp(min=1e-8).half()
    codes = (torch.round(g / scale.float()[..., None]) + 8).clamp(0, 15).to(torch.int32)
    return codes.reshape(n, k).T.contiguous(), scale.T.contiguous()


def gptq_quantization_config(group: int) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}  # fmt: skip


def write_gptq_checkpoint(src: str | Path, dst: str | Path, group: int = 128) -> Path:
    """Copy the HF folder ``src`` to ``dst`` with its projections in GPTQ 4-bit (module docstring)."""

    def convert(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        if k % group or n % 8:
            raise SystemExit(f"{name}: [{n}, {k}] is not whole groups of {group} columns and words of 8 rows")
        codes, scales = rtn_sym(w, group)
        stem = name.removesuffix(".weight")
        return {
            f"{stem}.qweight": pack_k(codes),
            f"{stem}.qzeros": pack_n(torch.full((k // group, n), 8 - 1, dtype=torch.int32)),
            f"{stem}.scales": scales,
            f"{stem}.g_idx": (torch.arange(k) // group).to(torch.int32),
        }

    return rewrite_projections(src, dst, convert, gptq_quantization_config(group))


def ensure_gptq_checkpoint(src: str | Path, group: int = 128) -> Path:
    """``SRC-gptq<group>`` beside the float folder ``src`` (w8a8_checkpoint.ensure_checkpoint)."""
    return ensure_checkpoint(src, f"gptq{group}", lambda s, d: write_gptq_checkpoint(s, d, group))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a GPTQ 4-bit checkpoint (round-to-nearest codes)")
    ap.add_argument("src", help="HF float folder")
    ap.add_argument("dst", help="new folder")
    ap.add_argument("--group", type=int, default=128, help="input columns a scale (default 128)")
    a = ap.parse_args(argv)
    print(write_gptq_checkpoint(a.src, a.dst, a.group))


if __name__ == "__main__":
    main()
