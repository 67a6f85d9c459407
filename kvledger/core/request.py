"""A request's state machine: waiting -> running -> (preempted: waiting | swapped) -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvledger.logprobs import Logprob
from kvledger.pooling.params import PoolingParams
from kvledger.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prefix loads from a lower tier
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the "priority" victim policy
    cache_salt: str | None = None
    max_total_tokens: int = 0  # prompt + output cap (the model's context)
    # Sampling state.
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # vLLM's SampleLogprobs
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # positions 1..
    # Scheduling state.
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    # Tokens the runner(s) have been sent (0: not yet seen; see SchedulerOutput.new_token_ids).
    num_synced_tokens: int = 0
    last_resumed_step: int = -1
    admitted_step: int = -1
    waiting_since_step: int = 0
    steps_waited: int = 0  # steps spent waiting or preempted (drives the aging priority)
    # LongRoPE: its cached K were rotated with the long factors (the sequence was longer than
    # original_max_position_embeddings when they were computed); see Scheduler.rope_long_from.
    rope_long: bool = False
    # Finishing.
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # Engine-side output state: the incremental detokenizer and what streams were sent.
    detokenizer: object | None = None  # core.detokenizer.IncrementalDetokenizer
    num_sent_tokens: int = 0  # output tokens already handed out in DELTA outputs
    finish_sent: bool = False  # the finishing DELTA output was handed out
    # n > 1: children forked from this request after its prompt is computed.
    parent_id: str | None = None
    index: int = 0
    children: list[Request] = field(default_factory=list)  # forked when the prompt is done
    # Timing for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    bad_words_token_ids: list[list[int]] | None = None  # SamplingParams.bad_words, tokenized
    grammar: object | None = None  # kvledger.structured.state.GrammarState when constrained
    # A pooling request (kvledger/pooling): prefill only, finished by its pooled vector.
    pooling_params: PoolingParams | None = None
    pooled: list[float] | None = None
    # Speculative decoding: the drafts scheduled this step (verified and cleared by the update),
    # the proposer's per-request state (kvledger.spec_decode.speculator.SpecState), and how many
    # tokens the last update appended (1, or accepted drafts + 1).
    spec_token_ids: list[int] = field(default_factory=list)
    # A token tree's parent of each draft (kvledger.spec_decode.tree); None: the drafts are a chain.
    spec_parents: list[int] | None = None
    spec_state: object | None = None
    num_new_tokens: int = 0
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def max_output_tokens(self) -> int:
        cap = self.max_total_tokens - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return cap if mt is None else min(mt, cap)

    @property
    def remaining_tokens(self) -> int:
        """Estimated generation still to come (the victim policy's main signal)."""
        return max(0, self.max_output_tokens - self.num_output_tokens)


def check_stop(req: Request, token: int) -> str | None:
    """The token-level stops after ``token`` was appended: EOS, a stop token id (both from
    ``min_tokens`` on), then the length cap. Stop strings need text: the engine's."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
    if req.num_output_tokens >= req.max_output_tokens:
        return "length"
    return None
