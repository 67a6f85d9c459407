"""kvledger's HTTP server against llama.cpp's ``llama-server`` on the same GGUF file, 64 streams
in flight (issue 42).

The file: benchmarks/vs_llamacpp.py's bench-230m in a format (default Q4_0). Each server is
started alone, warmed with 4 requests, then given the load; the other is down meanwhile.

- kvledger: ``kvledger serve FILE --tokenizer HF --dtype bfloat16 --torch-threads T
  --max-model-len 1024 --kv-cache-memory 2GiB``, streamed ``/v1/completions`` with token-id
  prompts and ``return_token_ids``;
- llama.cpp: ``llama-server -m FILE -t T -np 64 -c 65536 -cb`` (64 slots of 1,024 tokens,
  continuous batching), streamed ``/completion`` with token-id prompts, ``return_tokens``,
  ``cache_prompt`` false.

The load: 64 requests, prompts of 32-256 random token ids, 16-64 new tokens (no long tail: every
request fits a llama.cpp slot), greedy, ignore_eos, C requests in flight (default 64), aiohttp.
Figures: generated tok/s over the load, TTFT p50/p99 (request sent -> first token).

    python -m benchmarks.serve_vs_llamacpp [--format Q4_0] [--threads 2] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_OUT, REPO_ROOT, make_workload, print_header
from benchmarks.vs_llamacpp import gguf_files, llamacpp_dir
from benchmarks.vs_vllm_serve import Server, free_port
from kvledger.sim.simulator import percentile


def kvledger_server(f: Path, tokenizer: Path, threads: int, log: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "kvledger", "serve", str(f), "--tokenizer", str(tokenizer), "--port", str(port),
           "--dtype", "bfloat16", "--torch-threads", str(threads), "--max-model-len", "1024",
           "--kv-cache-memory", "2GiB", "--served-model-name", "bench", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return Server("kvledger", cmd, env, log, port)


def llamacpp_server(tools: Path, f: Path, threads: int, slots: int, log: Path) -> Server:
    port = free_port()
    cmd = [str(tools / "bin" / "llama-server"), "-m", str(f), "--port", str(port), "--host", "127.0.0.1",
           "-t", str(threads), "-np", str(slots), "-c", str(slots * 1024), "-cb"]  # fmt: skip
    return Server("llama.cpp", cmd, dict(os.environ), log, port)


def _request(engine: str, req: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if engine == "kvledger":
        return "/v1/completions", {"model": "bench", "prompt": req["prompt_token_ids"], "max_tokens": req["max_tokens"],
                                   "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    return "/completion", {"prompt": req["prompt_token_ids"], "n_predict": req["max_tokens"], "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "return_tokens": True, "cache_prompt": False}


def _tokens(engine: str, chunk: dict[str, Any]) -> list[int]:
    if engine == "kvledger":
        return [t for c in chunk.get("choices", []) for t in (c.get("token_ids") or [])]
    return list(chunk.get("tokens") or [])


async def _one(session: Any, url: str, engine: str, req: dict[str, Any]) -> dict[str, Any]:
    path, body = _request(engine, req)
    res: dict[str, Any] = {"ttft": None, "tokens": [], "error": None}
    t0 = time.perf_counter()
    try:
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                ids = _tokens(engine, chunk)
                if ids and res["ttft"] is None:
                    res["ttft"] = time.perf_counter() - t0
                res["tokens"] += ids
                if engine != "kvledger" and chunk.get("stop") and "tokens_predicted" in chunk:
                    # llama-server holds back tokens of an unfinished UTF-8 sequence; its last
                    # chunk counts them all
                    res["tokens"] = res["tokens"] + [-1] * (chunk["tokens_predicted"] - len(res["tokens"]))
    except Exception as e:  # reported, not fatal
        res["error"] = f"{type(e).__name__}: {e}"
    return res


async def _drive(url: str, engine: str, workload: list[dict[str, Any]], concurrency: int) -> tuple[list[dict], float]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency + 4, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1200)) as session:

        async def bounded(req):
            async with sem:
                return await _one(session, url, engine, req)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(r) for r in workload))
    return list(results), time.perf_counter() - t0


def measure(server: Server, workload: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    server.start()
    try:
        asyncio.run(_drive(server.url, server.engine, workload[:4], 4))  # warm-up
        results, wall = asyncio.run(_drive(server.url, server.engine, workload, concurrency))
    finally:
        server.stop()
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    return {
        "tok_per_s": sum(len(r["tokens"]) for r in results) / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "errors": [r["error"] for r in results if r["error"]][:3],
        "short": sum(len(r["tokens"]) < w["max_tokens"] for r, w in zip(results, workload, strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-230m-v512")
    ap.add_argument("--format", default="Q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=64)
    a = ap.parse_args()
    tools = llamacpp_dir()
    f = gguf_files(a.model, [a.format], tools)[a.format]
    print_header(f"kvledger serve vs llama-server, same GGUF ({a.model} {a.format}), {a.concurrency} streams, "
                 f"{a.threads} thread(s)")  # fmt: skip
    workload = make_workload(a.requests, seed=0, long_frac=0.0, vocab_size=512)
    logs = BENCH_OUT / "serve_vs_llamacpp"
    ref = measure(llamacpp_server(tools, f, a.threads, a.concurrency, logs / "llama.log"), workload, a.concurrency)
    got = measure(kvledger_server(f, f.parent / "hf", a.threads, logs / "kvledger.log"), workload, a.concurrency)
    for name, r in (("llama.cpp", ref), ("kvledger", got)):
        print(f"{name:10} {r['tok_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.0f} ms  p99 {r['ttft_p99_ms']:8.0f} ms"
              f"  short outputs {r['short']}  errors {r['errors']}")  # fmt: skip
    print(f"kvledger / llama.cpp: tok/s {got['tok_per_s'] / ref['tok_per_s']:.2f}x, "
          f"TTFT p99 {got['ttft_p99_ms'] / ref['ttft_p99_ms']:.2f}x")


if __name__ == "__main__":
    main()
