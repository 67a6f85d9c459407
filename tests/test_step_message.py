"""The step message is the whole contract between the engine and its workers.

A worker that is fed nothing but the engine's ``SchedulerOutput``s, pickled and unpickled as a
tensor-parallel rank receives them, must reproduce the engine's tokens exactly; the message
must hold no engine object (no ``Request``), and the runner must keep nothing of a request
once it has finished.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle

import pytest

from kvledger import LLM, SamplingParams
from kvledger.cache.table_delta import TableDelta, TableDeltas
from kvledger.core.request import Request
from kvledger.core.sched_output import NewRequestData, SchedulerOutput
from kvledger.engine.calibration import Calibration, calibrate
from kvledger.structured.bitmask import GrammarBitmask
from kvledger.worker.worker import Worker

_STORY = [1, 403, 407, 261, 479, 292, 27, 310, 263, 411, 295, 266, 301, 290, 312, 287, 299, 268]
PROMPTS = [_STORY, [1, 365, 156, 372], _STORY[:17] + [330, 341]]  # the third shares 2 blocks


def _record(llm: LLM) -> list[SchedulerOutput]:
    """Every message the engine sends its executor, as bytes would carry them."""
    ex = llm.llm_engine.executor
    sent: list[bytes] = []
    orig = ex.execute_model

    def execute_model(so):
        sent.append(pickle.dumps(so))
        return orig(so)

    ex.execute_model = execute_model
    return sent


def _plain(obj, seen=None) -> None:
    """Fail on anything but plain data: builtins, dataclasses of the step's own kinds."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or obj is None or isinstance(obj, str | int | float | bool | bytes | enum.Enum):
        return
    seen.add(id(obj))
    assert not isinstance(obj, Request), "a scheduler Request crossed into the step message"
    if isinstance(obj, dict):
        for k, v in obj.items():
            _plain(k, seen)
            _plain(v, seen)
    elif isinstance(obj, list | tuple | set | frozenset):
        for v in obj:
            _plain(v, seen)
    elif dataclasses.is_dataclass(obj):
        allowed = (SchedulerOutput, NewRequestData, TableDeltas, TableDelta, GrammarBitmask)
        assert isinstance(obj, allowed) or type(obj).__module__.startswith(
            ("kvledger.sampling_params", "kvledger.structured.params")
        ), type(obj)
        for f in dataclasses.fields(obj):
            _plain(getattr(obj, f.name), seen)


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "kv_cache_dtype, spec", [("auto", None), ("int8", None), ("auto", SPEC), ("int8", SPEC)]
)
def test_a_worker_fed_only_the_messages_reproduces_the_engine(stories_path, kv_cache_dtype, spec):
    """Chunked prefill, prefix hits, n > 1 forks, seeded sampling, swap and recompute
    preemptions, logprobs, speculative decoding (drafts verified and rolled back): a second
    worker that sees only the unpickled messages samples the same tokens, with the same
    logprobs, as the engine's worker did."""
    kw = dict(
        num_kv_blocks=24, block_size=8, max_num_batched_tokens=16, max_num_seqs=4,
        calibrate_preemption=False, kv_cache_dtype=kv_cache_dtype, kv_recent_tokens=4,
        speculative_config=spec,
    )  # fmt: skip
    llm = LLM(str(stories_path), preemption_mode="auto", **kw)
    sent = _record(llm)
    params = [
        SamplingParams(temperature=0, max_tokens=90, logprobs=2),
        SamplingParams(temperature=0.9, max_tokens=70, seed=11, n=2),
        SamplingParams(temperature=1.0, max_tokens=60),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the workload must preempt"
    assert any(o.num_cached_tokens for o in outs), "and hit the prefix cache"
    eng = llm.llm_engine
    replica = Worker(eng.executor.worker.spec)  # a fresh worker: same spec, none of the state
    sampled: dict[str, list[int]] = {}
    for data in sent:
        so = pickle.loads(data)
        _plain(so)
        out = replica.execute_model(so)
        for rid, tok in out.sampled.items():
            sampled.setdefault(rid, []).extend([*out.spec_token_ids.get(rid, []), tok])
    for o in outs:
        for c in o.outputs:
            rid = o.request_id if c.index == 0 else f"{o.request_id}#{c.index}"
            assert sampled[rid][: len(c.token_ids)] == c.token_ids, rid
    assert not replica.runner.requests and not len(replica.runner.block_table)
    if spec is not None:
        assert eng.scheduler.speculator.stats.num_accepted_tokens > 0


def test_runner_state_is_dropped_with_the_finished_ids(stories_path):
    """Aborted, finished and never-run requests: nothing of them stays on the runner side,
    even when the engine goes idle right after (it then sends the finished ids alone)."""
    llm = LLM(str(stories_path), calibrate_preemption=False, num_kv_blocks=64)
    eng = llm.llm_engine
    runner = eng.executor.worker.runner
    a = eng.add_request([1, 403, 407], SamplingParams(temperature=0, max_tokens=50))
    b = eng.add_request([1, 365, 156], SamplingParams(temperature=0, max_tokens=3, n=3))
    eng.step()
    eng.step()
    assert a in runner.requests and b in runner.requests
    eng.abort_request(a)
    while eng.has_unfinished_requests():
        eng.step()
    assert not runner.requests and not len(runner.block_table)


def test_calibration_returns_numbers_and_leaves_nothing_behind(stories_path):
    llm = LLM(str(stories_path), calibrate_preemption=False, num_kv_blocks=64, swap_space=0.01)
    eng = llm.llm_engine
    cal = calibrate(eng.executor, eng.kv, eng.max_model_len)
    assert isinstance(cal, Calibration)
    assert cal.prefill_coeffs is not None and min(cal.prefill_coeffs) >= 0
    assert cal.swap_bandwidth and cal.swap_bandwidth > 1e6 and cal.swap_fixed_s > 0
    assert cal.info["prefill_lengths"] == [16, 64, 256]
    assert eng.kv.num_used_blocks == 0 and not eng.executor.worker.runner.requests
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
