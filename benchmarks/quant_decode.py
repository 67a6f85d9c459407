"""Decode speed of quantised weights against the same model in bf16 (issue 42): W8A8
(``quantization="int8"``), on-the-fly 4-bit (``"int4"``: Q4_0's groups of 32) and, as arm
``gptq128``, a GPTQ 4-bit checkpoint of the model (groups of 128, benchmarks/gptq_checkpoint.py).

One process, both engines built side by side on the same random-weight model (bench-230m: 20 x
1,024, ~228M parameters, big enough that a decode step streams its weights from memory), runs
alternated round by round, medians quoted with their ratio:

- single stream: one 32-token prompt, greedy; decode tok/s from the time of 65 tokens less the
  time of 1 (the prefill and first token), so prefill is not counted;
- 64 streams: 64 prompts of 32 tokens, 32 new tokens each, output tok/s of the whole batch.

    python -m benchmarks.quant_decode [--model bench-230m] [--rounds 3] [--arms bfloat16,int8,int4,gptq128] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.common import ensure_model, print_header


def _engine(path: str, arm: str):
    from benchmarks.gptq_checkpoint import ensure_gptq_checkpoint
    from kvledger import LLM

    kw = {"dtype": "float32"} if arm == "float32" else {"dtype": "bfloat16"}
    if arm in ("int8", "int4"):
        kw["quantization"] = arm
    if arm.startswith("gptq"):
        path = str(ensure_gptq_checkpoint(path, int(arm.removeprefix("gptq"))))
    return LLM(path, kv_cache_memory=1 << 30, calibrate_preemption=False, enable_prefix_caching=False, **kw)


def _seconds(llm, prompts: list[list[int]], new: int) -> float:
    from kvledger import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-230m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="bfloat16,int8,int4,gptq128", help="the first is the base of the ratios")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print_header(f"quantised weights' decode vs bf16, same model ({args.model}), same run")
    path = str(ensure_model(args.model))
    arms = args.arms.split(",")
    engines = {a: _engine(path, a) for a in arms}
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    one = [[(7 * i) % (vocab - 10) + 10 for i in range(32)]]
    many = [[(7 * i + 13 * j) % (vocab - 10) + 10 for i in range(32)] for j in range(64)]
    single: dict[str, list[float]] = {a: [] for a in arms}
    batch: dict[str, list[float]] = {a: [] for a in arms}
    for a in arms:  # warm-up: oneDNN primitives, first-touch pages
        _seconds(engines[a], one, 8)
    for _ in range(args.rounds):
        for a in arms:
            single[a].append(64 / (_seconds(engines[a], one, 65) - _seconds(engines[a], one, 1)))
            batch[a].append(64 * 32 / _seconds(engines[a], many, 32))
    base = arms[0]
    for name, figs in (("single-stream decode tok/s", single), ("64-stream output tok/s", batch)):
        med = {a: statistics.median(v) for a, v in figs.items()}
        print(f"{name}: " + ", ".join(f"{a} {med[a]:.1f}" for a in arms)
              + "; " + ", ".join(f"{a}/{base} {med[a] / med[base]:.2f}x" for a in arms[1:]))
    w = {a: engines[a].engine.executor.worker.ready.weight_bytes for a in arms}
    print("weight bytes: " + ", ".join(f"{a} {w[a] / 2**20:.0f} MiB" for a in arms))


if __name__ == "__main__":
    main()
