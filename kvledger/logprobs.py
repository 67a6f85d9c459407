"""Log-probabilities in vLLM's shape: per position, a dict token id -> Logprob.

``CompletionOutput.logprobs`` is a ``SampleLogprobs`` (one dict per generated token: the
sampled token and the top-k alternatives) and ``RequestOutput.prompt_logprobs`` a
``PromptLogprobs`` (the first position has no logprob, so it is None), as in vLLM, so code
written for vLLM (``out.prompt_logprobs[i][token_id].logprob``) runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``).

    ``rank``: 1 for the most likely token of the (raw) model distribution; ``decoded_token``:
    the token's text on its own, filled in by the engine when the model has a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]
SampleLogprobs = list[dict[int, Logprob]]
