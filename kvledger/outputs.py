"""What the engine hands back to callers (the shape vLLM users already know).

Plain dataclasses of plain values, so that they pickle and can cross a process boundary.
A stream's outputs are cumulative, deltas or final only, by ``SamplingParams.output_kind``;
``RequestOutput.add`` merges deltas (what a slow reader that skipped some outputs needs).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None  # one {token id: Logprob} per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    num_generation_tokens: int = 0  # all sequences together, whatever the output kind


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # the first entry is None
    metrics: RequestMetrics | None = None

    def add(self, next_output: RequestOutput, aggregate: bool = True) -> None:
        """Fold a later output into this one (vLLM's ``RequestOutput.add``).

        ``aggregate``: both are deltas, so texts, token ids and logprobs are concatenated;
        otherwise each completion is replaced by its newer state.
        """
        self.finished |= next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = next_output.prompt_logprobs
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index != nxt.index:
                    continue
                if aggregate:
                    cur.text += nxt.text
                    cur.token_ids.extend(nxt.token_ids)
                    if nxt.logprobs is not None:
                        cur.logprobs = (cur.logprobs or []) + nxt.logprobs
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason = nxt.finish_reason
                    cur.stop_reason = nxt.stop_reason
                else:
                    self.outputs[i] = nxt
                break
            else:
                self.outputs.append(nxt)


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One output from a request's DELTA outputs, in order; each text is joined once."""
    last = outputs[-1]
    newest: dict[int, CompletionOutput] = {}
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list] = {}
    for o in outputs:
        for c in o.outputs:
            texts.setdefault(c.index, []).append(c.text)
            ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs)
            newest[c.index] = c
    prompt_lps = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=last.request_id,
        prompt=last.prompt,
        prompt_token_ids=last.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=i,
                text="".join(texts[i]),
                token_ids=ids[i],
                cumulative_logprob=c.cumulative_logprob,
                logprobs=lps.get(i),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in sorted(newest.items())
        ],
        finished=last.finished,
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=prompt_lps,
        metrics=last.metrics,
    )


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's ``PoolingOutput``; a list of floats here, so that the
    torch-free front ends and the engine-core pipe carry it as plain data)."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """What the engine hands back for a pooling request (vLLM's ``PoolingRequestOutput``)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed()``'s item (vLLM's shape: ``output.outputs.embedding``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationOutput:
    """A classifier's label probabilities (logits when its activation is off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify()``'s item (vLLM's shape: ``output.outputs.probs``)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data), out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    """One pair's score: a cross-encoder's (activated) logit, or two embeddings' cosine."""

    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score()``'s item (vLLM's shape: ``output.outputs.score``)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
