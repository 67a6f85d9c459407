"""Victim choice (largest remaining generation, aged, no thrashing), the per-victim
swap/recompute cost model, and the starvation bound under a steady stream of new requests."""

from __future__ import annotations

import pytest

from kvledger import LLM, SamplingParams
from kvledger.core.preemption import PreemptionCostModel, select_victim
from kvledger.core.request import Request
from kvledger.errors import InvalidRequestError


def req(rid: str, max_tokens: int, generated: int = 0, arrival: float = 0.0, **kw) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), arrival_time=arrival,
                max_total_tokens=10_000, **kw)
    for _ in range(generated):
        r.append_output_token(5)
    return r


def test_victim_is_largest_remaining_generation():
    a, b, c = req("a", 100, 90), req("b", 300, 10, 1.0), req("c", 50, 0, 2.0)
    assert select_victim([a, b, c], "remaining", step=10, max_preemptions_before_protect=3) is b


def test_aging_and_protection_stop_repeat_eviction():
    long = req("long", 1000, 0)
    short = req("short", 100, 0, 1.0)
    assert select_victim([long, short], "remaining", 10, 3) is long
    long.num_preemptions = 2  # halved twice: 250 vs 100 -> still the long one
    assert select_victim([long, short], "remaining", 10, 3) is long
    long.num_preemptions = 3  # protected now: evicted only if nothing else is eligible
    assert select_victim([long, short], "remaining", 10, 3) is short
    assert select_victim([long], "remaining", 10, 3) is long


def test_just_resumed_request_is_not_the_next_victim():
    a, b = req("a", 1000), req("b", 10, 0, 1.0)
    a.last_resumed_step = 9
    assert select_victim([a, b], "remaining", step=10, max_preemptions_before_protect=3) is b
    assert select_victim([a, b], "remaining", step=12, max_preemptions_before_protect=3) is a


def test_alternative_policies():
    a, b = req("a", 10, arrival=0.0, priority=5), req("b", 1000, arrival=1.0, priority=0)
    assert select_victim([a, b], "fcfs", 1, 3) is b  # newest
    assert select_victim([a, b], "priority", 1, 3) is a  # lowest priority (largest value)


def test_cost_model_choice_and_overrides():
    cm = PreemptionCostModel(swap_bandwidth=25e9, swap_fixed_s=2e-3, prefill_coeffs=(0.01, 2e-4, 1e-8))
    bpt = 327_680
    x = cm.crossover_tokens(bpt)
    assert x is not None and x > 1
    assert cm.choose(x - 1, (x - 1) * bpt) == "recompute"
    assert cm.choose(x, x * bpt) == "swap"
    assert PreemptionCostModel(mode="swap").choose(1, 1) == "swap"
    assert PreemptionCostModel(recompute_threshold=100).choose(99, 10**12) == "recompute"
    assert PreemptionCostModel(recompute_threshold=100).choose(100, 0) == "swap"
    # Prefix blocks that survive make a recompute cheaper.
    assert cm.recompute_cost(1000, num_cached_tokens=900) < cm.recompute_cost(1000)


def test_calibrated_cost_model_on_this_machine(stories_path, capsys):
    llm = LLM(str(stories_path))  # calibrates at start-up
    eng = llm.engine
    cal = eng.calibration
    cm = eng.cost_model
    assert cal is not None and len(cal["prefill_seconds"]) >= 3
    assert cm.swap_bandwidth > 1e8  # a real memcpy, not a default
    x = cm.crossover_tokens(eng.bytes_per_token)
    assert x is not None, "recompute grows super-linearly: long victims must swap"
    assert cal["crossover_tokens"] == x
    for n in (x, 2 * x, 512):
        assert cm.choose(n, n * eng.bytes_per_token) == "swap"
    for n in range(1, x):
        assert cm.choose(n, n * eng.bytes_per_token) == "recompute"
    # The fit predicts the measured prefill times it was made from (within 2x).
    for n, t in zip(cal["prefill_lengths"], cal["prefill_seconds"]):
        assert cm.prefill_time(n) == pytest.approx(t, rel=1.0)
    with capsys.disabled():
        print(f"\n[calibration] stories260k crossover: swap cheaper from {x} tokens; {cal}")


def test_long_request_is_not_starved_by_a_stream_of_short_ones(stories_path):
    llm = LLM(str(stories_path), num_kv_blocks=24, block_size=8, max_num_seqs=8,
              preemption_mode="recompute", calibrate_preemption=False)
    eng = llm.engine
    long_id = eng.add_request([1] + [300] * 30, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    bound = 800  # steps; the long request alone needs ~125
    finished, step, k = None, 0, 0
    while step < bound and finished is None:
        if step % 2 == 0:  # a new short request every other step, forever
            eng.add_request([1, 10 + k % 200, 20], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            k += 1
        for out in eng.step():
            if out.request_id == long_id and out.finished:
                finished = out
        step += 1
    assert finished is not None, f"long request starved for {bound} steps"
    assert len(finished.outputs[0].token_ids) == 120
    assert finished.metrics.num_preemptions <= eng.config.scheduler.max_preemptions_before_protect
    for rid in list(eng.groups):
        eng.abort_request(rid)


def test_prompt_larger_than_the_pool_is_rejected_at_admission(stories_path):
    llm = LLM(str(stories_path), num_kv_blocks=4, block_size=8, calibrate_preemption=False)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        llm.generate([[1] + [300] * 40], SamplingParams(max_tokens=4), use_tqdm=False)


def test_swapped_request_comes_back_when_it_needs_the_whole_pool(stories_path):
    """Regression: swap-in used to demand one block more than needed, so a request needing
    the whole pool stayed swapped forever while generate() spun."""
    llm = LLM(str(stories_path), num_kv_blocks=2, block_size=4, preemption_mode="swap",
              calibrate_preemption=False)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request([5], sp)
    eng.add_request([5, 6, 7, 8], sp)
    done = 0
    for _ in range(100):
        done += sum(o.finished for o in eng.step())
        if done == 2:
            break
    assert done == 2, f"stuck: {len(eng.scheduler.swapped)} swapped, {eng.kv.num_free_blocks} free"
    assert eng.ledger().preemptions["swap"] > 0


def test_victim_is_not_readmitted_in_the_step_that_evicted_it(stories_path):
    llm = LLM(str(stories_path), num_kv_blocks=12, block_size=8, max_num_batched_tokens=32,
              preemption_mode="recompute", enable_prefix_caching=False, calibrate_preemption=False)
    eng = llm.engine
    sched = eng.scheduler
    for n in (30, 35):
        eng.add_request([1] + [300] * n, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    orig = sched.schedule
    readmitted = []

    def schedule():
        out = orig()
        readmitted.extend(set(out.admitted) & {rid for rid, _ in out.preempted})
        return out

    sched.schedule = schedule
    while eng.has_unfinished_requests():
        eng.step()
    assert readmitted == []
    assert sum(eng.ledger().preemptions.values()) <= 2  # no ping-pong between the two
