"""Per-token engine + server overhead of streaming, early (position ~100) vs late (~4,000).

Before incremental detokenization every step re-decoded each stream's whole output (and again
for stop strings), so the host work per token grew with the output length. This benchmark
streams 1 and 16 concurrent completions of 4,100 tokens through the real HTTP server and
measures, in one run:

* the client's inter-token time (ITL) over output positions 50-150 and 3,950-4,050 (with
  ``logprobs=0``, so that every token has its chunk and its position is known);
* the model's own time per step over the same positions (``ModelRunner.execute``, recorded
  inside the server): the attention's growth with the context, which is not overhead;
* the whole ``LLMEngine.step`` per step: step less model = the engine's host overhead
  (scheduling, bookkeeping, detokenization, stop checks, building outputs);
* ITL - model time per step: all host work (engine, asyncio, JSON, SSE, the client's parsing).

Peer: the same benchmark against kvledger before this change (``--baseline-rev``, default
8d031f8: whole-output re-decodes), its source unpacked from git into a temporary folder and
served from there (the version measured is unpacked from git too: ``--rev``, default HEAD). The model is the embedded ``kvledger-tiny`` (byte-level BPE, random
weights) with its context raised to 4,608 positions (RoPE needs no other change).

    python -m benchmarks.stream_overhead [--streams 1 16] [--tokens 4100] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BENCH_OUT, REPO_ROOT, kill_group, print_header

EARLY = (50, 150)
LATE = (3950, 4050)
MAX_LEN = 4608


# -- the server side (runs in a subprocess, with the kvledger under test on sys.path) ---------
def serve(port: int, model: str, max_num_seqs: int) -> None:
    import torch
    import uvicorn
    from fastapi.responses import JSONResponse

    from kvledger.core.engine import LLMEngine
    from kvledger.llm import build_engine_config
    from kvledger.server.app import ServerConfig, build_app

    torch.set_num_threads(1)
    engine = LLMEngine(
        build_engine_config(
            model,
            max_model_len=MAX_LEN,
            max_num_batched_tokens=MAX_LEN,
            max_num_seqs=max_num_seqs,
            calibrate_preemption=False,
        )
    )
    # Per step: (context length, model s, whole step s, model CPU s, whole step CPU s, the
    # server process's CPU s so far). CPU times (this thread's; torch runs on it with 1 thread)
    # do not count the time the OS gives other processes, so they hold on a loaded machine.
    steps: list[tuple[int, float, float, float, float, float]] = []
    execute, step = engine.runner.execute, engine.step
    model_s = [0.0, 0, 0.0]

    def timed_execute(so):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = execute(so)
        model_s[0], model_s[2] = time.perf_counter() - t0, time.thread_time() - c0
        model_s[1] = max((s.request.num_computed_tokens for s in so.scheduled), default=0)
        return out

    def timed_step():
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        steps.append((model_s[1], model_s[0], wall, model_s[2], cpu, time.process_time()))
        return outs

    engine.runner.execute = timed_execute
    engine.step = timed_step
    app = build_app(engine, ServerConfig(served_model_names=["m"], model_path=model))

    @app.get("/bench/steps")
    async def read_steps() -> JSONResponse:
        data = list(steps)
        steps.clear()
        return JSONResponse(data)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def calls_per_step(model: str, tokens: int) -> dict:
    """Python calls per engine step (cProfile) over the early and the late window, in-process,
    one DELTA stream with logprobs: a count that the machine's load cannot change. Equal counts
    mean the host work per token no longer grows with the output; the time the same calls take
    still can (caches cooled by attention over a longer context), so the slowdown of one
    function doing identical work at both positions (native.small_gemm) is reported with it."""
    import cProfile
    import pstats

    import torch

    from kvledger import LLM, SamplingParams
    from kvledger.sampling_params import RequestOutputKind

    torch.set_num_threads(1)
    llm = LLM(model, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN, calibrate_preemption=False)
    eng = llm.llm_engine
    eng.stream_outputs = True
    params = SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0,
        output_kind=RequestOutputKind.DELTA,
    )
    eng.add_request([5, 9, 12, 40, 41, 42, 43, 44], params)
    profs = {"early": cProfile.Profile(), "late": cProfile.Profile()}
    step = 0
    while eng.has_unfinished_requests():
        prof = next((profs[n] for n, (lo, hi) in (("early", EARLY), ("late", LATE)) if lo <= step < hi), None)
        if prof is not None:
            prof.enable()
        eng.step()
        if prof is not None:
            prof.disable()
        step += 1
    out = {}
    for name, (lo, hi) in (("early", EARLY), ("late", LATE)):
        st = pstats.Stats(profs[name])
        gemm = sum(v[2] for fn, v in st.stats.items() if fn[2] == "small_gemm")
        out[name] = {"calls": st.total_calls / (hi - lo), "small_gemm_us": 1e6 * gemm / (hi - lo)}
    return out


# -- the client side ---------------------------------------------------------------------------
async def stream_one(client, prompt: list[int], tokens: int) -> list[float]:
    """Arrival time of each output token of one streamed completion."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,  # every token then gets a chunk, even one that adds no text yet
    }
    times = []  # arrival time of output token i
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                for ch in json.loads(line[6:])["choices"]:
                    times.extend([now] * len((ch.get("logprobs") or {}).get("tokens") or ()))
    return times


