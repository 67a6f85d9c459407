"""The serving benchmark's load generator (benchmarks/vs_vllm_serve.py) against a real
`kvledger serve`: its two HTTP clients must read the same streams the same way, so that a
figure never depends on which one measured it (only on how much CPU the client takes)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import pytest

from benchmarks.common import make_workload
from benchmarks.vs_vllm_serve import (
    CLIENTS,
    MODEL_NAME,
    drive,
    format_steps,
    kvledger_server,
    medians,
    paired,
    print_medians,
    print_paired,
    serve_interleaved,
    step_summary,
)
from kvledger.core.step_trace import ENV as STEP_TRACE_ENV
from tests.test_server import STORIES, ServerProcess


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    log = tmp_path_factory.mktemp("bench_client") / "server.log"
    trace = log.with_suffix(".steps.jsonl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STEP_TRACE_ENV, str(trace))  # what --step-trace does
        srv = ServerProcess(
            str(STORIES), "--served-model-name", MODEL_NAME, "--torch-threads", "1", "--no-dashboard",
            log_path=log,
        )  # fmt: skip
    srv.step_trace = trace
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_both_clients_read_the_same_tokens_and_time_every_chunk(bench_server):
    workload = make_workload(
        n=6, seed=3, prompt_len=(8, 40), short_out=(5, 12), long_frac=0.0, vocab_size=512
    )
    got = {}
    for client in CLIENTS:
        results, wall = asyncio.run(drive(bench_server.url, workload, 3, client))
        assert wall > 0
        for req, r in zip(workload, results, strict=True):
            assert r.error is None, (client, r.error)
            assert len(r.token_ids) == req["max_tokens"]  # ignore_eos: every token arrives
            assert r.ttft is not None and r.ttft > 0
            # One gap per token-bearing chunk after the first: at most one per token.
            assert 1 <= len(r.itl) + 1 <= len(r.token_ids) and all(x >= 0 for x in r.itl)
            assert r.start >= 0
        got[client] = [r.token_ids for r in results]
    assert got["aiohttp"] == got["httpx"]  # greedy: the same stream, read the same way


def test_a_failed_request_is_reported_not_fatal(bench_server):
    bad = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 10**9}]  # past the context: a 400
    for client in CLIENTS:
        results, _ = asyncio.run(drive(bench_server.url, bad, 1, client))
        assert results[0].error is not None and results[0].error.startswith("HTTP 400"), (
            client,
            results[0].error,
        )
        assert results[0].token_ids == []


def test_the_step_trace_accounts_for_every_token_of_a_load(bench_server):
    """KVLEDGER_STEP_TRACE (vs_vllm_serve --step-trace): the core's steps within a load's window
    carry exactly its prompt tokens as prefill and one decode per later token (ignore_eos,
    prompts of fresh random tokens: no prefix-cache hits), and the summary attributes them."""
    workload = make_workload(
        n=8, seed=77, prompt_len=(20, 60), short_out=(6, 14), long_frac=0.0, vocab_size=512
    )
    t_from = time.perf_counter()
    results, _ = asyncio.run(drive(bench_server.url, workload, 4, "aiohttp"))
    t_to = time.perf_counter()
    assert all(r.error is None for r in results)
    steps = [json.loads(x) for x in bench_server.step_trace.read_text().splitlines()]
    steps = [st for st in steps if t_from <= st["start"] <= t_to]
    assert all(st["end"] >= st["start"] for st in steps)
    assert sum(st["prefill_tokens"] for st in steps) == sum(len(r["prompt_token_ids"]) for r in workload)
    assert sum(st["decodes"] for st in steps) == sum(r["max_tokens"] - 1 for r in workload)
    assert max(st["decodes"] for st in steps) <= 4  # never more running than the concurrency
    itl = [x for r in results for x in r.itl]
    s = step_summary(bench_server.step_trace, t_from, t_to, results, 4, itl)
    assert s is not None and s["steps"] == len(steps) and s["gaps"] == len(itl)
    # The opening burst: the steps until each of the first 4 requests had its first token,
    # which together prefilled at least those 4 prompts.
    burst = [st for st in steps if st["start"] < max(r.sent_at + r.ttft for r in results[:4])]
    assert s["burst"]["steps"] == len(burst) >= 1
    assert sum(st["prefill_tokens"] for st in burst) >= sum(len(r["prompt_token_ids"]) for r in workload[:4])
    assert "opening burst" in format_steps(s)


def test_kvledger_server_command_builds_from_either_benchmarks_arguments(tmp_path, monkeypatch):
    """serve_fixed_load reuses vs_vllm_serve.kvledger_server with its own, smaller argument set
    (no --step-trace): the command must build from both, the trace only where asked for."""
    import argparse

    from benchmarks.vs_vllm_serve import kvledger_server

    monkeypatch.delenv(STEP_TRACE_ENV, raising=False)
    base = dict(dtype="bfloat16", kv_gib=1, max_model_len=1024, kvledger_args="")
    plain = kvledger_server(tmp_path, argparse.Namespace(**base), tmp_path / "a.log")
    assert plain.step_trace is None and STEP_TRACE_ENV not in plain.env
    assert plain.cmd[plain.cmd.index("--dtype") + 1] == "bfloat16"
    traced = kvledger_server(tmp_path, argparse.Namespace(**base, step_trace=True), tmp_path / "b.log")
    assert traced.env[STEP_TRACE_ENV] == str(tmp_path / "b.steps.jsonl") == str(traced.step_trace)


def test_interleaved_servers_take_turns_and_their_medians_are_reported(tmp_path, capsys):
    """--interleave: both servers up at once, each load run on one then the other, the order
    flipped each repeat (so a slow spell of the host falls on both); the same workload per
    repeat, the same greedy tokens; the medians table is each engine's over its repeats, the
    paired table each figure's median ratio to the other engine's in the same repeat."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    a = argparse.Namespace(
        dtype="float32", kv_gib=1, max_model_len=512, kvledger_args="--torch-threads 1 --no-dashboard",
        step_trace=False, warmup=2, vocab_size=512, client="aiohttp", seed=0, profile="", repeats=2,
        quiet_wait=1.0,  # at least one 0.5 s window is always measured; a busy host waits no longer
    )  # fmt: skip
    engines = ("kvledger", "kvledger-thread")
    servers = {e: kvledger_server(STORIES, a, tmp_path / f"{e}.log", e) for e in engines}
    report = serve_interleaved(servers, [(4, 2)], a)
    assert all(s.proc.poll() is not None for s in servers.values())  # both stopped after
    one, two = (report[e]["runs"] for e in engines)
    assert [r["repeat"] for r in one] == [0, 1] == [r["repeat"] for r in two]
    assert one[0]["t_from"] < two[0]["t_from"] and two[1]["t_from"] < one[1]["t_from"]
    for r1, r2 in zip(one, two, strict=True):
        assert r1["num_errors"] == r2["num_errors"] == 0
        assert r1["outputs"] == r2["outputs"] and r1["generated_tokens"] == r1["requested_tokens"]
    assert one[0]["outputs"] != one[1]["outputs"]  # each repeat its own workload
    assert all(r["quiet_wait_s"] >= 0.5 for r in one + two)  # each began on a quiet machine
    med = medians(report)
    for e, runs in zip(engines, (one, two), strict=True):
        assert med[e][2]["repeats"] == 2
        assert med[e][2]["tok_per_s"] == statistics.median(r["tok_per_s"] for r in runs)
        assert med[e][2]["itl_p99_ms"] == statistics.median(r["itl_p99_ms"] for r in runs)
    print_medians(report)
    out = capsys.readouterr().out
    assert "| 2 | kvledger | 2 |" in out and "| 2 | kvledger-thread | 2 |" in out
    # paired: each figure against the base engine's in the same repeat
    pr = paired(report, base="kvledger-thread")
    assert list(pr) == ["kvledger"]
    for k in ("tok_per_s", "ttft_p99_ms", "itl_p50_ms"):
        ratios = [r1[k] / r2[k] for r1, r2 in zip(one, two, strict=True)]
        got = pr["kvledger"][2][k]
        assert got["pairs"] == 2 and got["median_ratio"] == pytest.approx(statistics.median(ratios))
        wins = sum(x > 1 if k == "tok_per_s" else x < 1 for x in ratios)
        assert got["better"] == wins
    print_paired(report, base="kvledger-thread")
    assert "| 2 | kvledger | " in capsys.readouterr().out
    assert paired(report) == {}  # no vLLM in this report


