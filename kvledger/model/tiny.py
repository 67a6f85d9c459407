"""``kvledger-tiny``: a Llama with FIXED-SEED RANDOM WEIGHTS, chosen by its name.

The embedded default is the real stories260K (kvledger/model/default); this one stays for
tests and as an explicit choice because its shapes (GQA-2, 4 layers, a 2,048 context) are the
`kvledger-tiny` preset and it carries a chat template. Its text is gibberish by construction;
it exercises the real code path (HF folder layout, safetensors, a real byte-level BPE
tokenizer trained on the paragraph below, a chat template), nothing more.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvledger import envs
from kvledger.ledger.spec import PRESETS

VERSION = "v1"
_SEED = 1234
_CORPUS = (
    "kvledger is an inference engine for large language models. It keeps the key and value "
    "cache in fixed size blocks, shares the blocks of a common prompt prefix between requests, "
    "copies a block only when a request writes into a shared one, and schedules the batch at "
    "every step so that finished requests leave at once and waiting ones take their place. "
    "Every byte of the cache is accounted for in a ledger that users can read while it serves. "
    "Once upon a time there was a little engine that counted its memory carefully. "
) * 4
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def default_model_path() -> Path:
    """Build the model folder once (well under a second) in kvledger's cache directory
    (KVLEDGER_CACHE_DIR, kvledger.envs) and return its path."""
    path = envs.KVLEDGER_CACHE_DIR / f"kvledger-tiny-{VERSION}"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path)
    return path


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def build_tiny_model(path: Path) -> None:
    spec = PRESETS["kvledger-tiny"]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec.vocab_size)
    vocab = spec.vocab_size  # the model's vocab; ids the tokenizer lacks decode to nothing
    inter = spec.intermediate_size or 4 * spec.hidden_size
    h, nh, nkv, hd = spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "vocab_size": vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "_comment": "kvledger-tiny: fixed-seed RANDOM weights, for demos and tests only",
    }
    g = torch.Generator().manual_seed(_SEED)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h)}
    tensors["model.norm.weight"] = torch.ones(h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(nh * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nh * hd),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    from safetensors.torch import save_file

    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id})
    )
    tokenizer.save_pretrained(str(tmp))
    (tmp / "README.md").write_text(__doc__ or "")
    try:
        tmp.rename(path)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
