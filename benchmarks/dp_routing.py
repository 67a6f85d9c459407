"""Data-parallel routing on a multi-tenant workload: round-robin vs sglang-router's cache_aware
vs kvledger's exact cache-aware dispatch, over the same 2 kvledger replicas (1 thread each).

    python -m benchmarks.dp_routing [--num-requests 512] [--rate 4] [--num-kv-blocks 768]

Workload (``multi_tenant_workload``): 16 tenants, each a system prompt of 500-2,000 tokens;
512 requests arriving Poisson at ``--rate``/s, each a tenant's system prompt (chosen uniformly)
plus a 20-80-token question, answering 16-64 tokens (``ignore_eos``, greedy), streamed
``/v1/completions``. Prompts are text (random lowercase words, lengths measured with the
model's tokenizer): sglang-router refuses token-id prompts. The model: kvledger-tiny's weights (random, 4 layers
x 256, float32) with its context raised to 4,096 positions, so 2,000-token prompts fit. Each
replica's pool (``--num-kv-blocks`` x 16 tokens) holds about half the tenants' prompts: where a
request lands decides whether its prefix is cached.

Arms, each on freshly started replicas (empty caches), the same arrivals:
- ``round_robin``: ``kvledger router --dp-routing round_robin``;
- ``sglang cache_aware``: ``python -m sglang_router.launch_router --policy cache_aware``
  (defaults: cache threshold 0.3, balance thresholds 64 / 1.5);
- ``kvledger cache_aware``: ``kvledger router --dp-routing cache_aware`` on the replicas' KV events.

Figures: output tokens/s over the run (first send to last finish), TTFT (send -> first SSE
chunk) p50/p99, and the prefix hit rate (cached prompt tokens / prompt tokens, from both
replicas' /v1/ledger counters), plus the foreign CPU (other processes' cores meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import BENCH_OUT, REPO_ROOT, ContentionProbe, machine_info
from benchmarks.vs_vllm_serve import Server, free_port
from kvledger.sim.simulator import percentile

MODEL_NAME = "bench"
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni")


@dataclass
class Req:
    arrival: float
    tenant: int
    question: str
    max_tokens: int


def _words(rng: random.Random, tok, target: int) -> str:
    """Random lowercase words whose tokenization is ``target`` tokens, or just under."""
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        for _ in range(target)
    ]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that fit in target tokens
        mid = (lo + hi + 1) // 2
        if len(tok(" ".join(words[:mid]), add_special_tokens=False).input_ids) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def multi_tenant_workload(
    tok,
    num_requests: int = 512,
    rate: float = 4.0,
    num_tenants: int = 16,
    prompt_range: tuple[int, int] = (500, 2000),
    question_range: tuple[int, int] = (20, 80),
    output_range: tuple[int, int] = (16, 64),
    seed: int = 0,
) -> tuple[list[str], list[Req]]:
    """(tenant system prompts, requests with Poisson arrivals), as text: sglang-router's
    /v1/completions takes text prompts only (a token-id list is refused)."""
    rng = random.Random(seed)
    prompts = [_words(rng, tok, rng.randint(*prompt_range)) + "\n" for _ in range(num_tenants)]
    t, reqs = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        q = _words(rng, tok, rng.randint(*question_range))
        reqs.append(Req(t, rng.randrange(num_tenants), q, rng.randint(*output_range)))
    return prompts, reqs


def model_folder() -> Path:
    from kvledger.model.tiny import default_model_path

    src, dst = default_model_path(), BENCH_OUT / "models" / "dp-tiny-4k"
    if not (dst / "model.safetensors").exists():
        dst.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if p.is_file():
                shutil.copy(p, dst / p.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["max_position_embeddings"] = 4096
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _env() -> dict[str, str]:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        paths.append(str(REPO_ROOT))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}


def start_replicas(folder: Path, a: argparse.Namespace, out: Path, tag: str) -> tuple[list[Server], list[str]]:
    servers, events = [], []
    for i in range(a.replicas):
        port, ev = free_port(), f"tcp://127.0.0.1:{free_port()}"
        cfg = {"enable_kv_cache_events": True, "endpoint": ev.replace("127.0.0.1", "*")}
        cmd = [sys.executable, "-m", "kvledger", "serve", str(folder), "--port", str(port),
               "--served-model-name", MODEL_NAME, "--dtype", "float32", "--torch-threads", "1",
               "--num-kv-blocks", str(a.num_kv_blocks), "--log-level", "warning",
               "--kv-events-config", json.dumps(cfg)]  # fmt: skip
        servers.append(Server("kvledger", cmd, _env(), out / f"{tag}-replica{i}.log", port))
        events.append(ev)
    for s in servers:
        s.start()
    return servers, events


def start_router(kind: str, servers: list[Server], events: list[str], folder: Path, out: Path) -> Server:
    port = free_port()
    urls = [s.url for s in servers]
    if kind == "sglang":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "cache_aware", "--worker-urls", *urls, "--log-level", "warn",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "kvledger", "router", "--port", str(port), "--dp-routing", kind,
               "--worker-urls", *urls, "--kv-events-endpoints", *events, "--tokenizer", str(folder)]  # fmt: skip
    r = Server(f"router-{kind}", cmd, _env(), out / f"router-{kind}.log", port)
    r.start()
    deadline = time.monotonic() + 60
    while kind == "sglang":  # workers register in the background
        try:
            if any(m["id"] == MODEL_NAME for m in httpx.get(f"{r.url}/v1/models", timeout=2).json().get("data", [])):
                break
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("sglang-router did not register the workers")
        time.sleep(0.3)
    return r


def ledger_counts(servers: list[Server]) -> tuple[int, int]:
    q = h = 0
    for s in servers:
        d = httpx.get(f"{s.url}/v1/ledger", timeout=10).json()
        q, h = q + d["prefix_cache_queries"], h + d["prefix_cache_hits"]
    return q, h


async def drive(url: str, prompts: list[str], reqs: list[Req]) -> dict[str, Any]:
    ttft: list[float] = []
    out_tokens = 0
    errors = 0
    t0 = time.perf_counter()
    last = t0

    async def one(client: httpx.AsyncClient, r: Req) -> None:
        nonlocal out_tokens, errors, last
        await asyncio.sleep(max(0.0, t0 + r.arrival - time.perf_counter()))
        body = {"model": MODEL_NAME, "prompt": prompts[r.tenant] + r.question, "max_tokens": r.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first = None
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    errors += 1
                    failures.append(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if first is None and d.get("choices"):
                        first = time.perf_counter()
                    if d.get("usage"):
                        out_tokens += d["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            errors += 1
            failures.append(f"{type(e).__name__}: {e}")
            return
        if first is not None:
            ttft.append(first - sent)
        last = max(last, time.perf_counter())

    failures: list[str] = []
    # Idle connections expire before the router's 5 s keep-alive, so the client never sends on a
    # connection the server is closing (a transport error that is not the router's fault).
    limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as c:
        await asyncio.gather(*(one(c, r) for r in reqs))
    wall = last - t0
    if errors:
        print(f"  {errors} requests failed: " + "; ".join(sorted(set(failures))), flush=True)
    return {
        "duration_s": wall,
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "errors": errors,
    }


def run_arm(kind: str, folder: Path, a: argparse.Namespace, prompts, reqs, out: Path) -> dict[str, Any]:
    servers, events = start_replicas(folder, a, out, kind)
    router = None
    try:
        router = start_router(kind, servers, events, folder, out)
        q0, h0 = ledger_counts(servers)
        with ContentionProbe() as probe:
            res = asyncio.run(drive(router.url, prompts, reqs))
        q1, h1 = ledger_counts(servers)
        res["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        res["foreign_cores_avg"] = probe.as_dict()["foreign_cores_avg"]
        return res
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--num-kv-blocks", type=int, default=768, help="per replica, 16 tokens each")
    ap.add_argument("--replicas", type=int, default=2,
                    help="kvledger replicas (1 thread each; more than the cores share them)")
    ap.add_argument("--arms", default="round_robin,sglang,cache_aware")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    m = machine_info()
    flags = open("/proc/cpuinfo").read()
    print(f"== dp_routing: {a.replicas} kvledger replicas x 1 thread behind a router")
    print(f"command : {' '.join(sys.orig_argv)}")
    print(f"machine : {m['cpu_model']}, {m['cores']} cores; flags: {' '.join(f for f in CPU_FLAGS if f in flags)}")
    folder = model_folder()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts, reqs = multi_tenant_workload(tok, a.num_requests, a.rate, seed=a.seed)
    plen = [len(tok(p).input_ids) for p in prompts]
    print(f"workload: {len(prompts)} tenants, system prompts {min(plen)}-{max(plen)} tokens "
          f"({sum(plen)} in all), {len(reqs)} requests at {a.rate}/s Poisson; "
          f"pool {a.num_kv_blocks} blocks x 16 tokens per replica")
    out = BENCH_OUT / "dp_routing"
    out.mkdir(parents=True, exist_ok=True)
    names = {"round_robin": "round-robin (kvledger router)", "sglang": "sglang-router cache_aware",
             "cache_aware": "kvledger exact cache-aware"}
    results = {}
    for kind in a.arms.split(","):
        r = results[kind] = run_arm(kind, folder, a, prompts, reqs, out)
        print(f"{names[kind]:32s} {r['throughput_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s']:.3f} s "
              f"p99 {r['ttft_p99_s']:.3f} s  hit rate {r['prefix_hit_rate']:.3f}  errors {r['errors']}  "
              f"wall {r['duration_s']:.1f} s  foreign cores {r['foreign_cores_avg']:.2f}", flush=True)
    if "cache_aware" in results:
        ex = results["cache_aware"]
        for kind in ("round_robin", "sglang"):
            if kind in results:
                b = results[kind]
                print(f"exact / {kind}: throughput {ex['throughput_tok_s'] / b['throughput_tok_s']:.2f}x, "
                      f"hit rate {ex['prefix_hit_rate'] / max(b['prefix_hit_rate'], 1e-9):.2f}x, "
                      f"TTFT p50 {b['ttft_p50_s'] / ex['ttft_p50_s']:.2f}x lower, p99 {b['ttft_p99_s'] / ex['ttft_p99_s']:.2f}x lower")
    (out / "results.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=2))


if __name__ == "__main__":
    main()
