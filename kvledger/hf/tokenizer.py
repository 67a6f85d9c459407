"""Loading a model folder's tokenizer (never downloaded), for every process that tokenizes: the
engine (its detokenizer, stop strings, chat), a server's front end and the router.

It imports no kvledger model code, so a front end that runs no model loads only the tokenizer.
Transformers itself (5.x) imports torch when its tokenizer classes load (``configuration_utils``
-> ``modeling_rope_utils``), so a process that loads a tokenizer has torch in it even so; only
the import of these modules is free of it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvledger.errors import ConfigError

logger = logging.getLogger("kvledger")

BPE_CACHE_WHOLE_TEXT = 1_000
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def load_tokenizer(path: str | Path):
    """The folder's own tokenizer (tokenizer.json etc.), never downloaded."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers and tokenizers raise many types for a damaged file
        _check_json_files(Path(path))  # only on failure: a good start parses tokenizer.json once
        raise ConfigError(f"cannot load the tokenizer from {path}: {e}") from None
    bound_bpe_cache(tok)
    return tok


def _check_json_files(folder: Path) -> None:
    """After a failed load: a damaged tokenizer JSON file is named in the error (transformers'
    own message does not say which of the folder's files it was reading)."""
    if not folder.is_dir():
        return
    for name in _TOKENIZER_JSON:
        f = folder / name
        if not f.is_file():
            continue
        try:
            json.loads(f.read_bytes())
        except (UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{f} is not valid JSON: {e}") from None


def maybe_tokenizer(path: str | Path):
    """The folder's tokenizer for serving (lengths are checked by the engine, with a clear
    error); None for a weights-only folder (token-id prompts only)."""
    p = Path(path)
    if p.is_dir() and not any((p / f).exists() for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer in %s: only token-id prompts are accepted", path)
        return None
    tok = load_tokenizer(path)
    tok.model_max_length = 1 << 60
    return tok


def bound_bpe_cache(tok) -> None:
    """Shrink the BPE word cache of tokenizers that have no pre-tokenizer to 1,000 entries.

    ``tokenizers`` caches the merges of every "word" under 256 bytes, up to 10,000 of them. With
    no pre-tokenizer (SentencePiece-style BPE: Llama 2, Mistral v0.1, stories260k) the word is
    the whole prompt, so a server's cache filled with unique prompts that never repeat: 44 MiB
    over its first ~27,000 requests in the soak (issue 23), a creep that ends only when the
    cache is full. Word-level caches (byte-level BPE, split on spaces) keep the default.
    """
    backend = getattr(tok, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if backend is not None and backend.pre_tokenizer is None and hasattr(model, "_resize_cache"):
        model._resize_cache(BPE_CACHE_WHOLE_TEXT)
