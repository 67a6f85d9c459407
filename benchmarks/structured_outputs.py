"""Structured outputs: the grammar mask's cost per token, constrained vs unconstrained decoding
end to end, and the step times while new grammars compile in the background.

    python -m benchmarks.structured_outputs [--steps 200] [--e2e-tokens 64] [--parts 1,2,3]
        [--torch-threads 1]

1. Mask cost: one packed bitmask per step (xgrammar's per-row fill; beside it the engine's
   batched fill, xgrammar's BatchGrammarMatcher with 1 and 2 threads), then either xgrammar's apply on
   the logits (what rows that sample or want logprobs get) or the greedy rows' path (check the
   argmax's bit; the native fused masked argmax for the rows the grammar forbids, with 1 and 2
   OpenMP threads), for batch
   1/16/64 and a 32k and a 128k vocabulary (a RAW vocabulary of printable characters and
   multi-character pieces), each matcher following a JSON-schema grammar with random logits;
   per token = step time / batch. Printed beside the plain argmax over the same logits (what
   an unconstrained greedy step does), with the ratios.
2. End to end: a random-weight 30M (and with --e2e-presets bench-30m,bench-60m also 60M) Llama
   with a 32k vocabulary, batch 16, the same prompts decoded with and without a JSON-schema
   constraint (grammar precompiled: the cache is warm); tok/s of both and the ratio.
3. Compile never stalls the loop: 16 requests decode; at step 20 sixteen requests with 16
   different new schemas arrive; each step's wall time is printed, and the mean/max of the
   steps while the grammars compile against the steps before.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from pathlib import Path

from benchmarks.common import BENCH_OUT, build_random_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        },
        "note": {"type": "string"},
    },
    "required": ["people", "note"],
}


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """Specials, every printable ASCII character, then random 2-8 character pieces."""
    rng = random.Random(seed)
    vocab = ["<unk>", "<s>", "</s>", *string.printable[:95]]
    seen = set(vocab)
    alphabet = string.ascii_letters + string.digits + ' {}[]":,.-_'
    while len(vocab) < size:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab


def bench_mask(steps: int) -> None:
    import torch
    import xgrammar as xgr

    from kvledger.kernels import native
    from kvledger.structured.state import (
        GrammarState,
        MaskBuffer,
        apply_bitmask,
        disallowed_rows,
        fill_bitmask,
    )

    print("\n## 1. mask cost per token (one packed bitmask per step)")
    print("fill: xgrammar fills each row (one Python call per row); fill b1 / b2: the engine's fill,")
    print("xgrammar's BatchGrammarMatcher with 1 / 2 threads (same bits, checked); apply: xgrammar's")
    print("CPU apply (rows that sample or want logprobs); greedy / greedy t2: the greedy rows' path =")
    print("check the argmax's bit, fused masked argmax (native kernel, 1 / 2 OpenMP threads) for the")
    print("rows it forbids; argmax: the unconstrained greedy step's own work")
    print(f"{'vocab':>7} {'batch':>5} {'fill':>7} {'fill b1':>7} {'fill b2':>7} {'apply':>7} {'greedy':>7} "
          f"{'greedy t2':>9} {'argmax':>7} {'(fill+apply)/argmax':>20} {'(fill+greedy)/argmax':>21} "
          f"{'(b2+greedy t2)/argmax':>22} {'forbidden':>9}")
    for vocab_size in (32000, 128000):
        vocab = synthetic_vocab(vocab_size)
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[2])
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
        for batch in (1, 16, 64):
            from concurrent.futures import Future

            fut: Future = Future()
            fut.set_result(compiled)
            states = [GrammarState(fut) for _ in range(batch)]
            for s in states:
                s.start()
            owners = [type("Owner", (), {"grammar": s})() for s in states]
            batched = {1: MaskBuffer(threads=1), 2: MaskBuffer(threads=2)}
            gen = torch.Generator().manual_seed(0)
            t_fill = t_apply = t_greedy = t_argmax = t_b1 = t_b2 = t_greedy2 = 0.0
            forbidden = 0
            rows = list(range(batch))
            for _ in range(steps):
                logits = torch.randn(batch, vocab_size, generator=gen)
                t0 = time.perf_counter()
                tokens = logits.argmax(dim=-1)
                t1 = time.perf_counter()
                bm = fill_bitmask(states, vocab_size)
                t2 = time.perf_counter()
                bad = disallowed_rows(bm[0], rows, tokens)
                fixed = native.masked_argmax(logits, bm[0], bad, 1) if bad else None
                t3 = time.perf_counter()
                bad2 = disallowed_rows(bm[0], rows, tokens)
                fixed2 = native.masked_argmax(logits, bm[0], bad2, 2) if bad2 else None
                t4 = time.perf_counter()
                b1 = batched[1].fill(owners)
                t5 = time.perf_counter()
                b2 = batched[2].fill(owners)
                t6 = time.perf_counter()
                # The engine's fills and the 2-thread kernel give exactly what the serial ones do.
                assert torch.equal(b1[0], bm[0]) and torch.equal(b2[0], bm[0]) and b1[1] == b2[1] == bm[1]
                assert bad == bad2 and (fixed is None or torch.equal(fixed, fixed2))
                if bad:
                    tokens[bad] = fixed
                t7 = time.perf_counter()
                apply_bitmask(logits, bm)
                t8 = time.perf_counter()
                t_argmax += t1 - t0
                t_fill += t2 - t1
                t_greedy += t3 - t2
                t_greedy2 += t4 - t3
                t_b1 += t5 - t4
                t_b2 += t6 - t5
                t_apply += t8 - t7
                forbidden += len(bad)
                for s, t in zip(states, tokens.tolist()):
                    if s.accept(t):
                        s.matcher.reset()
            per = 1e6 / (steps * batch)
            print(f"{vocab_size:>7} {batch:>5} {t_fill * per:>7.1f} {t_b1 * per:>7.1f} {t_b2 * per:>7.1f} "
                  f"{t_apply * per:>7.1f} {t_greedy * per:>7.1f} {t_greedy2 * per:>9.1f} {t_argmax * per:>7.1f} "
                  f"{(t_fill + t_apply) / t_argmax:>20.2f} {(t_fill + t_greedy) / t_argmax:>21.2f} "
                  f"{(t_b2 + t_greedy2) / t_argmax:>22.2f} {forbidden / (steps * batch):>9.0%}")
    print("(us per token; 'forbidden': share of rows whose unmasked argmax the grammar forbids)")


def build_model(path: Path, preset: str = "bench-30m") -> Path:
    """A random Llama preset (32k vocab) with a RAW WordLevel tokenizer of JSON-able pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    build_random_llama(path, preset)
    marker = path / "structured_tokenizer"
    if not marker.exists():
        vocab = {p: i for i, p in enumerate(synthetic_vocab(32000))}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.Fuse()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(str(path))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_file.write_text(json.dumps(cfg, indent=2))
        marker.write_text("1")
    return path