def test_vllm_random_dataset_prompts_are_all_served(bench_server):
    """What `vllm bench serve --dataset-name random` sends (vLLM is not installed here: its
    RandomDataset's prompts, reproduced by benchmarks/vllm_bench_serve.py, through the openai
    client): runs of token ids decoded to text, NUL (<0x00>) in some of them. Every one is a 200,
    and the prompt's tokens are the tokenizer's own for that text."""
    import openai
    from transformers import AutoTokenizer

    from benchmarks.vllm_bench_serve import random_dataset_prompts

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    prompts = random_dataset_prompts(tok, 120, 32, seed=0)
    assert sum("\x00" in p for p in prompts) >= 3  # the requests vLLM's client saw refused
    client = openai.OpenAI(base_url=f"{bench_server.url}/v1", api_key="x", max_retries=0)
    for p in prompts:
        r = client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=4, extra_body={"ignore_eos": True, "return_token_ids": True}
        )
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].prompt_token_ids == tok(p).input_ids


def test_vllm_bench_serve_script_runs_vllms_client_or_says_what_is_missing(tmp_path, capsys):
    from benchmarks.vllm_bench_serve import bench_command, main, parse_args, summarize

    assert main(["--vllm-venv", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"no vLLM venv at {tmp_path / 'none'}") and "\n" not in err
    a = parse_args(["--vllm-venv", str(tmp_path), "--num-prompts", "200"])
    cmd = bench_command(tmp_path, "http://127.0.0.1:1", "m", "/tok", a, tmp_path)
    assert cmd[:5] == [str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    assert cmd[cmd.index("--dataset-name") + 1] == "random" and "--save-result" in cmd
    failed, errors = summarize({"completed": 179, "errors": ["", "400 NUL", "400 NUL"]}, 200)
    assert failed == 21 and errors == ["400 NUL"]
