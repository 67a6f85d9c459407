"""`kvledger serve` under one fixed-shape load, for A/B runs of server settings.

Every request has the same prompt length and output length, all sent at once (``--streams`` in
flight), so the steady state is decode steps of a known batch and context: the figure a setting
changes is not drowned by the mix of the issue-24 workload. Arms are environment settings of the
server process (``NAME=VAR=VALUE,...``; ``default=`` adds none); their runs alternate, a fresh
server each, ``--rounds`` times, and the medians and their ratio to the first arm are printed.

    python -m benchmarks.serve_fixed_load --streams 56 --prompt-len 300 --max-tokens 200 \\
        --arm default= --arm spin1e6=GOMP_SPINCOUNT=1000000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path

from benchmarks.common import BENCH_OUT, print_header
from benchmarks.vs_vllm_serve import drive, kvledger_server, model_folder, run_load


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition("=")
    env = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--arm {spec!r}: settings are VAR=VALUE, comma-separated")
        env[key] = value
    if not name:
        raise SystemExit(f"--arm {spec!r}: give the arm a name, NAME=VAR=VALUE")
    return name, env


def one_run(a: argparse.Namespace, folder: Path, env: dict[str, str], name: str) -> dict:
    server = kvledger_server(folder, a, Path(a.out_dir) / f"{name}.log")
    server.env = {**server.env, **env}
    server.start()
    try:
        rng = random.Random(a.seed)
        load = [
            {"prompt_token_ids": [rng.randrange(3, a.vocab_size) for _ in range(a.prompt_len)], "max_tokens": a.max_tokens}
            for _ in range(a.streams)
        ]
        asyncio.run(drive(server.url, load[:4], 4))  # warm-up
        return run_load(server, load, a.streams)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="bench-60m", choices=["tiny", "stories", "bench-60m"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--streams", type=int, default=56)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--arm", action="append", default=[], help="NAME=VAR=VALUE,... (default= for none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=float, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kvledger-args", default="")
    ap.add_argument("--out-dir", default=str(BENCH_OUT / "serve_fixed_load"))
    a = ap.parse_args()
    arms = [parse_arm(s) for s in (a.arm or ["default="])]
    if a.prompt_len + a.max_tokens > a.max_model_len:
        raise SystemExit(f"--prompt-len + --max-tokens must fit --max-model-len {a.max_model_len}")
    folder = model_folder(a.tokenizer)
    a.vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    print_header("kvledger serve, one fixed-shape load, settings alternated")
    print(f"load    : {a.streams} streams x {a.prompt_len}-token prompts x {a.max_tokens} tokens, {a.dtype}, {a.tokenizer}")
    tok: dict[str, list[float]] = {name: [] for name, _ in arms}
    itl: dict[str, list[float]] = {name: [] for name, _ in arms}
    ttft99: dict[str, list[float]] = {name: [] for name, _ in arms}
    itl99: dict[str, list[float]] = {name: [] for name, _ in arms}
    for r in range(a.rounds):
        for name, env in arms:
            res = one_run(a, folder, env, name)
            if res["num_errors"]:
                raise SystemExit(f"{name}: {res['num_errors']} failed requests: {res['errors'][:3]}")
            tok[name].append(res["tok_per_s"])
            itl[name].append(res["itl_p50_ms"])
            ttft99[name].append(res["ttft_p99_ms"])
            itl99[name].append(res["itl_p99_ms"])
            print(
                f"round {r + 1} {name:12s} {res['tok_per_s']:7.0f} tok/s  inter-token p50 / p99 "
                f"{res['itl_p50_ms']:6.1f} / {res['itl_p99_ms']:6.1f} ms  TTFT p99 {res['ttft_p99_ms']:7.0f} ms  "
                f"server cores {res['server_cores']:.2f}"
            )
    base = statistics.median(tok[arms[0][0]])
    for name, _ in arms:
        med = statistics.median(tok[name])
        print(
            f"{name:12s} median {med:7.0f} tok/s ({med / base:.2f}x {arms[0][0]}), "
            f"inter-token p50 / p99 medians {statistics.median(itl[name]):.1f} / {statistics.median(itl99[name]):.1f} ms, "
            f"TTFT p99 median {statistics.median(ttft99[name]):.0f} ms"
        )


if __name__ == "__main__":
    main()