def window_itl(times: list[float], lo: int, hi: int) -> float:
    return (times[hi] - times[lo]) / (hi - lo)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def run_one(src: Path, model: Path, streams: int, tokens: int) -> dict:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO_ROOT}", "TOKENIZERS_PARALLELISM": "false"}
    code = f"from benchmarks.stream_overhead import serve; serve({port}, {str(model)!r}, {streams})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=src, start_new_session=True
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("the server did not start")

        async def main() -> list[list[float]]:
            async with httpx.AsyncClient(base_url=base, timeout=None) as client:
                await stream_one(client, [5, 6, 7, 8], 8)  # warm-up
                httpx.get(f"{base}/bench/steps")
                prompts = [[5 + i, 9, 12, 40, 41, 42, 43, 44] for i in range(streams)]
                return await asyncio.gather(*(stream_one(client, p, tokens) for p in prompts))

        busy0, srv0, own0 = busy_s(), cpu_s(proc.pid), time.process_time()
        t0 = time.perf_counter()
        all_times = asyncio.run(main())
        wall = time.perf_counter() - t0
        foreign = busy_s() - busy0 - (cpu_s(proc.pid) - srv0) - (time.process_time() - own0)
        steps = httpx.get(f"{base}/bench/steps").json()
    finally:
        kill_group(proc)
    res = {"streams": streams, "wall_s": wall, "foreign_cores": max(0.0, foreign) / wall}
    for name, (lo, hi) in (("early", EARLY), ("late", LATE)):
        itl = statistics.median(window_itl(t, lo, hi) for t in all_times)
        window = [r for r in steps if lo + 8 <= r[0] < hi + 8]
        m = statistics.fmean(r[1] for r in window)
        st = statistics.fmean(r[2] for r in window)
        m_cpu = statistics.fmean(r[3] for r in window)
        st_cpu = statistics.fmean(r[4] for r in window)
        # The whole server's CPU per step over the window (engine, event loop, JSON, SSE).
        proc_cpu = (window[-1][5] - window[0][5]) / max(1, len(window) - 1)
        res[name] = {
            "itl_ms": 1e3 * itl,
            "model_ms": 1e3 * m,
            "engine_overhead_ms": 1e3 * (st - m),
            "overhead_ms": 1e3 * (itl - m),
            "engine_overhead_cpu_ms": 1e3 * (st_cpu - m_cpu),
            "server_host_cpu_ms": 1e3 * (proc_cpu - m_cpu),
        }
    return res


