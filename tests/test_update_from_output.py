"""The post-step update has one home, ``Scheduler.update_from_output``, shared by the engine and
the simulator: token appends, EOS / stop token ids (from min_tokens on), the length cap."""

from __future__ import annotations

import inspect

from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.core.engine import LLMEngine
from kvledger.core.input_processor import InputProcessor
from kvledger.core.request import Request
from kvledger.core.scheduler import Scheduler
from kvledger.sampling_params import SamplingParams
from kvledger.sim import simulator


def _run(params: SamplingParams, tokens: list[int]) -> Request:
    sched = Scheduler.build(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4), 32, 16)
    req = Request("r", [5, 6, 7], params, eos_token_ids=(2,), max_total_tokens=64)
    sched.add_request(req)
    feed = iter(tokens)
    step = 0
    while not req.is_finished:
        step += 1
        so = sched.schedule()
        due = {rid: next(feed) for rid in so.req_ids}
        updated = sched.update_from_output(so, due, now=float(step))
        assert updated == [req]
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished()
    return req


def test_eos_stop_ids_min_tokens_and_length():
    r = _run(SamplingParams(max_tokens=10), [9, 2, 9])
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([9, 2], "stop", None)
    r = _run(SamplingParams(max_tokens=10, min_tokens=3), [2, 2, 9, 2, 9])
    assert r.output_token_ids == [2, 2, 9, 2] and r.finish_reason == "stop"  # EOS only from 3 on
    r = _run(SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]), [7, 7, 9])
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == ([7, 7], "stop", 7)
    r = _run(SamplingParams(max_tokens=3, ignore_eos=True), [2, 2, 2, 2])
    assert (r.output_token_ids, r.finish_reason) == ([2, 2, 2], "length")
    assert (r.first_token_time, r.last_token_time, r.finished_time) == (1.0, 3.0, 3.0)


def test_engine_and_simulator_share_it():
    """No second copy: both call the scheduler's update (and its prompt check)."""
    assert "update_from_output" in inspect.getsource(LLMEngine.step)
    assert "update_from_output" in inspect.getsource(simulator.apply_step_update)
    assert "check_prompt" in inspect.getsource(InputProcessor.validate_prompt)
    assert "scheduler.check_prompt" in inspect.getsource(LLMEngine)
    assert "check_prompt" in inspect.getsource(simulator.Simulator._validate)
    for src in (inspect.getsource(LLMEngine), inspect.getsource(simulator)):
        assert "append_output_token" not in src and "max_output_tokens" not in src
