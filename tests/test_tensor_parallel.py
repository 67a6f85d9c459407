"""Tensor parallelism (kvledger/distributed): tp=2 over gloo must give the very tokens tp=1 gives
(float32 greedy), through prefix-cache hits, n > 1 copy-on-write, and swap and recompute
preemption, on a GQA model with 2 KV heads (one per rank) and an MQA model (its one KV head
replicated on both ranks); the ledger reports each rank's real pools; start-up refuses degrees
the model cannot be split by; and a rank that hangs fails the engine's requests in bounded time.

Spawning ranks costs seconds on 2 cores, so each model's engines are built once per module.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import kvledger.core.engine as engine_mod
from kvledger import LLM, SamplingParams
from kvledger.errors import ConfigError, EngineFailedError
from kvledger.ledger.accounting import ModelSpec, kv_bytes_per_token
from tests.model_factory import build_hf_model, tiny_config

BS = 4
# A small pool (36 blocks of 4 tokens) so the workload below must preempt; victims shorter
# than 24 computed tokens are recomputed, longer ones swapped (both modes happen).
ENGINE = dict(block_size=BS, num_kv_blocks=36, swap_space=0.001, recompute_threshold=24,
              calibrate_preemption=False, max_num_seqs=8)
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 3 full blocks, shared


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [PREFIX + [30 + i, 40 + i] for i in range(5)] + [[50, 51, 52], PREFIX + [60]]
    params = [SamplingParams(temperature=0, max_tokens=28, ignore_eos=True) for _ in prompts]
    params[-1] = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)  # COW
    return prompts, params


def run(llm: LLM) -> list[list[list[int]]]:
    prompts, params = workload()
    # The first request fills the prefix cache; the rest hit it.
    first = llm.generate([prompts[0]], params[0], use_tqdm=False)
    rest = llm.generate(prompts[1:], params[1:], use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in first + rest]


@pytest.fixture(scope="module", params=["llama_gqa", "llama_mqa"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_hf_model(tiny_config(request.param), folder)
    tp1 = LLM(str(folder), **ENGINE)
    tp2 = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    yield request.param, folder, tp1, tp2
    tp2.llm_engine.shutdown()


def test_tp2_is_token_identical_to_tp1(pair):
    kind, _, tp1, tp2 = pair
    want = run(tp1)
    got = run(tp2)
    assert got == want, kind
    a, b = tp1.ledger(), tp2.ledger()
    # The same scheduling happened: prefix hits, COW for n > 1, both preemption modes.
    assert b.prefix_cache_hits == a.prefix_cache_hits > 0
    assert b.cow_copies == a.cow_copies > 0
    assert b.preemptions == a.preemptions
    assert b.preemptions["swap"] > 0 and b.preemptions["recompute"] > 0, b.preemptions


def test_ledger_reports_each_ranks_pool(pair):
    kind, folder, tp1, tp2 = pair
    import json

    spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    a, b = tp1.ledger(), tp2.ledger()
    per_rank = kv_bytes_per_token(spec, "auto", tp=2).total * BS  # `kvledger plan --tp 2`
    assert b.tensor_parallel_size == 2 and [r["rank"] for r in b.ranks] == [0, 1]
    assert b.bytes_per_block == per_rank
    for r in b.ranks:
        assert r["bytes_per_block"] == per_rank and r["kv_heads"] == 1
        assert r["device_pool_bytes"] == b.total_blocks * per_rank
        assert r["pid"] != os.getpid()
    assert b.model_bytes_per_block == 2 * per_rank
    if kind == "llama_gqa":  # 2 KV heads split: together the ranks hold what one device holds
        assert b.model_bytes_per_block == a.bytes_per_block
    else:  # MQA: the one KV head lives on both ranks, and the ledger counts it twice
        assert b.model_bytes_per_block == 2 * a.bytes_per_block
    assert b.device_pool_bytes == 2 * b.total_blocks * per_rank


def test_start_up_refuses_what_cannot_be_split(pair, monkeypatch):
    _, folder, _, _ = pair
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide .* 4 attention heads"):
        LLM(str(folder), tensor_parallel_size=3, **ENGINE)
    monkeypatch.setattr(engine_mod, "_num_cpus", lambda: 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 exceeds the 2 CPU core"):
        LLM(str(folder), tensor_parallel_size=4, **ENGINE)
    with pytest.raises(ConfigError, match="overlay .* not supported with tensor_parallel_size"):
        LLM(str(folder), tensor_parallel_size=2, kv_cache_dtype="int8", **ENGINE)


def test_a_hung_rank_fails_the_requests_in_bounded_time(tmp_path):
    build_hf_model(tiny_config("llama_gqa"), tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, tp_step_timeout=3, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    pid = llm.ledger().ranks[1]["pid"]
    os.kill(pid, signal.SIGSTOP)  # rank 1 hangs
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineFailedError, match="rank"):
            llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert not llm.llm_engine.has_unfinished_requests()  # every request was failed and freed
    with pytest.raises(EngineFailedError):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
