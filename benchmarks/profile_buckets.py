"""Where a live server's CPU goes: py-spy raw (collapsed) stacks sorted into a few buckets.

    python -m benchmarks.profile_buckets PROFILE.txt [PROFILE2.txt ...]

``py-spy record --format raw --threads [--subprocesses]`` writes one line per distinct stack,
``frame;frame;...;leaf COUNT``, the first frame naming the thread (and, with
``--subprocesses``, a ``process ...`` frame before it). Each sample goes to the first bucket
whose pattern appears anywhere in its stack, in the order below, so a detokenizer call made
inside the engine step counts as detokenization, not as the step. Only on-CPU samples are
recorded (py-spy skips idle threads unless ``--idle``), so the shares are of busy CPU time.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# (bucket, substrings of a frame's "function (file:line)" text); first match wins.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("detokenization", ("detokeniz", "Detokeniz", "decode_next", "convert_ids_to_tokens")),
    (
        "model forward",
        ("ModelRunner.execute", "execute_model", "_model_forward", "LlamaForCausalLM.forward"),
    ),
    ("scheduler", ("Scheduler.schedule", "update_from_output", "scheduler.py")),
    ("engine step, other", ("LLMEngine.step", "EngineCore.step", "engine/core.py")),
    ("IPC (ZMQ / msgpack)", ("zmq", "msgspec", "msgpack", "serial_utils")),
    (
        "HTTP, SSE and JSON framing",
        (
            "uvicorn",
            "starlette",
            "fastapi",
            "httptools",
            "h11",
            "pydantic",
            "server/app.py",
            "serving",
            "protocol.py",
        ),
    ),
    ("asyncio / event loop", ("asyncio", "uvloop", "runners.py")),
]


def bucket_of(stack: str) -> str:
    for name, pats in BUCKETS:
        if any(p in stack for p in pats):
            return name
    return "other"


def summarize(path: str | Path) -> tuple[int, Counter, Counter]:
    """(samples, per-bucket counts, per-thread counts) of one raw py-spy profile."""
    buckets: Counter = Counter()
    threads: Counter = Counter()
    total = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        buckets[bucket_of(stack)] += count
        frames = stack.split(";")
        head = [f for f in frames[:2] if f.startswith(("process", "thread"))]
        threads[re.sub(r" \(\d+\)", "", " / ".join(head)).strip() or "?"] += count
    return total, buckets, threads


def render(path: str | Path) -> str:
    total, buckets, threads = summarize(path)
    if not total:
        return f"{path}: no samples"
    lines = [f"{path}: {total} on-CPU samples", "| bucket | share |", "| --- | --- |"]
    lines += [f"| {b} | {c / total:.1%} |" for b, c in buckets.most_common()]
    lines.append("threads: " + ", ".join(f"{t} {c / total:.0%}" for t, c in threads.most_common(6)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profiles", nargs="+")
    for p in ap.parse_args().profiles:
        print(render(p))


if __name__ == "__main__":
    main()
