"""`kvledger serve` under load: 64 concurrent streaming clients (openai.AsyncOpenAI) against
stories260k, greedy, mixed prompt and output lengths. Every response must be complete and
identical to the offline API's (`LLM(...).generate` on the same model and options), and the
pool must end with zero used blocks, also when half the clients hang up mid-stream.

Client-side TTFT / inter-token latency percentiles are printed (run with -s to see them) and
written as JSON to $KVLEDGER_SERVER_LOAD_REPORT when set (docs/server_notes.md quotes them).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import time

import openai
import pytest
import torch
from test_server import STORIES, ServerProcess

from kvledger import envs

NUM_CLIENTS = 64
SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her red ball.",
    "One day, Tom saw a big dog under a tall tree.",
    "The sun was warm and the birds sang happy songs.",
    'Mom said, "Be careful and come home before dark."',
    "They found a shiny box near the pond and opened it.",
    "Inside was a tiny cat that wanted a friend.",
    "Ben and Sue built a tower of blocks in the kitchen.",
]


def workload(seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: 1-8 sentences (16-207 tokens), 4-128 output tokens.
    Many prompts open with the same sentence, so the prefix cache is exercised too."""
    rng = random.Random(seed)
    out = []
    for _ in range(NUM_CLIENTS):
        k = rng.randint(1, 8)
        prompt = " ".join(rng.choice(SENTENCES) for _ in range(k))
        out.append((prompt, rng.choice([4, 8, 16, 32, 48, 64, 96, 128])))
    return out


@pytest.fixture(scope="module")
def server(shared_stories_server):
    """A plain generate server (shared with tests/test_server_embeddings.py); not waited for
    here, so that the reference is computed while it starts."""
    return shared_stories_server(wait=False)


@pytest.fixture(scope="module")
def reference(server):
    """The offline API's greedy outputs for the workload (built while the server starts)."""
    from kvledger import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Calibration only times the machine; it never changes a token.
        llm = LLM(str(STORIES), calibrate_preemption=False)
        work = workload()
        params = [SamplingParams(temperature=0, max_tokens=m) for _, m in work]
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    server.wait_ready()
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


async def stream_one(
    client: openai.AsyncOpenAI,
    prompt: str,
    max_tokens: int,
    hang_up_after: int | None = None,
    **extra,
):
    """One streaming client: (text, finish reason, request start, text chunk times, tokens)."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=str(STORIES), prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra or None,
    )  # fmt: skip
    text, reason, times, tokens = "", None, [], 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.text:
            times.append(time.perf_counter())
            text += c.text
        reason = c.finish_reason or reason
        if hang_up_after is not None and len(times) >= hang_up_after:
            await stream.close()
            return None
    return text, reason, t0, times, tokens


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive")
    return {"p50_ms": round(q[49] * 1e3, 2), "p99_ms": round(q[98] * 1e3, 2), "n": len(xs)}


def used_blocks(server: ServerProcess) -> tuple[float, dict]:
    led = server.wait_idle()
    return server.metrics()["kvledger:kv_blocks_used"], led


def test_64_streaming_clients_match_the_offline_api(server, reference):
    work = workload()

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300
        )
        t0 = time.perf_counter()
        async with client:
            results = await asyncio.gather(*(stream_one(client, p, m) for p, m in work))
        return results, time.perf_counter() - t0

    before = server.metrics()
    results, wall = asyncio.run(main())
    for i, (res, ref) in enumerate(zip(results, reference)):
        assert (res[0], res[1]) == ref, f"client {i}: {res[:2]} != offline {ref}"
    ttft = [r[3][0] - r[2] for r in results if r[3]]
    gaps = [b - a for r in results for a, b in zip(r[3], r[3][1:])]
    # Per request: (last text chunk - first) / (tokens - 1), i.e. vLLM's TPOT.
    tpot = [(r[3][-1] - r[3][0]) / (r[4] - 1) for r in results if len(r[3]) > 1 and r[4] > 1]
    report = {
        "clients": NUM_CLIENTS,
        "output_tokens": sum(r[4] for r in results),
        "wall_s": round(wall, 2),
        "ttft": percentiles(ttft),
        "inter_token_per_request": percentiles(tpot),
        "inter_chunk_gaps": percentiles(gaps),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "command": "python -m pytest tests/test_server_load.py -s",
    }
    blocks, led = used_blocks(server)
    after = server.metrics()
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        n = after[f"kvledger:{name}_count"] - before.get(f"kvledger:{name}_count", 0)
        total = after[f"kvledger:{name}_sum"] - before.get(f"kvledger:{name}_sum", 0)
        report[f"server_{name}_mean_ms"] = round(total / max(n, 1) * 1e3, 2)
    report["load_average_1m"] = round(os.getloadavg()[0], 2)
    print("\nserver load:", json.dumps(report))
    if envs.KVLEDGER_SERVER_LOAD_REPORT:
        with open(envs.KVLEDGER_SERVER_LOAD_REPORT, "w") as f:
            json.dump(report, f, indent=2)
    assert blocks == 0 and led["used_blocks"] == 0 and led["requests"] == {}
    assert led["num_requests"] == {"running": 0, "waiting": 0, "swapped": 0}


def test_half_the_clients_hang_up_early_without_leaking(server, reference):
    work = workload()
    before = server.metrics().get("kvledger:request_success_total{finished_reason=abort}", 0)

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300
        )
        async with client:
            return await asyncio.gather(
                *(
                    stream_one(client, p, 300, hang_up_after=3, ignore_eos=True)
                    if i % 2
                    else stream_one(client, p, m)
                    for i, (p, m) in enumerate(work)
                )
            )

    results = asyncio.run(main())
    for i, (res, ref) in enumerate(zip(results, reference)):
        if i % 2 == 0:
            assert (res[0], res[1]) == ref, f"client {i}: {res[:2]} != offline {ref}"
        else:
            assert res is None
    blocks, led = used_blocks(server)
    assert blocks == 0 and led["used_blocks"] == 0 and led["requests"] == {}
    after = server.metrics()["kvledger:request_success_total{finished_reason=abort}"]
    assert after - before == NUM_CLIENTS // 2  # each hang-up was aborted, none ran to the end


def test_the_front_end_runs_on_uvloop_and_httptools():
    """`kvledger serve` leaves uvicorn's loop and HTTP parser on "auto", which take uvloop and
    httptools when installed, as in vLLM (uvicorn[standard]). They are dependencies because
    they cut the front end's CPU per streamed token by ~30 % (docs/measurements/serving_settings.md,
    the uvloop section): without them uvicorn silently falls back to asyncio's loop and h11."""
    import uvicorn
    import uvloop

    config = uvicorn.Config(app=lambda scope, receive, send: None)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    loop = config.get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
