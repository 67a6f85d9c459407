"""kvledger against llama.cpp on the very same GGUF files (issue 42): single-stream decode and
prefill, one run, both figures and their ratio per format.

The model: bench-230m-v512 (random Llama, 20 layers x 1,024, GQA 16/4, MLP 2,816, ~226M
parameters, vocab 512: big enough that a decode step streams its weights from memory) with
stories260k's tokenizer files beside it (llama.cpp needs the tokenizer's vocabulary to be the
embedding's), converted by llama.cpp's own ``convert_hf_to_gguf.py`` to bf16, then quantised by
``llama-quantize`` to each format (Q8_0, Q4_0, Q4_K_M); files cached in bench_out/gguf/.
llama.cpp's tools come from ``benchmarks/setup_llamacpp.sh`` (built from PyPI's llama-cpp-python
sdist, -DGGML_NATIVE=ON).

- llama.cpp: ``llama-bench -m FILE -p 512 -n 64 -t THREADS -r ROUNDS -o json`` (pp512 and tg64
  averages);
- kvledger: ``LLM(FILE, dtype="bfloat16")`` in a fresh process with the same torch threads:
  decode tok/s from the time of 65 generated tokens less the time of 1 (a 32-token prompt, greedy,
  ignore_eos), prefill tok/s of one 512-token prompt (max_tokens 1); best of ROUNDS each.

The two engines run one after the other per format (llama.cpp first), nothing else of this script
running beside them; quote the ratios.

    bash benchmarks/setup_llamacpp.sh     # once
    python -m benchmarks.vs_llamacpp [--formats Q8_0,Q4_0,Q4_K_M] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO_ROOT, ensure_model, print_header
from benchmarks.spec_llamacpp import llamacpp_dir

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"

KVLEDGER_RUN = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from kvledger import LLM, SamplingParams
llm = LLM(sys.argv[1], tokenizer=sys.argv[2], dtype="bfloat16", kv_cache_memory=1 << 30,
          calibrate_preemption=False, enable_prefix_caching=False)
rounds = int(sys.argv[4])
p = [{"prompt_token_ids": list(range(10, 42))}]
def seconds(prompts, n):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); return time.perf_counter() - t
decode = max(64 / (seconds(p, 65) - seconds(p, 1)) for _ in range(rounds))
long = [{"prompt_token_ids": [(i * 7919) % 500 + 10 for i in range(512)]}]
prefill = max(512 / seconds(long, 1) for _ in range(rounds))
print(json.dumps({"decode": decode, "prefill": prefill,
                  "weight_bytes": llm.engine.executor.worker.ready.weight_bytes}))
"""


def gguf_files(preset: str, formats: list[str], tools: Path) -> dict[str, Path]:
    """The preset as GGUF files, one per format (made once, cached)."""
    out = REPO_ROOT / "bench_out" / "gguf" / preset
    out.mkdir(parents=True, exist_ok=True)
    src = out / "hf"
    if not (src / "config.json").exists():  # the weights, with stories260k's tokenizer files
        hf = ensure_model(preset)
        src.mkdir(exist_ok=True)
        for f in ("config.json", "generation_config.json", "model.safetensors"):
            (src / f).symlink_to(hf / f)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (src / f).write_bytes((STORIES / f).read_bytes())
    bf16 = out / "model.bf16.gguf"
    files = {}
    for fmt in formats:
        f = out / f"model.{fmt}.gguf"
        if not f.exists() and not bf16.exists():
            subprocess.run([sys.executable, str(tools / "src" / "convert_hf_to_gguf.py"), str(src), "--outtype",
                            "bf16", "--outfile", str(bf16)], check=True, capture_output=True)  # fmt: skip
        if not f.exists():
            subprocess.run([str(tools / "bin" / "llama-quantize"), str(bf16), str(f), fmt], check=True,
                           capture_output=True)  # fmt: skip
        files[fmt] = f
    return files


def llama_bench(tools: Path, f: Path, threads: int, rounds: int) -> dict[str, float]:
    out = subprocess.run(
        [str(tools / "bin" / "llama-bench"), "-m", str(f), "-p", "512", "-n", "64", "-t", str(threads),
         "-r", str(rounds), "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    res = {}
    for row in json.loads(out.stdout):
        key = "prefill" if row.get("n_prompt", 0) > 0 else "decode"
        res[key] = float(row["avg_ts"])
    return res


def kvledger_run(f: Path, tokenizer: Path, threads: int, rounds: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", KVLEDGER_RUN, str(f), str(tokenizer), str(threads), str(rounds)],
                         capture_output=True, text=True, check=True, env=env)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-230m-v512")
    ap.add_argument("--formats", default="Q8_0,Q4_0,Q4_K_M")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tools = llamacpp_dir()
    if not (tools / "bin" / "llama-bench").exists():
        sys.exit(f"{tools / 'bin' / 'llama-bench'} is missing: run bash benchmarks/setup_llamacpp.sh")
    print_header(f"kvledger vs llama.cpp on the same GGUF files ({a.model}, {a.threads} thread(s))")
    files = gguf_files(a.model, a.formats.split(","), tools)
    tokenizer = files[next(iter(files))].parent / "hf"
    print(f"{'format':8} {'MiB':>6} | {'decode tok/s llama.cpp / kvledger / ratio':>42} | "
          f"{'prefill-512 tok/s llama.cpp / kvledger / ratio':>47}")
    for fmt, f in files.items():
        ref = llama_bench(tools, f, a.threads, a.rounds)
        got = kvledger_run(f, tokenizer, a.threads, a.rounds)
        print(f"{fmt:8} {f.stat().st_size / 2**20:6.0f} | {ref['decode']:14.1f} {got['decode']:10.1f} "
              f"{got['decode'] / ref['decode']:8.2f}x         | {ref['prefill']:14.1f} {got['prefill']:10.1f} "
              f"{got['prefill'] / ref['prefill']:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
