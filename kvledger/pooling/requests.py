"""The engine's side of pooling requests: which runner takes which parameters, the prefill-only
request a pooling request rides as, and its output.

A pooling request goes through the same scheduler, KV pool, prefix cache and chunked prefill
as generation: it is a ``Request`` with ``max_tokens=1`` sampling parameters that are never
used (the runner pools its prompt instead of sampling; the scheduler finishes it when its
prompt is computed) and its ``PoolingParams``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.hf.config import model_head
from kvledger.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from kvledger.pooling.params import PoolingParams
from kvledger.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvledger.core.output_processor import RequestGroup
    from kvledger.pooling.config import PoolerConfig

# What the scheduler sees of a pooling request: one "step" of prefill, its output at the end.
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)


def check_runner(pooler: PoolerConfig | None, params: object) -> None:
    """A pooling model takes PoolingParams only, a generative one SamplingParams only (vLLM's
    rule); the error names the runner to start instead."""
    if pooler is not None and not isinstance(params, PoolingParams):
        raise InvalidRequestError(
            "this model runs with the pooling runner (runner='pooling'): it pools prompts "
            f"({', '.join(pooler.tasks)}: LLM.{pooler.tasks[0]}) and does not generate text"
        )
    if pooler is None and isinstance(params, PoolingParams):
        raise InvalidRequestError(
            "embedding needs the pooling runner: start the model with runner='pooling' "
            "(kvledger serve --runner pooling); this one runs the generate runner"
        )


def check_generates(hf_config: dict) -> None:
    """The generate runner needs an LM head: a classifier or a bare decoder is refused by name."""
    if model_head(hf_config) != "lm":
        arch = (hf_config.get("architectures") or ["this model"])[0]
        raise ConfigError(
            f"{arch} has no LM head and cannot generate text; serve it with runner='pooling' "
            "(kvledger serve --runner pooling)"
        )


def resolve(pooler: PoolerConfig | None, params: object) -> PoolingParams | None:
    """The request's PoolingParams with the model's pooling filled in (None: a generation
    request); raises for the wrong runner or what the model cannot do."""
    check_runner(pooler, params)
    if pooler is None:
        return None
    return pooler.resolve(params)  # type: ignore[arg-type]


def make_pooling_output(group: RequestGroup) -> PoolingRequestOutput:
    seq = group.seqs[0]
    return PoolingRequestOutput(
        request_id=group.request_id,
        outputs=PoolingOutput(list(seq.pooled or [])),
        prompt_token_ids=seq.prompt_token_ids,
        finished=group.finished,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        prompt=group.prompt,
        metrics=RequestMetrics(
            seq.arrival_time, seq.first_scheduled_time, None, None, seq.finished_time, seq.num_preemptions
        ),
    )
