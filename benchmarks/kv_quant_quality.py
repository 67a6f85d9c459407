"""Quality of the quantised KV cache (issue 5) on stories260k: perplexity and greedy agreement.

For every format (int8, fp8, fp8_int8) with and without attention-sink protection
(kv_sink_tokens 4 vs 0) and with and without the full-precision recent window
(kv_recent_tokens 32 vs 0), against the unquantised cache (auto = the model's float32):

- perplexity of held-out text (tests/data/heldout.txt, written for this purpose, split into
  segments of at most 500 tokens) from ``prompt_logprobs``. The torch backend reads every key
  of a quantised cache back through its code, including the keys of the chunk being prefilled
  (a query at q sees key p in full precision only if p < S or q - p < R), so a one-chunk
  prefill scores each token exactly as teacher-forced decoding through the quantised cache
  would (tests/test_kv_quant.py checks prefill == one-token-per-step decode);
- greedy agreement over 256 new tokens (ignore_eos) from several prompts: the fraction of
  positions equal before the first divergence, and the fraction equal overall. A control row
  perturbs the unquantised keys by 0.1% (random, relative): this tiny model has many near-ties,
  so greedy agreement falls quickly under any perturbation; perplexity is the quality measure.

    python -m benchmarks.kv_quant_quality            # prints the table (about 20 s on CPU)
    python -m benchmarks.kv_quant_quality --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time
from pathlib import Path

import torch

from kvledger import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260k"
HELDOUT = REPO / "tests" / "data" / "heldout.txt"
FORMATS = ("int8", "fp8", "fp8_int8")
GREEDY_PROMPTS = (
    "Once upon a time",
    "Lily and Tom went to the",
    "The little dog",
    "One day, a big",
    "Sam had a blue ball. He",
    "Mom said, \"",
)
MAX_SEGMENT_TOKENS = 500
GREEDY_TOKENS = 256


def make_llm(kv_cache_dtype: str = "auto", sinks: int = 4, recent: int = 0, **kw) -> LLM:
    return LLM(
        str(STORIES),
        calibrate_preemption=False,
        kv_cache_dtype=kv_cache_dtype,
        kv_sink_tokens=sinks,
        kv_recent_tokens=recent,
        **kw,
    )


def heldout_segments(tokenizer, path: Path = HELDOUT, limit: int = MAX_SEGMENT_TOKENS) -> list[list[int]]:
    """Paragraphs packed greedily into segments of at most `limit` tokens (the model's context
    is 512), each tokenised on its own (so each starts with BOS, as a prompt would)."""
    paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    segments: list[list[int]] = []
    current: list[str] = []
    for p in paras:
        trial = "\n\n".join([*current, p])
        if current and len(tokenizer(trial).input_ids) > limit:
            segments.append(tokenizer("\n\n".join(current)).input_ids)
            current = [p]
        else:
            current.append(p)
    if current:
        segments.append(tokenizer("\n\n".join(current)).input_ids)
    return segments


def token_logprobs(llm: LLM, segments: list[list[int]]) -> torch.Tensor:
    """log p(token | prefix) of every token after the first of every segment."""
    sp = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0)
    outs = llm.generate(segments, sp, use_tqdm=False)
    return torch.tensor(
        [d[t].logprob for o in outs for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])],
        dtype=torch.float64,
    )


def perplexity(logprobs: torch.Tensor) -> float:
    return math.exp(-float(logprobs.mean()))


def greedy_tokens(llm: LLM, prompts=GREEDY_PROMPTS, n: int = GREEDY_TOKENS) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(list(prompts), sp, use_tqdm=False)]


def agreement(ref: list[list[int]], out: list[list[int]]) -> tuple[float, float]:
    """(positions equal before the first divergence, positions equal overall), as fractions."""
    prefix = overall = total = 0
    for a, b in zip(ref, out, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += first
        overall += sum(x == y for x, y in zip(a, b))
        total += len(a)
    return prefix / total, overall / total


@contextlib.contextmanager
def perturbed_keys(rel: float = 1e-3, seed: int = 0):
    """Control: the unquantised cache with every new key scaled by (1 + rel * N(0, 1)) — how
    sensitive this model's greedy output is to a perturbation far below int8's."""
    from kvledger.model.attention.torch_backend import TorchAttentionBackend

    orig = TorchAttentionBackend.forward
    g = torch.Generator().manual_seed(seed)

    def forward(self, q, k, v, layer_cache, meta, scale):
        k = k * (1 + rel * torch.randn(k.shape, generator=g, dtype=k.dtype))
        return orig(self, q, k, v, layer_cache, meta, scale)

    TorchAttentionBackend.forward = forward
    try:
        yield
    finally:
        TorchAttentionBackend.forward = orig


def run(formats=FORMATS, sinks=(0, 4), recents=(0, 32), greedy: bool = True) -> dict:
    t0 = time.perf_counter()
    ref_llm = make_llm("auto")
    segments = heldout_segments(ref_llm.tokenizer)
    ref_lp = token_logprobs(ref_llm, segments)
    ref_ppl = perplexity(ref_lp)
    ref_tokens = greedy_tokens(ref_llm) if greedy else None
    rows = []
    if greedy:
        with perturbed_keys():
            llm = make_llm("auto")
            ppl = perplexity(token_logprobs(llm, segments))
            prefix, overall = agreement(ref_tokens, greedy_tokens(llm))
        rows.append({
            "kv_cache_dtype": "auto+0.1% K noise", "kv_sink_tokens": 0, "kv_recent_tokens": 0,
            "perplexity": ppl, "ppl_increase_pct": 100 * (ppl / ref_ppl - 1),
            "bytes_per_token": llm.ledger().bytes_per_token,
            "greedy_prefix_agree": prefix, "greedy_overall_agree": overall,
        })
    for fmt in formats:
        for s in sinks:
            for r in recents:
                llm = make_llm(fmt, s, r)
                lp = token_logprobs(llm, segments)
                ppl = perplexity(lp)
                row = {
                    "kv_cache_dtype": fmt,
                    "kv_sink_tokens": s,
                    "kv_recent_tokens": r,
                    "perplexity": ppl,
                    "ppl_increase_pct": 100 * (ppl / ref_ppl - 1),
                    "bytes_per_token": llm.ledger().bytes_per_token,
                }
                if greedy:
                    row["greedy_prefix_agree"], row["greedy_overall_agree"] = agreement(
                        ref_tokens, greedy_tokens(llm)
                    )
                rows.append(row)
    return {
        "model": "stories260k (5 layers, 4 KV heads, head_dim 8, float32)",
        "heldout_tokens_scored": int(ref_lp.numel()),
        "segments": [len(s) for s in segments],
        "reference_perplexity": ref_ppl,
        "reference_bytes_per_token": ref_llm.ledger().bytes_per_token,
        "greedy_prompts": len(GREEDY_PROMPTS),
        "greedy_tokens": GREEDY_TOKENS,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", torch {torch.__version__}, {torch.get_num_threads()} threads",
    }


def print_table(res: dict) -> None:
    print(f"model: {res['model']}; {res['heldout_tokens_scored']} held-out tokens in segments "
          f"{res['segments']}; greedy: {res['greedy_prompts']} prompts x {res['greedy_tokens']} tokens")
    print(f"reference (auto, {res['reference_bytes_per_token']} B/token): perplexity "
          f"{res['reference_perplexity']:.4f}")
    print(f"{'format':<17} {'sinks':>5} {'window':>6} {'B/token':>7} {'perplexity':>10} {'vs auto':>8} "
          f"{'greedy prefix':>13} {'greedy all':>10}")
    for r in res["rows"]:
        g1 = f"{r['greedy_prefix_agree']:.3f}" if "greedy_prefix_agree" in r else "-"
        g2 = f"{r['greedy_overall_agree']:.3f}" if "greedy_overall_agree" in r else "-"
        print(f"{r['kv_cache_dtype']:<17} {r['kv_sink_tokens']:>5} {r['kv_recent_tokens']:>6} "
              f"{r['bytes_per_token']:>7} {r['perplexity']:>10.4f} {r['ppl_increase_pct']:>+7.2f}% "
              f"{g1:>13} {g2:>10}")
    print(f"({res['seconds']:.1f} s; {res['machine']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = run()
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
