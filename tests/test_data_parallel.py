"""`kvledger serve --data-parallel-size 2`: two engine-core processes behind one front end.
Cache-aware dispatch sends every request sharing a 1,000-token prefix to the core that caches
it; /v1/ledger reports each replica and the total; a core killed mid-stream fails its request
with an error naming it while the other keeps serving."""

from __future__ import annotations

import os
import random
import signal

import httpx
import openai
import pytest
from test_server import ServerProcess


def test_two_replicas_cache_aware_ledger_and_a_dead_replica(tmp_path):
    srv = ServerProcess("kvledger-tiny", "--torch-threads", "1", "-dp", "2", "--num-kv-blocks", "256",
                        log_path=tmp_path / "dp.log")
    try:
        srv.wait_ready()
        client = srv.client()
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
        blocks = [r["ledger"]["cached_blocks"] + r["ledger"]["used_blocks"] for r in reps]
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
    finally:
        srv.stop()
