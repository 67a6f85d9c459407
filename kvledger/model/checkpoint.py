"""A checkpoint's tensors by Hugging Face name, whatever the files: safetensors or
pytorch_model.bin, single or sharded; FP8 weights come back dequantised with their scales.

A ``quantization_config`` kvledger cannot run (GPTQ, AWQ, bitsandbytes, compressed-tensors, ...)
is refused by its method's name: loading such tensors as if they were plain gives a model that
runs and talks nonsense.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvledger.errors import ConfigError
from kvledger.hf.config import quantization_block_size, quantization_method

_FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n)
)


def _read_index(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text()).get("weight_map") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a valid weight index: {e}") from None


class CheckpointReader:
    """Tensors of a model folder by name. Safetensors are memory-mapped (``get`` returns a view
    of the file when no conversion is needed); .bin files are loaded with ``weights_only`` and
    memory-mapped where torch can."""

    def __init__(self, path: Path, hf_config: dict[str, Any] | None = None) -> None:
        self.path = path
        self.files = self._weight_files(path)
        cfg = hf_config or {}
        self.quantization = quantization_method(cfg)
        self.block_size: list[int] | None = quantization_block_size(cfg)
        self._open: dict[Path, Any] = {}

    @staticmethod
    def _weight_files(path: Path) -> dict[str, Path]:
        single = path / "model.safetensors"
        if single.is_file():
            return dict.fromkeys(_open_safetensors(single).keys(), single)
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = path / index_name
            if index.is_file():
                files = {name: path / shard for name, shard in _read_index(index).items()}
                for shard in set(files.values()):
                    if not shard.is_file():
                        raise ConfigError(f"missing weight shard {shard.name} in model folder {path}")
                return files
        single_bin = path / "pytorch_model.bin"
        if single_bin.is_file():
            return dict.fromkeys(_load_bin(single_bin), single_bin)
        raise ConfigError(
            f"no weights in model folder {path}: expected model.safetensors, "
            "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json"
        )

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def file_of(self, name: str) -> Path:
        return self.files[name]

    def _raw(self, name: str) -> torch.Tensor:
        file = self.files[name]
        handle = self._open.get(file)
        if handle is None:
            if file.suffix == ".safetensors":
                handle = _open_safetensors(file)
            else:
                handle = _load_bin(file)
            self._open[file] = handle
        if isinstance(handle, dict):
            if name not in handle:
                raise ConfigError(f"weight {name} is not in {file.name}")
            return handle[name]
        try:
            return handle.get_tensor(name)
        except Exception as e:  # a shard whose header lists the name but whose bytes are damaged
            raise ConfigError(f"{file}: cannot read weight {name}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        """The tensor, FP8 weights multiplied out by their scale (per tensor, per output
        channel, or per block with ``weight_block_size``) into float32."""
        t = self._raw(name)
        if t.dtype not in _FP8_DTYPES:
            return t
        if self.quantization is None:
            raise ConfigError(
                f"weight {name} is stored as {t.dtype} but config.json has no quantization_config"
            )
        return self._dequantise(name, t)

    def _dequantise(self, name: str, t: torch.Tensor) -> torch.Tensor:
        stem = name.removesuffix("weight")
        w = t.to(torch.float32)
        if stem + "weight_scale_inv" in self.files and self.block_size:  # block-wise scales
            s = self._raw(stem + "weight_scale_inv").to(torch.float32)
            bo, bi = self.block_size
            s = s.repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
            return w * s
        if stem + "weight_scale" not in self.files:
            raise ConfigError(f"FP8 weight {name} has no {stem}weight_scale in the checkpoint")
        s = self._raw(stem + "weight_scale").to(torch.float32)
        if s.numel() == 1:
            return w * s.reshape(())
        if s.numel() == w.shape[0]:
            return w * s.reshape(-1, *([1] * (w.dim() - 1)))
        raise ConfigError(
            f"{stem}weight_scale has shape {tuple(s.shape)}: neither per tensor nor per output "
            f"channel of a weight of shape {tuple(w.shape)}"
        )

    def close(self) -> None:
        self._open.clear()


def _open_safetensors(file: Path) -> Any:
    """A memory-mapped safetensors file; a truncated, empty or foreign file is a one-line error
    naming it (the library's own error says neither which file nor what to do)."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:
        raise ConfigError(
            f"{file} is not a readable safetensors file (truncated or damaged? download it again): {e}"
        ) from None


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin state dict, tensors only (``weights_only``: no code runs)."""
    try:
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # an old (non-zip) file cannot be memory-mapped
            sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"cannot read {file}: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(f"{file} is not a state dict of tensors")
    return sd
