"""MoE decode throughput: kvledger vs Hugging Face ``generate`` on the same random Mixtral-like
model (issue 20). kvledger runs the experts as two batched GEMMs per layer over the experts
a step hits (kvledger.model.moe); HF's MixtralExperts loops over the hit experts in Python.

Workload: B requests with the same prompt length P (so HF needs no padding), greedy, N new
tokens each, float32 on CPU. Decode tok/s = B * (N - 1) / (time for N tokens - time for 1
token), i.e. the prefill and first token are timed separately and taken out, for both engines.
Greedy tokens are compared between the two engines.

    python -m benchmarks.moe_decode                 # defaults: B=8, P=64, N=64
    python -m benchmarks.moe_decode --batch 1 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import BENCH_OUT, build_trivial_tokenizer, print_header

MOE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    meta = path / "bench_meta.json"
    if meta.exists() and json.loads(meta.read_text()) == {**MOE, "seed": seed}:
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(MixtralConfig(**MOE), dtype=torch.float32).eval()
    with torch.no_grad():  # HF's std 0.02 init; the router gets a wider spread so it routes
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    build_trivial_tokenizer(path)
    meta.write_text(json.dumps({**MOE, "seed": seed}))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many timed runs")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from kvledger import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    print_header("MoE decode: kvledger vs HF generate (random Mixtral-like, float32, CPU)")
    path = build_model(BENCH_OUT / "models" / "moe-mixtral-bench")
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(path)).parameters())
    print(f"model   : {path} ({n_params / 1e6:.1f}M params, {MOE['num_hidden_layers']} layers, "
          f"{MOE['num_local_experts']} experts, top-{MOE['num_experts_per_tok']})")
    print(f"workload: {args.batch} requests x {args.prompt_len} prompt tokens, "
          f"{args.new_tokens} greedy new tokens, {args.threads} threads")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, MOE["vocab_size"], (args.batch, args.prompt_len), generator=g)

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def hf_run(n: int):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0, out[:, args.prompt_len:].tolist()

    llm = LLM(str(path), calibrate_preemption=False)
    ids = prompts.tolist()

    def kvl_run(n: int):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(ids, sp, use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    results = {}
    for name, fn in (("hf", hf_run), ("kvledger", kvl_run)):
        fn(2)  # warm-up
        first = min(fn(1)[0] for _ in range(args.repeats))
        runs = [fn(args.new_tokens) for _ in range(args.repeats)]
        full = min(t for t, _ in runs)
        tps = args.batch * (args.new_tokens - 1) / (full - first)
        results[name] = (tps, runs[0][1], first, full)
        print(f"{name:9s}: prefill+1 token {first:.3f} s, {args.new_tokens} tokens {full:.3f} s, "
              f"decode {tps:,.1f} tok/s")
    same = sum(a == b for a, b in zip(results["hf"][1], results["kvledger"][1]))
    print(f"greedy tokens identical for {same}/{args.batch} requests")
    print(f"ratio   : kvledger / HF decode tok/s = {results['kvledger'][0] / results['hf'][0]:.2f}x")


if __name__ == "__main__":
    main()
