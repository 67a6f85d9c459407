"""vLLM's older import path for the logprob types (``from vllm.sequence import Logprob``)."""

from kvledger.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
