"""A classification head's facts (transformers' ``*ForSequenceClassification``): its labels,
and which activation its logits go through for ``classify`` and for ``score``, as vLLM decides.

vLLM follows transformers' loss for ``classify``: ``problem_type`` "regression" keeps the
logits, "multi_label_classification" takes a sigmoid per label, otherwise one label is a
sigmoid and several a softmax. For ``score`` (a cross-encoder) the folder's sentence-transformers
``activation_fn`` (or ``sbert_ce_default_activation_function``) in config.json decides, limited to
``torch.nn.modules`` classes; without one, the same one-label-sigmoid / softmax rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.errors import ConfigError
from kvledger.hf.config import num_labels

# sentence-transformers' activation_fn names kvledger applies (vLLM accepts any class of
# torch.nn.modules; these are the ones cross-encoders ship with).
_ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "default",
    "torch.nn.modules.activation.Softmax": "default",
}


@dataclass(frozen=True)
class ClassifierInfo:
    """``labels``: the label of each logit (config.json's ``id2label``, transformers' LABEL_i
    without it); activations: one of pooling.params.ACTIVATIONS."""

    labels: tuple[str, ...]
    classify_activation: str
    score_activation: str

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def load_classifier(hf_config: dict[str, Any]) -> ClassifierInfo:
    n = num_labels(hf_config)
    id2label = hf_config.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
    default = "sigmoid" if n < 2 else "softmax"
    problem = hf_config.get("problem_type") or ""
    classify = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem, default)
    st = hf_config.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or hf_config.get(
        "sbert_ce_default_activation_function"
    )
    score = default
    if name is not None:
        if name not in _ST_ACTIVATIONS:
            raise ConfigError(
                f"config.json's cross-encoder activation_fn {name!r} is not supported; "
                f"one of {', '.join(_ST_ACTIVATIONS)}"
            )
        score = default if _ST_ACTIVATIONS[name] == "default" else _ST_ACTIVATIONS[name]
    return ClassifierInfo(labels=labels, classify_activation=classify, score_activation=score)
