"""A classification head built from a causal LM's head (vLLM's ``classifier_from_token``, set
with ``hf_overrides``): rerankers such as Qwen3-Reranker ship as ``*ForCausalLM`` and score a
pair by the next token's "yes" against "no".

``method`` "from_2_way_softmax" (``is_original_qwen3_reranker``): one label whose weight is
``lm_head[yes] - lm_head[no]``, so its sigmoid is the softmax of the two tokens' logits, P(yes).
"no_post_processing": one label per listed token, their LM-head rows as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvledger.errors import ConfigError
from kvledger.hf.config import seq_cls_method


def head_rows(reader: Any, path: Path, hf_config: dict[str, Any]) -> torch.Tensor:
    """The ``score`` weight [num_labels, hidden] from the checkpoint's LM head (or its tied
    embedding), in float32."""
    from kvledger.hf.tokenizer import load_tokenizer

    tokens = list(hf_config["classifier_from_token"])
    name = "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"
    if name not in reader:
        raise ConfigError(f"classifier_from_token needs the LM head: {path} has neither lm_head.weight nor the embedding")
    tok = load_tokenizer(path)
    ids = []
    for t in tokens:
        i = tok.convert_tokens_to_ids(t)
        if i is None or (i == tok.unk_token_id and t != tok.unk_token):
            raise ConfigError(f"classifier_from_token: {t!r} is not a token of {path.name}'s vocabulary")
        ids.append(int(i))
    rows = reader.get(name).to(torch.float32)[ids]
    if seq_cls_method(hf_config) == "from_2_way_softmax":
        return rows[1:2] - rows[0:1]  # [no, yes] -> yes - no
    return rows