def bench_e2e(path: Path, tokens: int, rounds: int, preset: str = "bench-30m") -> None:
    from kvledger.llm import LLM
    from kvledger.sampling_params import SamplingParams, StructuredOutputsParams

    print(f"\n## 2. end to end, batch 16, 32k vocab ({preset} random weights)")
    llm = LLM(str(path), calibrate_preemption=False, max_num_seqs=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(16)] for _ in range(16)]
    so = StructuredOutputsParams(json=SCHEMA)
    plain = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
    llm.generate(prompts[:2], [plain, constrained], use_tqdm=False)  # warm up, compile the grammar
    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(rounds):  # interleaved, so drift on a shared machine hits both alike
        for name, sp in (("unconstrained", plain), ("constrained", constrained)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(n / dt)
    u, c = statistics.median(rates["unconstrained"]), statistics.median(rates["constrained"])
    print(f"unconstrained {u:8.1f} tok/s   constrained {c:8.1f} tok/s   "
          f"constrained/unconstrained {c / u:.3f} ({(1 - c / u) * 100:+.1f}% slower)  "
          f"[median of {rounds}; per round u={[round(x) for x in rates['unconstrained']]} "
          f"c={[round(x) for x in rates['constrained']]}]")


def bench_compile_trace(path: Path) -> None:
    from kvledger.llm import LLM
    from kvledger.sampling_params import SamplingParams, StructuredOutputsParams

    print("\n## 3. step times while 16 new schemas compile (batch 16 decoding)")
    llm = LLM(str(path), calibrate_preemption=False, max_num_seqs=32)
    eng = llm.engine
    rng = random.Random(1)
    prompt = lambda: [rng.randrange(3, 32000) for _ in range(16)]  # noqa: E731
    for _ in range(16):
        eng.add_request(prompt(), SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    times, compiling = [], []
    for step in range(100):
        if step == 20:
            for i in range(16):
                schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": ["string", "integer"]} for j in range(8)},
                          "required": [f"field_{i}_0"]}
                so = StructuredOutputsParams(json=schema)
                eng.add_request(prompt(), SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
        compiling.append(len(eng.structured.compiling))
    while eng.has_unfinished_requests():
        eng.step()
    print("step  ms    grammars still compiling")
    for i, (t, c) in enumerate(zip(times, compiling)):
        if 15 <= i <= 45 or c:
            print(f"{i:4d} {t:6.1f}  {c}")
    before = times[5:20]
    during = [t for t, c in zip(times[20:], compiling[20:]) if c]
    print(f"before: mean {statistics.mean(before):.1f} ms, max {max(before):.1f} ms; while compiling "
          f"({len(during)} steps): mean {statistics.mean(during or [0]):.1f} ms, max {max(during or [0]):.1f} ms; "
          f"grammars compiled: {eng.structured.compiler.num_compiled}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="mask-cost steps per configuration")
    ap.add_argument("--e2e-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--e2e-presets", default="bench-30m", help="comma-separated model presets for part 2")
    ap.add_argument("--parts", default="1,2,3", help="comma-separated parts to run (1: mask cost, 2: end to "
                    "end, 3: compile trace)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (the engine's mask "
                    "work stays on one unless KVLEDGER_MASK_THREADS says otherwise)")
    args = ap.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    from benchmarks.common import print_header

    print_header("structured outputs: mask cost, constrained vs unconstrained, compile off the loop")
    import torch

    from kvledger import envs

    torch.set_num_threads(args.torch_threads)
    print(f"torch threads {torch.get_num_threads()}; KVLEDGER_MASK_THREADS="
          f"{envs.KVLEDGER_MASK_THREADS}")
    if 1 in parts:
        bench_mask(args.steps)
    for preset in args.e2e_presets.split(",") if 2 in parts else []:
        tag = preset.removeprefix("bench-")
        bench_e2e(build_model(BENCH_OUT / "models" / f"structured-{tag}", preset), args.e2e_tokens, args.rounds, preset)
    if 3 in parts:
        bench_compile_trace(build_model(BENCH_OUT / "models" / "structured-30m"))


if __name__ == "__main__":
    main()
