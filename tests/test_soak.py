"""Soak, structurally: after finished, aborted, disconnected and refused requests, no
per-request state survives anywhere in the server - the engine's, the scheduler's, the block
manager's, the quantised overlay's, the async front end's and the metrics' dictionaries are
empty again. A server that keeps nothing per finished request cannot grow with the requests it
has served (issue 23; benchmarks/soak.py measures the memory itself)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest
import uvicorn
from test_server import STORIES, free_port

from kvledger.engine.builder import build_engine
from kvledger.llm import build_engine_config
from kvledger.server.app import ServerConfig, build_app


def per_request_state(app) -> dict[str, int]:
    """Sizes of every per-request dictionary the server keeps."""
    aengine, metrics = app.state.engine, app.state.metrics
    eng = aengine.engine
    sizes = {
        "engine.groups": len(eng.groups),
        "scheduler.requests": len(eng.scheduler.requests),
        "scheduler.queues": len(eng.scheduler.waiting)
        + len(eng.scheduler.running)
        + len(eng.scheduler.swapped),
        "kv.requests": len(eng.kv.requests),
        "async_engine.streams": len(aengine.streams),
        "metrics.last": len(metrics._last),
    }
    runner = eng.executor.worker.runner
    sizes["runner.requests"] = len(runner.requests)
    sizes["runner.block_table"] = len(runner.block_table)
    if runner.overlay is not None:
        sizes["overlay.states"] = len(runner.overlay.states)
    return sizes


@pytest.fixture(scope="module", params=["auto", "int8"])
def live_app(request):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    engine = build_engine(
        build_engine_config(
            str(STORIES),
            num_kv_blocks=64,  # small: the load below preempts
            kv_cache_dtype=request.param,
            calibrate_preemption=False,
        )
    )
    app = build_app(engine, ServerConfig(served_model_names=["m"]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield app, url
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.engine.shutdown()


async def _traffic(url: str, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = "once upon a time there was a little girl named lily who loved the park".split()
    statuses: list[int] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 60)))
        kind = i % 5
        body = {"prompt": prompt, "max_tokens": rng.randint(5, 120), "temperature": 0.8}
        if kind == 4:  # refused: asks for more than the context holds
            body["max_tokens"] = 10_000
        if kind in (0, 1, 2):
            body["stream"] = True
            async with client.stream("POST", "/v1/completions", json=body) as r:
                statuses.append(r.status_code)
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if kind == 0 and chunks >= 2:
                        break  # hang up mid-stream
        else:
            try:
                r = await client.post("/v1/completions", json=body, timeout=0.05 if kind == 3 else 60)
                statuses.append(r.status_code)
            except httpx.TimeoutException:
                statuses.append(-1)  # gave up waiting: the server sees a disconnect

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        sem = asyncio.Semaphore(12)

        async def guarded(i: int) -> None:
            async with sem:
                await one(client, i)

        await asyncio.gather(*(guarded(i) for i in range(n)))
    return statuses


def test_no_per_request_state_survives_finished_aborted_or_refused_requests(live_app):
    app, url = live_app
    statuses = asyncio.run(_traffic(url, 60, seed=1))
    assert 400 in statuses and 200 in statuses
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(per_request_state(app).values()):
        time.sleep(0.05)  # aborts after a hang-up reach the engine between steps
    assert per_request_state(app) == dict.fromkeys(per_request_state(app), 0)
    eng = app.state.engine.engine
    assert eng.kv.num_used_blocks == 0
    assert sum(eng.scheduler.num_preemptions.values()) > 0, "the load was meant to preempt"


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (mallinfo2), mmap'd chunks included."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_every_gemm_shape_a_step_can_bring_exists_before_the_first_request(stories_path):
    """oneDNN keeps a primitive per GEMM shape; created lazily, the rarer row buckets made a
    server's memory creep for thousands of requests (110 MiB for this 1 MB model). A serving
    engine creates them at start-up, so no row count a step can bring allocates one later
    (without it this test sees ~100 MiB allocated)."""
    import torch

    from kvledger import LLM
    from kvledger.model.layers import Linear

    llm = LLM(str(stories_path), num_kv_blocks=64, calibrate_preemption=False, warm_up_gemm_shapes=True)
    eng = llm.llm_engine
    sc = eng.config.scheduler
    model = eng.executor.worker.model
    head = model.__dict__.get("tied_head") or model.lm_head
    linears = {}  # one per weight shape, with the most rows a step gives it
    for m in [*model.modules(), head]:
        if isinstance(m, Linear) and m.packed is not None:
            rows = sc.max_num_seqs if m is head else sc.max_num_batched_tokens
            linears.setdefault((tuple(m.weight.shape), m.bias is None), (m, rows))
    assert len(linears) >= 4
    before = _malloc_in_use()
    with torch.inference_mode():
        for lin, most in linears.values():
            for rows in range(1, most + 1, 5):  # hits every bucket (55 up to 2,048 rows)
                lin(torch.zeros(rows, lin.weight.shape[1]))
    grown = _malloc_in_use() - before
    assert grown < 4 << 20, f"{grown / 2**20:.1f} MiB allocated by GEMM shapes seen after start-up"
def test_a_whole_text_bpe_cache_stops_growing_after_a_thousand_prompts(stories_path):
    """stories260k's BPE has no pre-tokenizer: each prompt is one cached "word". The loader bounds
    that cache, so unique prompts stop costing memory after 1,000 of them (the default 10,000
    entries grew a server by 44 MiB over its first ~27,000 requests)."""
    import random

    from kvledger.hf.tokenizer import BPE_CACHE_WHOLE_TEXT, load_tokenizer

    tok = load_tokenizer(stories_path)
    assert tok.backend_tokenizer.pre_tokenizer is None
    rng = random.Random(0)
    words = "once upon a time there was a little girl named lily she loved the park".split()

    def encode(n: int) -> None:
        for _ in range(n):  # unique prompts under 256 bytes: every one is cached until full
            tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))))

    encode(BPE_CACHE_WHOLE_TEXT)  # fill it
    start = _malloc_in_use()
    encode(5_000)
    grown = _malloc_in_use() - start
    assert grown < 1 << 20, f"{grown / 2**20:.1f} MiB for 5,000 more unique prompts"
