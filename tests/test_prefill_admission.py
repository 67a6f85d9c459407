"""Admission that does not let a burst of prefills starve decodes: while any request decodes,
a step prefills at most ``max_prefill_tokens_while_decoding`` tokens; idle, the whole budget."""

from __future__ import annotations

from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.core.request import Request
from kvledger.core.scheduler import Scheduler
from kvledger.sampling_params import SamplingParams


def _sched(cap: int | None) -> Scheduler:
    cfg = SchedulerConfig(max_model_len=256, max_prefill_tokens_while_decoding=cap)
    return Scheduler.build(cfg, CacheConfig(block_size=4, enable_prefix_caching=False), 1024, 16)


def _req(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [3 + i % 50 for i in range(prompt_len)], params, (2,), max_total_tokens=256)


def _step(sched: Scheduler, now: float) -> tuple[int, int]:
    """One step; returns (prefill tokens, decode rows) scheduled."""
    so = sched.schedule()
    prefill = sum(n for n in so.num_scheduled_tokens if n > 1)
    decodes = sum(1 for n in so.num_scheduled_tokens if n == 1)
    sched.update_from_output(so, lambda r: 9, now=now)
    return prefill, decodes


def _burst_while_decoding(cap: int | None) -> tuple[list[tuple[int, int]], Scheduler]:
    sched = _sched(cap)
    for i in range(2):
        sched.add_request(_req(f"d{i}", 3, max_tokens=40))
    _step(sched, 0.0)  # the two short prompts are prefilled: they decode from now on
    for i in range(10):
        sched.add_request(_req(f"p{i}", 40))
    steps = []
    t = 1.0
    while sched.has_unfinished():
        steps.append(_step(sched, t))
        t += 1.0
    return steps, sched


def test_a_burst_of_prompts_is_spread_over_steps_while_decodes_run():
    steps, sched = _burst_while_decoding(cap=64)
    assert steps[0] == (64, 2)  # the decodes run; 64 of the burst's 400 prompt tokens
    assert all(p <= 64 for p, _ in steps)
    assert sum(p for p, _ in steps) == 400  # every prompt was prefilled, none starved
    assert sched.kv.num_used_blocks == 0
    uncapped, _ = _burst_while_decoding(cap=None)
    assert uncapped[0] == (400, 2)  # without the cap the whole burst shares one step


def test_with_nothing_decoding_the_whole_budget_goes_to_prefills():
    sched = _sched(64)
    for i in range(10):
        sched.add_request(_req(f"p{i}", 40))
    assert _step(sched, 0.0) == (400, 0)
    while sched.has_unfinished():
        _step(sched, 1.0)


def test_serve_caps_prefills_only_when_asked_and_0_means_no_cap():
    import argparse

    from kvledger.commands import serve
    from kvledger.config import SchedulerConfig

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    assert "max_prefill_tokens_while_decoding" not in serve.serve_engine_kwargs(parser.parse_args(["serve"]))
    kw = serve.serve_engine_kwargs(parser.parse_args(["serve", "--max-prefill-tokens-while-decoding", "512"]))
    assert kw["max_prefill_tokens_while_decoding"] == 512
    off = serve.serve_engine_kwargs(
        parser.parse_args(["serve", "--max-prefill-tokens-while-decoding", "0"])
    )
    assert "max_prefill_tokens_while_decoding" not in off
    assert SchedulerConfig().max_prefill_tokens_while_decoding is None  # offline: no cap
