"""Soak: `kvledger serve` under waves of streaming traffic with disconnects, for as long as asked.

Each wave sends ``--wave-size`` streaming completions, ``--concurrency`` at a time (prompts of
4-120 tokens, 5-300 output tokens, temperature 0.8), and a share of the clients
(``--disconnect``) hang up after a few chunks. After every wave it records the server's resident
memory, open file descriptors and threads (from /proc), the used KV blocks (`/v1/ledger`), and
the wave's TTFT and inter-token latency percentiles. Memory must plateau and latency must not
drift: the report compares the last wave with the first after warm-up.

    python -m benchmarks.soak --minutes 20 [--model PATH] [--num-kv-blocks 512] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import BENCH_OUT, REPO_ROOT, kill_group, percentile, print_header

STORIES = REPO_ROOT.parent / "shared" / "models" / "stories260k"
WORDS = (
    "once upon a time there was a little girl named lily she loved to play outside in the park "
    "with her red ball one day tom saw a big dog under a tall tree the sun was warm and the "
    "birds sang happy songs mom said be careful and come home before dark they found a shiny "
    "box near the pond"
).split()


def _tree(pid: int) -> list[int]:
    """The process and its descendants (the engine core runs in a child of the front end)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return out


def proc_stats(pid: int) -> dict[str, int]:
    """Resident memory (KiB), threads and open descriptors of a live server, from /proc, summed
    over its process tree (front end + engine-core processes)."""
    out = {"rss_kib": 0, "pss_kib": 0, "threads": 0, "fds": 0, "processes": 0}
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out["rss_kib"] += int(line.split()[1])
                    elif line.startswith("Threads:"):
                        out["threads"] += int(line.split()[1])
            with open(f"/proc/{p}/smaps_rollup") as f:  # shared pages counted once overall
                out["pss_kib"] += sum(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
            out["fds"] += len(os.listdir(f"/proc/{p}/fd"))
            out["processes"] += 1
        except OSError:
            pass
    return out


class Server:
    """`python -m kvledger serve` in its own process group, logging to a file."""

    def __init__(self, model: str, port: int, extra: list[str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "kvledger", "serve", model, "--port", str(port), *extra]
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see its log")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def stop(self) -> None:
        kill_group(self.proc)
        self._log.close()


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, disconnect: float
) -> dict[str, Any]:
    """One streamed completion; returns its TTFT, inter-token gaps and whether it hung up."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 100)))
    body = {
        "prompt": prompt,
        "max_tokens": rng.randint(5, 300),
        "temperature": 0.8,
        "stream": True,
    }
    hang_up_after = rng.randint(1, 5) if rng.random() < disconnect else None
    t0 = time.perf_counter()
    last = None
    ttft, gaps, chunks = None, [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code == 400:  # e.g. prompt + max_tokens past the context: refused
                await resp.aread()
                return {"refused": resp.json().get("error", {}).get("message", "")}
            if resp.status_code != 200:
                return {"error": resp.status_code}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    break  # leaving the context closes the connection mid-stream
    except httpx.TransportError as e:  # counted, not fatal: the soak goes on and reports it
        return {"error": type(e).__name__}
    return {"ttft": ttft, "gaps": gaps, "hung_up": hang_up_after is not None}


async def wave(url: str, n: int, concurrency: int, disconnect: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    # Idle connections expire before the server's 5 s keep-alive, so a starved client never
    # sends on a connection the server is closing (a ReadError that is not the server's fault).
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )

    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

        async def run(i: int) -> dict[str, Any]:
            async with sem:
                return await one_request(client, random.Random(rng.random() + i), disconnect)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(n)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    gaps = [g for r in results for g in r.get("gaps", ())]
    return {
        "wall_s": wall,
        "errors": sum(1 for r in results if "error" in r),
        "refused": [r["refused"] for r in results if "refused" in r],
        "hung_up": sum(1 for r in results if r.get("hung_up")),
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
    }


def used_blocks(url: str) -> int:
    d = httpx.get(url + "/v1/ledger", timeout=30.0).json()
    return int(d["used_blocks"])


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r["requests"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(reqs, [r["rss_kib"] / 1024 for r in rows], marker="o")
    a.set_ylabel("server RSS, all processes (MiB)")
    a.grid(alpha=0.3)
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        b.plot(reqs, [r[key] for r in rows], marker=".", label=key)
    b.set_yscale("log")
    b.set_ylabel("ms")
    b.set_xlabel("requests served")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: the engine's sizing")
    p.add_argument("--minutes", type=float, default=2.0, help="run waves until this much time")
    p.add_argument("--max-waves", type=int, default=10_000,
                   help="stop after this many waves (50,000 requests: 167 waves of 300)")
    p.add_argument("--wave-size", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.3)
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", default=str(BENCH_OUT / "soak"))
    p.add_argument("--plot", default=None, help="PNG of RSS and latency per wave")
    a = p.parse_args(argv)
    print_header("kvledger soak: waves of streaming requests with disconnects")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--torch-threads", str(a.torch_threads), "--log-level", "warning"]
    if a.num_kv_blocks:
        extra += ["--num-kv-blocks", str(a.num_kv_blocks)]
    srv = Server(a.model, a.port, extra, out / "server.log")
    rows: list[dict[str, Any]] = []
    try:
        srv.wait_ready()
        start = proc_stats(srv.proc.pid)
        print(f"start: RSS {start['rss_kib'] / 1024:.0f} MiB, {start['threads']} threads, "
              f"{start['fds']} fds")
        t_end = time.monotonic() + 60 * a.minutes
        served = 0
        for w in range(a.max_waves):
            if time.monotonic() >= t_end:
                break
            r = asyncio.run(wave(srv.url, a.wave_size, a.concurrency, a.disconnect, seed=w))
            served += a.wave_size
            time.sleep(0.2)  # let aborted requests drain before reading the ledger
            row = {"wave": w + 1, "requests": served, **r, **proc_stats(srv.proc.pid),
                   "used_blocks": used_blocks(srv.url)}
            rows.append(row)
            print(
                f"wave {row['wave']:4d}  reqs {served:7,d}  RSS {row['rss_kib'] / 1024:7.1f} MiB  "
                f"PSS {row['pss_kib'] / 1024:7.1f} MiB  "
                f"fds {row['fds']:3d}  thr {row['threads']:3d}  used {row['used_blocks']:4d}  "
                f"TTFT p50/p99 {row['ttft_p50_ms']:6.1f}/{row['ttft_p99_ms']:7.1f} ms  "
                f"ITL p50/p99 {row['itl_p50_ms']:5.1f}/{row['itl_p99_ms']:6.1f} ms  "
                f"err {row['errors']}  hung up {row['hung_up']}"
                + "".join(f"\n  refused (400): {m}" for m in row["refused"]),
                flush=True,
            )
    finally:
        srv.stop()
    (out / "soak.json").write_text(json.dumps(rows, indent=1))
    if a.plot and rows:
        plot(rows, Path(a.plot))
    if len(rows) >= 3:
        base, last = rows[1], rows[-1]  # the second wave: the pool touched, caches warm
        growth = last["rss_kib"] / base["rss_kib"] - 1
        print(f"\nRSS wave 2 -> last: {base['rss_kib'] / 1024:.1f} -> {last['rss_kib'] / 1024:.1f} "
              f"MiB ({100 * growth:+.1f} %)")
        at10k = next((r for r in rows if r["requests"] >= 10_000), None)
        if at10k is not None and at10k is not last:
            g = last["rss_kib"] / at10k["rss_kib"] - 1
            print(f"RSS request {at10k['requests']:,} -> {last['requests']:,}: "
                  f"{at10k['rss_kib'] / 1024:.1f} -> {last['rss_kib'] / 1024:.1f} MiB "
                  f"({100 * g:+.2f} %; target within +5 %)")
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            print(f"{key}: wave 2 {base[key]:.1f} -> last {last[key]:.1f} "
                  f"({last[key] / base[key]:.2f}x; target within 10 %)")
        if len(rows) >= 12:  # one wave's p99 is ~100 samples: five-wave medians show the trend
            early, late = rows[1:6], rows[-5:]
            for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
                e = sorted(r[key] for r in early)[2]
                la = sorted(r[key] for r in late)[2]
                print(f"{key}: median of waves 2-6 {e:.1f} -> of the last 5 {la:.1f} "
                      f"({la / e:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
