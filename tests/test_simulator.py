"""The simulator replays the engine's own scheduling: same decisions, honest memory figures.

Invariants pinned here: a bad trace row is refused with its line number and reason; for the
same workload and block budget the simulator and the real engine admit and preempt the same
requests at the same steps; the simulator's memory probe equals the ledger's arithmetic;
paging never stores less per reserved slot than naive reservation; static batching is slower
than continuous batching on a high-variance workload.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.errors import ConfigError
from kvledger.ledger.accounting import kv_bytes_per_token
from kvledger.ledger.spec import PRESETS
from kvledger.sim import Simulator, StepCostModel, TraceRequest, load_trace, synthetic_trace
from kvledger.sim.cost_model import fit_step_times, gpu_cost_model
from kvledger.sim.setup import SimSetup
from kvledger.sim.trace import LengthDist

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
CHEAP = StepCostModel(a=1e-3, b=1e-5, c=1e-8)


def kvledger(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvledger", *args], capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------------------------ traces
GOOD = '{"arrival_time": 0.5, "prompt_len": 10, "output_len": 4}'


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"prompt_len": 10, "output_len": 4}', "missing field 'arrival_time'"),
        ('{"arrival_time": 0, "output_len": 4}', "missing field 'prompt_len'"),
        ('{"arrival_time": 0, "prompt_len": 10}', "missing field 'output_len'"),
        ('{"arrival_time": 0, "prompt_len": -3, "output_len": 4}', "prompt_len must be >= 1"),
        ('{"arrival_time": 0, "prompt_len": 10, "output_len": 0}', "output_len must be >= 1"),
        (
            '{"arrival_time": 0, "prompt_len": 10.5, "output_len": 4}',
            "prompt_len must be an integer",
        ),
        (
            '{"arrival_time": 0, "prompt_len": "10", "output_len": 4}',
            "prompt_len must be an integer",
        ),
        (
            '{"arrival_time": 0, "prompt_len": true, "output_len": 4}',
            "prompt_len must be an integer",
        ),
        ('{"arrival_time": -1, "prompt_len": 10, "output_len": 4}', "arrival_time must be >= 0"),
        (
            '{"arrival_time": "soon", "prompt_len": 10, "output_len": 4}',
            "arrival_time must be a finite",
        ),
        (
            '{"arrival_time": 0, "prompt_len": 10, "output_len": 4, "prefix_id": "s"}',
            "prefix_id and prefix_len must be given together",
        ),
        (
            '{"arrival_time": 0, "prompt_len": 10, "output_len": 4, "prefix_id": "s", "prefix_len": 11}',
            "prefix_len 11 exceeds prompt_len 10",
        ),
    ],
)
def test_bad_trace_row_is_refused_with_its_line_number_and_reason(tmp_path, bad, reason):
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n\n{bad}\n{GOOD}\n")
    with pytest.raises(ConfigError) as e:
        load_trace(path)
    assert f"trace.jsonl:3: {reason}" in str(e.value)


def test_bad_trace_is_a_one_line_cli_error_with_exit_2(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + '\n{"arrival_time": 1, "prompt_len": 3}\n')
    r = kvledger("simulate", "--trace", str(path), "--json")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "trace.jsonl:2: missing field 'output_len'" in r.stderr
    assert "Traceback" not in r.stderr


def test_trace_rows_are_sorted_by_arrival_and_prefixes_kept(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        '{"arrival_time": 2.0, "prompt_len": 5, "output_len": 1}',
        "# a comment",
        '{"arrival_time": 1.0, "prompt_len": 40, "output_len": 2, "prefix_id": 7, "prefix_len": 32}',
        '{"arrival_time": 1.0, "prompt_len": 6, "output_len": 3}',
    ]
    path.write_text("\n".join(rows))
    trace = load_trace(path)
    assert [(r.arrival_time, r.prompt_len) for r in trace] == [(1.0, 40), (1.0, 6), (2.0, 5)]
    assert (trace[0].prefix_id, trace[0].prefix_len, trace[0].line) == ("7", 32, 3)


def test_length_distributions_parse_and_stay_in_range():
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128
    assert all(16 <= LengthDist.parse("16-64").sample(rng) <= 64 for _ in range(200))
    hv = [LengthDist.parse("high-variance").sample(rng) for _ in range(2000)]
    assert all(16 <= n <= 64 or 256 <= n <= 512 for n in hv)
    assert 0.05 < sum(n >= 256 for n in hv) / len(hv) < 0.15
    assert LengthDist.parse("lognormal:300,0").sample(rng) == 300
    for bad in ("0", "64-16", "lognormal:300", "gaussian:1,2", "x"):
        with pytest.raises(ConfigError, match="distribution"):
            LengthDist.parse(bad, "--prompt-len")


# ------------------------------------------------------------- engine == simulator
def _engine_decisions(prompts, output_lens, **kw):
    from kvledger import LLM, SamplingParams

    llm = LLM(str(STORIES), **kw)
    eng = llm.engine
    record, schedule = [], eng.scheduler.schedule

    def recording_schedule():
        so = schedule()
        record.append((list(so.admitted), list(so.preempted)))
        return so

    eng.scheduler.schedule = recording_schedule
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(output_lens)
    return record, eng


@pytest.mark.skipif(not STORIES.is_dir(), reason="needs ../shared/models/stories260k")
@pytest.mark.parametrize("mode, prefix", [("recompute", 0), ("recompute", 24), ("swap", 0)])
def test_simulator_makes_the_engines_scheduling_decisions(mode, prefix):
    rng = random.Random(0)
    n, num_blocks, block_size, budget, seats = 12, 16 + prefix // 8, 8, 96, 6
    prompt_lens = [prefix + rng.randint(5, 32) for _ in range(n)]
    output_lens = [rng.randint(4, 30) for _ in range(n)]
    shared = [rng.randrange(3, 512) for _ in range(prefix)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(p - prefix)] for p in prompt_lens]
    # budget >= every request's total length, so each step samples at least one token
    assert budget >= max(p + o for p, o in zip(prompt_lens, output_lens))
    engine_record, eng = _engine_decisions(
        prompts,
        output_lens,
        num_kv_blocks=num_blocks,
        block_size=block_size,
        preemption_mode=mode,
        max_num_batched_tokens=budget,
        max_num_seqs=seats,
    )
    trace = [
        TraceRequest(0.0, p, o, "system" if prefix else None, prefix)
        for p, o in zip(prompt_lens, output_lens)
    ]
    sc = SchedulerConfig(
        max_num_seqs=seats,
        max_num_batched_tokens=budget,
        max_model_len=eng.max_model_len,
        preemption_mode=mode,
    )
    sim = Simulator(
        trace, sc, CacheConfig(block_size=block_size), num_blocks, eng.bytes_per_token, CHEAP
    )
    result = sim.run()
    assert sum(eng.scheduler.num_preemptions.values()) > 0, "the workload must preempt"
    assert result.num_preemptions == eng.scheduler.num_preemptions
    assert result.decisions == engine_record
    assert sim.kv.prefix_cache_hits == eng.kv.prefix_cache_hits
    assert all(r.num_output_tokens == r.output_len for r in result.requests)


# ------------------------------------------------------------------ memory figures
def _seed_sim(trace, static_batch=None, **sched):
    spec = PRESETS["seed-70b"]
    sc = SchedulerConfig(max_model_len=4096, **sched)
    return Simulator(
        trace,
        sc,
        CacheConfig(swap_space=2.0),
        sched.pop("num_blocks", 2788),
        kv_bytes_per_token(spec, "auto", 2).total,
        gpu_cost_model("h100-80gb", spec, tp=2),
        static_batch=static_batch,
    )


def test_memory_probe_matches_the_ledger_at_every_step():
    trace = synthetic_trace(48, "16-200", "8-300", arrival_rate=20.0, seed=1, shared_prefix_len=40)
    spec = PRESETS["seed-70b"]
    sim = Simulator(
        trace,
        SchedulerConfig(max_model_len=4096, max_num_seqs=32),
        CacheConfig(swap_space=0.25),
        150,
        kv_bytes_per_token(spec, "auto", 2).total,
        gpu_cost_model("a100-80gb", spec, tp=2),
    )
    probe, checked = sim._probe, []

    def checking_probe(so, clock):
        rec = probe(so, clock)
        snap = sim.kv.ledger()
        assert (rec.tokens_stored, rec.used_blocks, rec.shared_blocks, rec.cached_blocks) == (
            snap.tokens_stored,
            snap.used_blocks,
            snap.shared_blocks,
            snap.cached_blocks,
        )
        checked.append(rec.shared_blocks)
        return rec

    sim._probe = checking_probe
    result = sim.run()
    sim.kv.check_invariants()
    assert max(checked) > 0 and sum(result.num_preemptions.values()) > 0


def test_paged_utilisation_is_at_least_naive_and_summary_is_complete():
    trace = synthetic_trace(96, "lognormal:256,1.0", "lognormal:128,1.0", seed=0)
    s = _seed_sim(trace).run().summary()
    assert 0 < s["naive_kv_utilization"] <= s["kv_utilization"] <= 1
    assert s["kv_utilization"] > 0.95
    assert s["num_finished"] == 96 and s["latency_p50_s"] <= s["latency_p99_s"]


def test_static_batching_is_slower_than_continuous_on_a_high_variance_workload():
    trace = synthetic_trace(128, "32-256", "high-variance", seed=0)
    cont = _seed_sim(trace, max_num_seqs=16).run().summary()
    static = _seed_sim(trace, static_batch=16, max_num_seqs=16).run().summary()
    assert static["peak_running"] == cont["peak_running"] == 16
    assert cont["throughput_tokens_per_s"] > 1.5 * static["throughput_tokens_per_s"]
    assert cont["latency_p99_s"] < static["latency_p99_s"]


def test_static_batch_admits_nothing_until_the_whole_batch_finished():
    trace = synthetic_trace(10, "8", "1-40", seed=3)
    result = _seed_sim(trace, static_batch=4).run()
    admitted = [(s.step, a) for s in result.steps for a in s.admitted]
    batches = [[a for _, a in admitted[i : i + 4]] for i in range(0, 10, 4)]
    assert batches == [["0", "1", "2", "3"], ["4", "5", "6", "7"], ["8", "9"]]
    by_id = {r.request_id: r for r in result.requests}
    first_of_batch2 = next(s.time for s in result.steps if "4" in s.admitted)
    assert all(by_id[str(i)].finished_time <= first_of_batch2 for i in range(4))


def test_step_time_is_the_cost_formula_plus_swap_traffic():
    from kvledger.core.sched_output import SchedulerOutput

    cm = StepCostModel(a=1.0, b=0.1, c=0.01, d=0.001, swap_bandwidth=100.0)
    so = SchedulerOutput(
        step=1, req_ids=["r"], num_scheduled_tokens=[4], num_computed_tokens=[6],
        blocks_to_swap_out=[(0, 0)],
    )
    # 4 tokens after 6: context 10, pairs 4 * (6 + 2.5) = 34; one 50-byte block out at 100 B/s
    assert cm.step_time(so, bytes_per_block=50) == pytest.approx(1 + 0.4 + 0.1 + 0.034 + 0.5)


def test_fit_recovers_known_coefficients():
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        t, ctx, pairs = rng.randint(1, 500), rng.randint(1, 5000), rng.randint(1, 100_000)
        rows.append(
            (
                t,
                ctx,
                pairs,
                (2e-3 + 5e-5 * t + 1e-7 * ctx + 1e-9 * pairs) * (1 + rng.uniform(-0.01, 0.01)),
            )
        )
    cm, info = fit_step_times(rows)
    assert cm.a == pytest.approx(2e-3, rel=0.1) and cm.b == pytest.approx(5e-5, rel=0.1)
    assert info["median_abs_rel_error"] < 0.02


def test_the_engine_shows_each_step_to_its_schedule_observers_before_it_runs():
    """The supported hook the CPU calibration reads steps through (no patched scheduler):
    each step's SchedulerOutput, while the requests' computed counts are the step's start."""
    from kvledger.llm import LLM
    from kvledger.model.default import embedded_model_path
    from kvledger.sampling_params import SamplingParams

    eng = LLM(str(embedded_model_path()), calibrate_preemption=False).engine
    seen: list[list[tuple[str, int, int]]] = []
    eng.schedule_observers.append(lambda so: seen.append(
        [(rid, eng.scheduler.requests[rid].num_computed_tokens, n) for rid, n, _ in so.batch()]
    ))  # fmt: skip
    rid = eng.add_request(list(range(3, 13)), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert seen == [[(rid, 0, 10)], [(rid, 10, 1)], [(rid, 11, 1)]]
    assert "schedule" not in vars(eng.scheduler)  # the scheduler's own method, unpatched


def test_cpu_calibration_fits_the_real_engine_steps():
    from kvledger.model.default import embedded_model_path
    from kvledger.sim.cost_model import calibrate_cpu

    cm = calibrate_cpu(str(embedded_model_path()), max_prompt=32)
    # 12 timed shapes (the first only warms up), 24 output tokens each: every step was read.
    assert cm.fit["num_steps"] >= 12 * 24
    assert cm.a > 0 and cm.b > 0 and cm.swap_bandwidth > 0
    assert cm.name == "cpu-measured" and "engine steps" in cm.source


def test_cost_model_json_round_trip_and_errors(tmp_path):
    cm = gpu_cost_model("h100-80gb", PRESETS["seed-70b"], tp=2)
    cm.save(tmp_path / "cm.json")
    assert StepCostModel.load(tmp_path / "cm.json") == cm
    (tmp_path / "bad.json").write_text('{"a": 1, "b": -2, "c": 0}')
    with pytest.raises(ConfigError, match="b must be a finite number >= 0"):
        StepCostModel.load(tmp_path / "bad.json")


def test_setup_sizes_the_seed_70b_pool_like_kvledger_plan():
    setup = SimSetup(model="seed-70b")
    setup.resolve()
    assert (setup.tp, setup.num_kv_blocks, setup.bytes_per_token) == (2, 2788, 163_840)
    assert setup.resolved_cost_model.a == pytest.approx(0.0281, rel=0.01)


# ---------------------------------------------------------------------------- CLI
def test_cli_json_keys_and_plot(tmp_path):
    png = tmp_path / "run.png"
    r = kvledger(
        "simulate", "--num-requests", "40", "--output-len", "high-variance", "--arrival-rate", "5",
        "--max-num-seqs", "16", "--json", "--plot", str(png),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    for key in (
        "kv_utilization",
        "naive_kv_utilization",
        "throughput_tokens_per_s",
        "latency_p50_s",
        "latency_p99_s",
        "ttft_p50_s",
        "num_preemptions",
        "peak_running",
        "duration_s",
    ):
        assert key in f, key
    assert set(f["num_preemptions"]) == {"swap", "recompute", "total"}
    assert f["peak_running"] <= 16 and f["num_finished"] == 40
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace_file_with_a_json_cost_model(tmp_path):
    (tmp_path / "cm.json").write_text('{"a": 0.01, "b": 0.001, "c": 0.0}')
    (tmp_path / "t.jsonl").write_text(
        '{"arrival_time": 0, "prompt_len": 32, "output_len": 8}\n'
        '{"arrival_time": 0, "prompt_len": 32, "output_len": 8}\n'
    )
    r = kvledger(
        "simulate", "--trace", str(tmp_path / "t.jsonl"), "--cost-model", str(tmp_path / "cm.json"),
        "--model", "llama-3-8b", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    # step 1: 64 prefill tokens -> 0.01 + 0.064; then 7 decode steps of 2 tokens -> 0.012 each
    assert f["duration_s"] == pytest.approx(0.074 + 7 * 0.012)
    assert f["throughput_tokens_per_s"] == pytest.approx(16 / f["duration_s"])


def test_tier_replay_lowers_ttft_when_prefixes_outgrow_the_pool():
    """Six tenants' 1,024-token prefixes, round-robin, through a pool a third of their size: an
    LRU pool never holds the next tenant's prefix, so without tiers every prompt is recomputed;
    a host tier serves them (loaded at the cost model's host bandwidth, overlapping the steps),
    and the replay's TTFT falls. The same scheduler code decides in both runs."""
    spec = PRESETS["seed-70b"]
    bpt = kv_bytes_per_token(spec, "auto", 2).total
    trace = [TraceRequest(0.5 * i, 1024 + 32, 8, prefix_id=f"t{i % 6}", prefix_len=1024) for i in range(36)]
    results = {}
    for host in (0, 6 * 1024 * bpt * 2):
        sim = Simulator(trace, SchedulerConfig(max_model_len=4096), CacheConfig(swap_space=0.0),
                        6 * 1024 // 16 // 3, bpt, gpu_cost_model("h100-80gb", spec, tp=2),
                        tier_bytes=(host, 0))  # fmt: skip
        results[host] = sim.run().summary()
        if host:
            assert sim.kv.tiers.hits["host"] == 30 * 64  # every request after each tenant's first
    off, on = results[0], results[6 * 1024 * bpt * 2]
    assert off["prefix_cache_hit_rate"] == 0 and on["prefix_cache_hit_rate"] > 0.8
    assert on["ttft_p50_s"] < off["ttft_p50_s"] / 2, (on["ttft_p50_s"], off["ttft_p50_s"])