def prepare_model() -> Path:
    from kvledger.model.tiny import default_model_path

    out = BENCH_OUT / "stream_overhead" / "kvledger-tiny-4k"
    if not (out / "model.safetensors").exists():
        shutil.copytree(default_model_path(), out, dirs_exist_ok=True)
        cfg = json.loads((out / "config.json").read_text())
        cfg["max_position_embeddings"] = MAX_LEN
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def unpack_rev(rev: str, into: Path) -> Path:
    """The kvledger package as of ``rev``, in a folder of its own (edits elsewhere can't leak in)."""
    into.mkdir(parents=True)
    tar = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", rev, "kvledger"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=4100)
    ap.add_argument("--rev", default="HEAD", help="the kvledger commit to measure")
    ap.add_argument("--baseline-rev", default="8d031f8", help="'' to skip the baseline")
    a = ap.parse_args()
    if a.tokens <= LATE[1]:
        ap.error(f"--tokens must exceed {LATE[1]}")
    print_header("streaming overhead per token: position ~100 vs ~4,000 (HTTP server, SSE)")
    model = prepare_model()
    print(f"model   : {model} (kvledger-tiny, context {MAX_LEN}); windows {EARLY} and {LATE}")
    with tempfile.TemporaryDirectory() as tmp:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", a.rev], capture_output=True, text=True
        ).stdout.strip()
        versions = [(f"kvledger @ {head}", unpack_rev(a.rev, Path(tmp) / "new"))]
        if a.baseline_rev:
            versions.append((f"kvledger @ {a.baseline_rev}", unpack_rev(a.baseline_rev, Path(tmp) / "old")))
        rows = []
        for streams in a.streams:
            for name, src in versions:
                r = run_one(src, model, streams, a.tokens)
                r["version"] = name
                rows.append(r)
                e, lt = r["early"], r["late"]
                print(
                    f"{name:<24} {streams:>2} streams | ITL ms {e['itl_ms']:6.2f} -> {lt['itl_ms']:6.2f}"
                    f" | model ms/step {e['model_ms']:6.2f} -> {lt['model_ms']:6.2f}"
                    f" (x{lt['model_ms'] / e['model_ms']:.2f})"
                    f" | engine overhead ms/step {e['engine_overhead_ms']:5.2f} -> "
                    f"{lt['engine_overhead_ms']:5.2f} (x{lt['engine_overhead_ms'] / e['engine_overhead_ms']:.2f})"
                    f" | ITL - model ms {e['overhead_ms']:5.2f} -> {lt['overhead_ms']:5.2f}"
                    f" (x{lt['overhead_ms'] / e['overhead_ms']:.2f})"
                    f" | foreign CPU {r['foreign_cores']:.2f} cores",
                    flush=True,
                )
                if "engine_overhead_cpu_ms" in e:
                    eng_x = lt["engine_overhead_cpu_ms"] / e["engine_overhead_cpu_ms"]
                    host_x = lt["server_host_cpu_ms"] / e["server_host_cpu_ms"]
                    print(
                        f"{'':<24} {'':>2}  CPU time | engine overhead ms/step"
                        f" {e['engine_overhead_cpu_ms']:5.3f} -> {lt['engine_overhead_cpu_ms']:5.3f}"
                        f" (x{eng_x:.2f}) | server host CPU ms/step"
                        f" {e['server_host_cpu_ms']:5.3f} -> {lt['server_host_cpu_ms']:5.3f}"
                        f" (x{host_x:.2f})",
                        flush=True,
                    )
    print(
        "(ITL: client inter-token time, mean over the window, median over streams; model:"
        " ModelRunner.execute per step; engine overhead: LLMEngine.step less the model;"
        " ITL - model: all host work per step (engine, asyncio, JSON, SSE, client) that"
        " the model time does not hide. CPU time: the same less the time other processes"
        " take: engine overhead = the engine thread's CPU per step less the model's; server"
        " host CPU = the server process's CPU per step less the model's (engine, event loop,"
        " JSON, SSE; not the client). x = late / early.)"
    )
    c = calls_per_step(str(model), a.tokens)
    e, lt = c["early"], c["late"]
    print(
        f"kvledger @ {head:<13} in-process | Python calls per engine step {e['calls']:.1f} -> "
        f"{lt['calls']:.1f} (x{lt['calls'] / e['calls']:.3f}) | native.small_gemm (same work)"
        f" us/step {e['small_gemm_us']:.0f} -> {lt['small_gemm_us']:.0f}"
        f" (x{lt['small_gemm_us'] / e['small_gemm_us']:.2f})",
        flush=True,
    )
    rows.append({"version": head, "calls_per_step": c})
    out = BENCH_OUT / "stream_overhead" / "result.json"
    out.write_text(json.dumps(rows, indent=2))
    print(f"results : {out}")


if __name__ == "__main__":
    main()
