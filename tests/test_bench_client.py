"""The serving benchmark's load generator (benchmarks/vs_vllm_serve.py) against a real
`kvledger serve`: its two HTTP clients must read the same streams the same way, so that a
figure never depends on which one measured it (only on how much CPU the client takes)."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.common import make_workload
from benchmarks.vs_vllm_serve import CLIENTS, MODEL_NAME, drive
from tests.test_server import STORIES, ServerProcess


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    log = tmp_path_factory.mktemp("bench_client") / "server.log"
    srv = ServerProcess(
        str(STORIES), "--served-model-name", MODEL_NAME, "--torch-threads", "1", "--no-dashboard",
        log_path=log,
    )  # fmt: skip
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
