"""kvledger: an LLM inference engine whose core is exact, paged accounting of the KV cache."""

from kvledger.sampling_params import SamplingParams
from kvledger.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `kvledger plan` must not pay for importing torch.
    if name == "LLM":
        from kvledger.llm import LLM

        return LLM
    raise AttributeError(name)
