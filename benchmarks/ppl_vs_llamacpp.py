"""Perplexity of the same GGUF files in kvledger and in llama.cpp's ``llama-perplexity`` (issue 42).

stories260k converted by llama.cpp's ``convert_hf_to_gguf.py`` (F32, cached by
spec_llamacpp.to_gguf), then ``llama-quantize``d to Q8_0 and Q4_0 (cached in
bench_out/gguf/stories260k/). The text: quant_quality.py's held-out
stories (never used by the tests), repeated to 8 chunks. Both engines score it with
llama-perplexity's protocol: the text tokenized once with BOS by llama.cpp (``llama-tokenize``;
kvledger scores those very ids), cut into chunks of ``--ctx``
tokens, each chunk's first token replaced by BOS, and only the second half of each chunk scored
(every position from ctx/2 on predicts its next token); perplexity = exp(mean NLL).

- llama.cpp: ``llama-perplexity -m FILE -f TEXT -c CTX -b CTX -t 1`` ("Final estimate: PPL");
- kvledger: ``LLM(FILE)`` with ``prompt_logprobs``, chunk by chunk: float32 (the exact dequantised
  weights), and bf16 (Q8_0 / Q4_0 multiplied with int8 activations per 32, as llama.cpp does).

    python -m benchmarks.ppl_vs_llamacpp [--ctx 128] [--formats F32,Q8_0,Q4_0]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
from pathlib import Path

from benchmarks.common import REPO_ROOT, print_header
from benchmarks.quant_quality import STORIES as TEXTS
from benchmarks.spec_llamacpp import llamacpp_dir, to_gguf
from benchmarks.vs_llamacpp import STORIES


def files(formats: list[str], tools: Path) -> dict[str, Path]:
    """stories260k as F32 GGUF (spec_llamacpp.to_gguf: llama.cpp's converter, cached) and each
    other format quantised from it by ``llama-quantize`` (cached in bench_out/gguf/stories260k/)."""
    f32 = to_gguf(str(STORIES))
    out = REPO_ROOT / "bench_out" / "gguf" / "stories260k"
    out.mkdir(parents=True, exist_ok=True)
    made = {}
    for fmt in formats:
        if fmt == "F32":
            made[fmt] = f32
            continue
        f = out / f"model.{fmt}.gguf"
        if not f.exists():
            subprocess.run([str(tools / "bin" / "llama-quantize"), str(f32), str(f), fmt], check=True,
                           capture_output=True)  # fmt: skip
        made[fmt] = f
    return made


def llamacpp_ppl(tools: Path, f: Path, text: Path, ctx: int) -> tuple[float, int]:
    out = subprocess.run([str(tools / "bin" / "llama-perplexity"), "-m", str(f), "-f", str(text), "-c", str(ctx),
                          "-b", str(ctx), "-t", "1"], capture_output=True, text=True)  # fmt: skip
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama-perplexity failed on {f.name}:\n{log[-2000:]}")
    return float(m.group(1)), int(chunks.group(1)) if chunks else -1


def llamacpp_ids(tools: Path, f: Path, text: Path) -> list[int]:
    """The text as llama.cpp tokenizes it (llama-tokenize, with BOS): both engines score the very
    same tokens (a whole file tokenized at once differs from the HF tokenizer's in places)."""
    out = subprocess.run([str(tools / "bin" / "llama-tokenize"), "-m", str(f), "-f", str(text), "--ids",
                          "--log-disable"], capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def kvledger_ppl(f: Path, ids: list[int], ctx: int, dtype: str = "float32") -> tuple[float, int]:
    from kvledger import LLM, SamplingParams

    llm = LLM(str(f), tokenizer=str(STORIES), dtype=dtype, calibrate_preemption=False,
              enable_prefix_caching=False)  # fmt: skip
    bos = ids[0]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nll, n, chunks = 0.0, 0, len(ids) // ctx
    for c in range(chunks):
        chunk = [bos, *ids[c * ctx + 1 : (c + 1) * ctx]]
        out = llm.generate([{"prompt_token_ids": chunk}], sp, use_tqdm=False)[0]
        for pos in range(ctx // 2 + 1, ctx):  # logits at pos-1 predict chunk[pos], as llama-perplexity
            nll -= out.prompt_logprobs[pos][chunk[pos]].logprob
            n += 1
    return math.exp(nll / n), chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--formats", default="F32,Q8_0,Q4_0")
    a = ap.parse_args()
    tools = llamacpp_dir()
    print_header(f"perplexity on the same GGUF files: llama-perplexity vs kvledger (stories260k, ctx {a.ctx})")
    text = " ".join(TEXTS)
    while len(text) < 8 * a.ctx * 4:  # ~4 characters a token: at least 8 chunks
        text = text + " " + " ".join(TEXTS)
    made = files(a.formats.split(","), tools)
    path = REPO_ROOT / "bench_out" / "gguf" / "stories260k" / "heldout.txt"
    path.write_text(text)
    print(f"{'format':6} | llama.cpp PPL (chunks) | kvledger PPL (chunks) | kvledger / llama.cpp | "
          "kvledger bf16 (int8 activations) / llama.cpp")
    for fmt, f in made.items():
        ref, rc = llamacpp_ppl(tools, f, path, a.ctx)
        ids = llamacpp_ids(tools, f, path)
        got, gc = kvledger_ppl(f, ids, a.ctx)
        bf16, _ = kvledger_ppl(f, ids, a.ctx, "bfloat16")
        print(f"{fmt:6} | {ref:13.4f} ({rc:3d})    | {got:12.4f} ({gc:3d})    | {got / ref:.4f}               | "
              f"{bf16:.4f} ({bf16 / ref:.4f})", flush=True)


if __name__ == "__main__":
    main()
