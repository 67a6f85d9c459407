"""GGUF files (llama.cpp's format) as kvledger models: a path to a ``.gguf`` (or a folder holding
one and no config.json) becomes a small HF-layout folder in the cache (config.json from the file's
metadata, the tokenizer, and ``gguf.json`` naming the file), so everything that reads a model
folder reads it; the weights come from the file itself (``GGUFWeights``).

The front end imports this module before any engine exists: torch is imported only where tensors
are read. Tensor types: F32 / F16 / BF16 load as floats; Q8_0 and Q4_0 layer projections are kept as they
are, in model/quant_group.py's group-wise formats (the same codes and scales, repacked: a Q4_0
block is an fp16 scale and the 16 nibble bytes quant_group already uses). In a model whose
activations are int8 (bf16 / fp16: model/quant_q4.py), the K-quants Q4_K, Q5_K and Q6_K are kept
too, as their exact codes and scales in csrc/q4_gemm.c's tiles (``k_quant``, ``q6_k``). Any
other type gguf-py can dequantise is dequantised to the model dtype at load, logged (its memory
saving is lost). Llama-architecture files store
q/k rows permuted for llama.cpp's RoPE (convert_hf_to_gguf's ``permute``); they are put back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvledger.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvledger")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Bumped when the folder's contents change meaning (2: vocab_size is the embedding's rows; 3: a
# sentencepiece tokenizer prefixes a space as llama.cpp does), so an older kvledger's cached folder
# is not read as this one's.
FOLDER_VERSION = 3
KEPT = ("Q8_0", "Q4_0")  # layer projections held in these formats as they are
# held as they are where the model multiplies int8 activations (model/quant_q4.py's tiles), else
# dequantised; in tiles, the pieces of one fused projection may differ in type (Q4_K_M's qkv)
KEPT_INT8_ACTIVATIONS = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT = ("F32", "F16", "BF16")
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the file itself, or the one .gguf in a folder without
    a config.json; None for anything else."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        files = sorted(p.glob("*.gguf"))
        if len(files) > 1:
            raise ConfigError(f"{p} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): name one")
        return files[0] if files else None
    return None


def open_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors / numpy errors on a bad file
        raise ConfigError(f"{path} is not a readable GGUF file: {e}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def hf_config(reader, path: Path) -> dict[str, Any]:
    """config.json for the model a GGUF file holds, from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{path.name}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ConfigError(f"{path.name}: GGUF metadata lacks {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    heads = int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # The embedding's rows, as HF's vocab_size (a tokenizer may hold fewer tokens than the model's
    # vocabulary, e.g. padded to a multiple for speed); else the metadata's count, else the tokens.
    vocab = int(embd.shape[1]) if embd is not None else len(tokens) if tokens else int(need("vocab_size"))
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "num_hidden_layers": int(need("block_count")),
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)
    for key in ("bos_token_id", "eos_token_id"):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[key] = int(v)
    if arch == "qwen2":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg


def gguf_folder(path: Path, tokenizer: str | None = None) -> Path:
    """The cache folder that stands for a GGUF file (made on first use, keyed by the file's path,
    size and modification time)."""
    from kvledger import envs

    st = path.stat()
    key = hashlib.sha256(f"{FOLDER_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    folder = envs.KVLEDGER_CACHE_DIR / "gguf" / key
    if (folder / "gguf.json").is_file() and (tokenizer or (folder / "tokenizer.json").is_file()):
        return folder
    reader = open_reader(path)
    cfg = hf_config(reader, path)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    (tmp / "gguf.json").write_text(json.dumps({"file": str(path.resolve()), "size": st.st_size}))
    if not tokenizer:
        _write_tokenizer(path, tmp, reader)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _write_tokenizer(path: Path, out: Path, reader=None) -> None:
    """The file's own tokenizer, converted by transformers (its GGUF tokenizer support), with
    llama.cpp's own rule for sentencepiece ("llama") vocabularies: a space is put before the text
    and every space becomes "▁" (transformers' conversion uses Metaspace, which adds none before
    text that starts with a space, so "  hi" would be one "▁" short of what llama.cpp and the
    original Llama tokenizer give)."""
    try:
        from tokenizers import normalizers
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        reader = reader or open_reader(path)
        spm = _field(reader, "tokenizer.ggml.model") == "llama"
        if spm and _field(reader, "tokenizer.ggml.add_space_prefix", True):
            backend = tok.backend_tokenizer
            backend.normalizer = normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            )
            backend.pre_tokenizer = None
        tok.save_pretrained(str(out))
    except Exception as e:
        raise ConfigError(
            f"{path.name}: its tokenizer could not be read ({type(e).__name__}: {e}); pass the "
            "original model's tokenizer folder (tokenizer=... / --tokenizer), as vLLM recommends for GGUF"
        ) from None


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation (per head: interleaved halves -> halves)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class GGUFWeights:
    """A GGUF file's tensors by Hugging Face name: floats (``get``) or, for Q8_0 / Q4_0 layer
    projections, the group-wise codes and scales (``group``)."""

    def __init__(self, folder: Path, hf_cfg: dict[str, Any]) -> None:
        meta = json.loads((folder / "gguf.json").read_text())
        self.path = Path(meta["file"])
        if not self.path.is_file():
            raise ConfigError(f"GGUF file {self.path} (named by {folder}) is gone")
        self.reader = open_reader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.permute = hf_cfg.get("model_type") == "llama"
        self.heads = {"attn_q": hf_cfg["num_attention_heads"], "attn_k": hf_cfg.get("num_key_value_heads") or hf_cfg["num_attention_heads"]}

    def gguf_name(self, hf: str) -> str:
        if hf in _GLOBAL:
            return _GLOBAL[hf]
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?", hf)
        if m:
            i, rest, leaf = m.group(1), m.group(2), m.group(3) or ""
            if rest + leaf in _LAYER:
                return f"blk.{i}.{_LAYER[rest + leaf]}"
            if rest in _LAYER:
                return f"blk.{i}.{_LAYER[rest]}{leaf}"
        return hf

    def __contains__(self, hf: str) -> bool:
        return self.gguf_name(hf) in self.tensors

    def type_of(self, hf: str) -> str:
        return self.tensors[self.gguf_name(hf)].tensor_type.name

    def _rows(self, hf: str, data: np.ndarray) -> np.ndarray:
        name = self.gguf_name(hf)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if self.permute and kind in self.heads and name.endswith(".weight"):
            return unpermute(data, self.heads[kind])
        return data

    def get(self, hf: str) -> torch.Tensor:
        """The tensor as floats, in the HF layout (dequantised where it is quantised)."""
        import gguf
        import torch

        t = self.tensors[self.gguf_name(hf)]
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            arr = np.asarray(t.data, dtype=np.float32)
        elif kind == "BF16":
            arr = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as e:
                raise ConfigError(f"{self.path.name}: tensor {t.name} has type {kind}, which gguf cannot dequantise ({e})") from None
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists the fastest dimension first
        arr = arr.reshape(shape)
        if arr.ndim == 2:
            arr = self._rows(hf, arr)
        return torch.from_numpy(np.array(arr))  # a copy: the file is mapped read-only

    def group(self, hf: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A Q8_0 / Q4_0 projection as (codes, float32 scales [N, K / 32], bits) in quant_group's
        layout, rows in the HF order."""
        import torch

        t = self.tensors[self.gguf_name(hf)]
        kind = t.tensor_type.name
        k, n = (int(d) for d in t.shape)
        raw = np.asarray(t.data, dtype=np.uint8).reshape(n, k // 32, -1)
        scale = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = raw[..., 2:].reshape(n, -1)
        if kind == "Q8_0":
            codes = codes.view(np.int8)
        rows = self._rows(hf, np.concatenate([codes.view(np.uint8), scale.view(np.uint8)], axis=1))
        codes, scale = rows[:, : codes.shape[1]], rows[:, codes.shape[1] :].copy().view(np.float32)
        q = torch.from_numpy(np.ascontiguousarray(codes))
        return (q.view(torch.int8) if kind == "Q8_0" else q), torch.from_numpy(np.ascontiguousarray(scale)), 8 if kind == "Q8_0" else 4

    def _blocks(self, hf: str, size: int) -> tuple[np.ndarray, int, int]:
        t = self.tensors[self.gguf_name(hf)]
        k, n = (int(d) for d in t.shape)
        return np.asarray(t.data, dtype=np.uint8).reshape(n * (k // 256), size), n, k

    def _in_rows(self, hf: str, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        import torch

        return tuple(torch.from_numpy(np.ascontiguousarray(self._rows(hf, a))) for a in arrays)

    def k_quant(self, hf: str) -> tuple[torch.Tensor, ...]:
        """A Q4_K or Q5_K projection as (codes uint8 [N, K]: 0..15, or 0..31; 6-bit sc and m uint8
        [N, K / 32]; fp16 d and dmin [N, K / 256]), rows in the HF order: its weights are code x
        (d x sc) - dmin x m, as llama.cpp's dequantisation computes them in float32."""
        import gguf

        five = self.type_of(hf) == "Q5_K"
        raw, n, k = self._blocks(hf, 176 if five else 144)
        d = raw[:, 0:2].copy().view(np.float16).reshape(n, k // 256)
        dmin = raw[:, 2:4].copy().view(np.float16).reshape(n, k // 256)
        sc, m = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16].copy())
        # 4 chunks of 64 weights: 32 low nibbles, then 32 high ones (Q5_K: a fifth bit each from qh)
        qs = raw[:, 48:] if five else raw[:, 16:]
        codes = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        if five:
            shift = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)  # chunk j, half s: bit 2j + s
            codes = codes | (((raw[:, 16:48].reshape(-1, 1, 1, 32) >> shift) & np.uint8(1)) << np.uint8(4))
        sc, m = (a.astype(np.uint8).reshape(n, k // 32) for a in (sc, m))
        return self._in_rows(hf, codes.reshape(n, k), sc, m, d, dmin)

    def q6_k(self, hf: str) -> tuple[torch.Tensor, ...]:
        """A Q6_K projection as (codes uint8 [N, K] 0..63, int8 scales [N, K / 16], fp16 d
        [N, K / 256]), rows in the HF order: its weights are (code - 32) x d x scale."""
        raw, n, k = self._blocks(hf, 210)
        ql, qh = raw[:, :128].reshape(-1, 2, 64), raw[:, 128:192].reshape(-1, 2, 32)
        # per 128 weights: 32 low nibbles of ql[0:32], of ql[32:64], then their high nibbles; the
        # two high bits of each from qh, shifted 0, 2, 4, 6
        lo = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=2)
        hi = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        codes = (lo | (hi << np.uint8(4))).reshape(n, k)
        sub = raw[:, 192:208].copy().view(np.int8).reshape(n, k // 16)
        d = raw[:, 208:210].copy().view(np.float16).reshape(n, k // 256)
        return self._in_rows(hf, codes, sub, d)

    def close(self) -> None:
        self.reader = None
