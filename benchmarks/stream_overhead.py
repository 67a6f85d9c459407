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

Per-step figures are medians over the window. The same host code runs slower after a long
attention (it has swept the caches), so ``--control on|both`` adds a control run: after every
step, outside every timing, a dummy attention tops the step's attention up to the late window's
size, making the attention work (and its aftermath) the same at both positions; what still
grows then is host work that grows with the output. ``--repeats N`` prints the median and range
of each late/early ratio over N runs.

Peer: the same benchmark against kvledger before this change (``--baseline-rev``, default
8d031f8: whole-output re-decodes), its source unpacked from git into a temporary folder and
served from there (the version measured is unpacked from git too: ``--rev``, default HEAD). The model is the embedded ``kvledger-tiny`` (byte-level BPE, random
weights) with its context raised to 4,608 positions (RoPE needs no other change).

    python -m benchmarks.stream_overhead [--streams 1 16] [--tokens 4100] [--baseline-rev REV]
        [--repeats N] [--control off|on|both]
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
def serve(port: int, model: str, max_num_seqs: int, control_tokens: int = 0) -> None:
    """``control_tokens`` > 0: after every model step, outside every timing, one decode attention
    per layer over ``max_num_seqs`` dummy contexts (distinct blocks of the pool) of
    ``control_tokens`` less the real context, so that the attention each step does, real plus
    dummy, is the same at every position. What attention's growth does to the code after it
    (cold caches and TLBs, besides its own time) is then the same early and late, and a
    late/early ratio above 1 is host work that grows."""
    import torch
    import uvicorn
    from fastapi.responses import JSONResponse

    from kvledger.engine.builder import build_engine
    from kvledger.llm import build_engine_config
    from kvledger.server.app import ServerConfig, build_app

    torch.set_num_threads(1)
    engine = build_engine(
        build_engine_config(
            model,
            max_model_len=MAX_LEN,
            max_num_batched_tokens=MAX_LEN,
            max_num_seqs=max_num_seqs,
            calibrate_preemption=False,
        )
    )
    # Per step: (context length, model s, whole step s less the control, model CPU s, whole step
    # CPU s less the control, the server process's CPU s so far less the control's, control s).
    # CPU times (this thread's; torch runs on it with 1 thread)
    # do not count the time the OS gives other processes, so they hold on a loaded machine.
    steps: list[tuple[int, float, float, float, float, float, float]] = []
    runner = engine.executor.worker.runner
    execute, step = runner.execute, engine.step
    model_s = [0.0, 0, 0.0, 0.0, 0.0]  # model wall, context, model CPU, control wall, control CPU
    control = _control_attention(engine, max_num_seqs, control_tokens) if control_tokens else None

    def timed_execute(so):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = execute(so)
        t1, c1 = time.perf_counter(), time.thread_time()
        model_s[0], model_s[2] = t1 - t0, c1 - c0
        model_s[1] = max(so.num_computed_tokens, default=0)
        if control is not None:
            control(model_s[1])
            model_s[3], model_s[4] = time.perf_counter() - t1, time.thread_time() - c1
        return out

    def timed_step():
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = step()
        wall, cpu = time.perf_counter() - t0 - model_s[3], time.thread_time() - c0 - model_s[4]
        control_cpu[0] += model_s[4]
        steps.append(
            (model_s[1], model_s[0], wall, model_s[2], cpu, time.process_time() - control_cpu[0], model_s[3])
        )
        model_s[3] = model_s[4] = 0.0
        return outs

    control_cpu = [0.0]  # the control attention's CPU so far, left out of the process CPU
    runner.execute = timed_execute
    engine.step = timed_step
    app = build_app(engine, ServerConfig(served_model_names=["m"], model_path=model))

    @app.get("/bench/steps")
    async def read_steps() -> JSONResponse:
        data = list(steps)
        steps.clear()
        return JSONResponse(data)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _control_attention(engine, rows: int, tokens: int):
    """A closure running native.paged_decode, given the real context, over `rows` contexts of
    `tokens` less that in every layer cache: each row reads its own blocks (wrapping round the
    pool, filled with small random values before the first request)."""
    import torch

    from kvledger.kernels import native

    caches = engine.executor.worker.runner.layer_caches
    num_blocks, block_size, num_kv_heads, head_dim = caches[0].k.shape
    cfg = engine.executor.worker.model.config
    num_heads = cfg.num_heads
    per_row = -(-tokens // block_size)
    tables = (torch.arange(rows * per_row, dtype=torch.int64) % num_blocks).view(rows, per_row)
    # Written once, before any request: a pool page never written reads as the kernel's shared
    # zero page, which would cost the control no memory traffic at all.
    used = tables.flatten().unique()
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        for t in (c.k, c.v):
            t[used] = 0.1 * torch.randn(t[used].shape, generator=gen, dtype=t.dtype)
    seq_lens = torch.full((rows,), tokens, dtype=torch.int64)
    idx = torch.arange(rows, dtype=torch.int64)
    q = torch.zeros(rows, num_heads, head_dim)
    out = torch.empty(rows, num_heads * head_dim)

    def run(context: int) -> None:
        seq_lens.fill_(max(1, tokens - context))
        for c in caches:
            native.paged_decode(q, c, tables, seq_lens, idx, out, 1.0)

    return run


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
    """Median gap between consecutive tokens in positions [lo, hi)."""
    return statistics.median(b - a for a, b in zip(times[lo:hi], times[lo + 1 : hi + 1]))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def run_one(src: Path, model: Path, streams: int, tokens: int, control_tokens: int = 0) -> dict:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO_ROOT}", "TOKENIZERS_PARALLELISM": "false"}
    code = (
        f"from benchmarks.stream_overhead import serve;"
        f" serve({port}, {str(model)!r}, {streams}, {control_tokens})"
    )
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
    # Medians per step: a GC pass or a time slice lost to another process moves a window's mean
    # by more than the differences measured here, and not its median.
    med = statistics.median
    for name, (lo, hi) in (("early", EARLY), ("late", LATE)):
        itl = med(window_itl(t, lo, hi) for t in all_times)
        idx = [i for i, r in enumerate(steps) if i > 0 and lo + 8 <= r[0] < hi + 8]
        window = [steps[i] for i in idx]
        m = med(r[1] for r in window)
        ctl = med(r[6] for r in window)  # the control's time, in the client's gaps too
        # The whole server's CPU per step (engine, event loop, JSON, SSE) less the model's.
        proc_cpu = med(steps[i][5] - steps[i - 1][5] - steps[i][3] for i in idx)
        res[name] = {
            "itl_ms": 1e3 * itl,
            "model_ms": 1e3 * m,
            "engine_overhead_ms": 1e3 * med(r[2] - r[1] for r in window),
            "overhead_ms": 1e3 * (itl - m - ctl),
            "control_ms": 1e3 * ctl,
            "engine_overhead_cpu_ms": 1e3 * med(r[4] - r[3] for r in window),
            "server_host_cpu_ms": 1e3 * proc_cpu,
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


def print_run(r: dict) -> None:
    e, lt = r["early"], r["late"]
    tag = " control" if r["control_tokens"] else ""
    print(
        f"{r['version']:<24} {r['streams']:>2} streams{tag} | ITL ms {e['itl_ms']:6.2f} -> {lt['itl_ms']:6.2f}"
        f" | model ms/step {e['model_ms']:6.2f} -> {lt['model_ms']:6.2f}"
        f" (x{lt['model_ms'] / e['model_ms']:.2f})"
        f" | engine overhead ms/step {e['engine_overhead_ms']:5.3f} -> "
        f"{lt['engine_overhead_ms']:5.3f} (x{lt['engine_overhead_ms'] / e['engine_overhead_ms']:.2f})"
        f" | ITL - model ms {e['overhead_ms']:5.3f} -> {lt['overhead_ms']:5.3f}"
        f" (x{lt['overhead_ms'] / e['overhead_ms']:.2f})"
        f" | foreign CPU {r['foreign_cores']:.2f} cores",
        flush=True,
    )
    print(
        f"{'':<24} {'':>2}  CPU time | engine overhead ms/step"
        f" {e['engine_overhead_cpu_ms']:5.3f} -> {lt['engine_overhead_cpu_ms']:5.3f}"
        f" (x{lt['engine_overhead_cpu_ms'] / e['engine_overhead_cpu_ms']:.2f}) | server host CPU ms/step"
        f" {e['server_host_cpu_ms']:5.3f} -> {lt['server_host_cpu_ms']:5.3f}"
        f" (x{lt['server_host_cpu_ms'] / e['server_host_cpu_ms']:.2f})",
        flush=True,
    )


RATIOS = (
    ("engine_overhead_ms", "engine overhead (wall)"),
    ("engine_overhead_cpu_ms", "engine overhead (CPU)"),
    ("overhead_ms", "ITL - model"),
    ("server_host_cpu_ms", "server host CPU"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=4100)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    ap.add_argument(
        "--control", choices=("off", "on", "both"), default="off",
        help="attention control: the same-size attention sweep after every step at every position",
    )
    ap.add_argument("--rev", default="HEAD", help="the kvledger commit to measure")
    ap.add_argument("--baseline-rev", default="8d031f8", help="'' to skip the baseline")
    a = ap.parse_args()
    if a.tokens <= LATE[1]:
        ap.error(f"--tokens must exceed {LATE[1]}")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    print_header("streaming overhead per token: position ~100 vs ~4,000 (HTTP server, SSE)")
    model = prepare_model()
    print(f"model   : {model} (kvledger-tiny, context {MAX_LEN}); windows {EARLY} and {LATE}")
    controls = {"off": [0], "on": [LATE[1] + 8], "both": [0, LATE[1] + 8]}[a.control]
    with tempfile.TemporaryDirectory() as tmp:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", a.rev], capture_output=True, text=True
        ).stdout.strip()
        versions = [(f"kvledger @ {head}", unpack_rev(a.rev, Path(tmp) / "new"))]
        if a.baseline_rev:
            versions.append((f"kvledger @ {a.baseline_rev}", unpack_rev(a.baseline_rev, Path(tmp) / "old")))
        rows = []
        for streams in a.streams:
            for rep in range(a.repeats):
                for name, src in versions:
                    for ctl in controls:
                        r = run_one(src, model, streams, a.tokens, ctl)
                        r.update(version=name, repeat=rep, control_tokens=ctl)
                        rows.append(r)
                        print_run(r)
    print(
        "(ITL: client inter-token time, median gap over the window, median over streams; model:"
        " ModelRunner.execute per step; engine overhead: LLMEngine.step less the model;"
        " ITL - model: all host work per step (engine, asyncio, JSON, SSE, client) that"
        " the model time does not hide. CPU time: the same less the time other processes"
        " take: engine overhead = the engine thread's CPU per step less the model's; server"
        " host CPU = the server process's CPU per step less the model's (engine, event loop,"
        " JSON, SSE; not the client). Per-step figures are medians over the window."
        " x = late / early. control: after every step, outside the timings (and taken out of the"
        " client's gaps), an attention over as many dummy contexts as streams, of"
        f" {LATE[1] + 8} tokens less the real context: the same attention work at every position.)"
    )
    if a.repeats > 1:
        print("median (min-max) of the late/early ratios over the repeats:")
        for streams in a.streams:
            for name, _ in versions:
                for ctl in controls:
                    runs = [
                        r for r in rows
                        if r["streams"] == streams and r["version"] == name and r["control_tokens"] == ctl
                    ]
                    parts = []
                    for key, label in RATIOS:
                        xs = sorted(r["late"][key] / r["early"][key] for r in runs)
                        parts.append(f"{label} x{statistics.median(xs):.2f} ({xs[0]:.2f}-{xs[-1]:.2f})")
                    tag = " control" if ctl else ""
                    print(f"{name:<24} {streams:>2} streams{tag} | " + " | ".join(parts), flush=True)
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
