"""`kvledger serve --data-parallel-size 2`: two engine-core processes behind one front end.
Cache-aware dispatch sends every request sharing a 1,000-token prefix to the core that caches
it; /v1/ledger reports each replica and the total; a core killed mid-stream fails its request
with an error naming it while the other keeps serving. One -dp 2 server serves the module."""

from __future__ import annotations

import os
import random
import re
import signal

import httpx
import openai
import pytest
from test_server import ServerProcess


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """One -dp 2 server for the module (a start costs two engine cores): the per-engine report
    runs first, the test that kills a replica last."""
    srv = ServerProcess("kvledger-tiny", "--torch-threads", "1", "-dp", "2", "--num-kv-blocks", "256",
                        log_path=tmp_path_factory.mktemp("dp") / "dp.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def per_engine(metrics: str, series: str) -> dict[str, float]:
    """A series' samples summed per engine label ("0", "1")."""
    pat = rf'^{re.escape(series)}\{{(?:[^}}]*,)?engine="(\d)"[^}}]*\}} (\S+)$'
    got: dict[str, float] = {}
    for m in re.finditer(pat, metrics, re.M):
        got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(2))
    return got


def test_dp2_reports_itself_per_engine(dp2):
    """-dp 2: vLLM's request-level series are labelled by the engine that served each request
    (their sums are the requests sent), /server_info says dp_size 2, /get_load lists both ranks."""
    from concurrent.futures import ThreadPoolExecutor

    srv = dp2
    client = srv.client()

    def one(i: int):
        return client.completions.create(model="kvledger-tiny", prompt=f"Tom had {i} dogs", max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(16)))
    srv.wait_idle()
    metrics = httpx.get(f"{srv.url}/metrics").text
    success = per_engine(metrics, "vllm:request_success_total")
    assert sum(success.values()) == 16 and set(success) == {"0", "1"}, success
    assert all(v > 0 for v in success.values()), success  # both engines served some
    prompt = per_engine(metrics, "vllm:prompt_tokens_total")
    assert sum(prompt.values()) == sum(o.usage.prompt_tokens for o in outs), prompt
    e2e = per_engine(metrics, "vllm:e2e_request_latency_seconds_count")
    assert e2e == success, (e2e, success)
    info = httpx.get(f"{srv.url}/server_info").json()
    assert (info["dp_size"], info["tp_size"]) == (2, 1)
    load = httpx.get(f"{srv.url}/get_load").json()
    assert [x["dp_rank"] for x in load] == [0, 1] and all(x["num_reqs"] == 0 for x in load), load


def _blocks(led: dict) -> list[int]:
    return [r["ledger"]["cached_blocks"] + r["ledger"]["used_blocks"] for r in led["replicas"]]


def test_two_replicas_cache_aware_ledger_and_a_dead_replica(dp2):
    srv = dp2
    client = srv.client()
    # Blocks each replica held before (the module's earlier requests): the prefix's land on one.
    before = _blocks(httpx.get(f"{srv.url}/v1/ledger").json())
    rng = random.Random(18)
    prefix = [rng.randrange(3, 500) for _ in range(1000)]
    cached = []
    for q in range(4):
        out = client.completions.create(model="kvledger-tiny", prompt=prefix + [10 + q] * 3,
                                        max_tokens=2, temperature=0)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and all(c >= 62 * 16 for c in cached[1:]), cached
    led = httpx.get(f"{srv.url}/v1/ledger").json()
    reps = led["replicas"]
    assert [r["alive"] for r in reps] == [True, True]
    blocks = [b - b0 for b, b0 in zip(_blocks(led), before, strict=True)]
    holder = max(range(2), key=blocks.__getitem__)
    assert blocks[holder] >= 62 and blocks[1 - holder] == 0, blocks
    assert led["total_blocks"] == 2 * 256 and led["prefix_cache_hits"] == sum(
        r["ledger"]["prefix_cache_hits"] for r in reps)
    metrics = httpx.get(f"{srv.url}/metrics").text
    hits = {i: f'vllm:prefix_cache_hits_total{{engine="{i}",model_name="kvledger-tiny"}}' for i in range(2)}
    assert all(h in metrics for h in hits.values()), metrics
    # Kill the holder while it streams: that request fails naming it; the other serves on.
    stream = client.completions.create(model="kvledger-tiny", prompt=prefix + [99], max_tokens=900,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(reps[holder]["pid"], signal.SIGKILL)
    with pytest.raises(openai.APIError, match=f"data-parallel replica {holder} died"):
        for _ in stream:
            pass
    for q in range(3):
        out = client.completions.create(model="kvledger-tiny", prompt=prefix + [40 + q], max_tokens=2, temperature=0)
        assert out.choices[0].text is not None
    assert httpx.get(f"{srv.url}/health").status_code == 200
    led = httpx.get(f"{srv.url}/v1/ledger").json()
    assert [r["alive"] for r in led["replicas"]] == [holder == 1, holder == 0]
