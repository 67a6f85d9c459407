"""Perplexity of quantised weights against the float model, on held-out text (issue 42).

stories260k (a real trained TinyStories Llama; the tests never score these texts) in float32, and
with its layer weights in W8A8 (``quantization="int8"``) and 4-bit groups (``"int4"``, with float
activations and as W4A8 with int8 activations per group of 32), and in bf16 (plain and W4A8), each
scoring the same stories by their prompt log-probabilities (one forward pass each, the engine's
own logits): perplexity = exp(mean negative log-likelihood of every token after the first).

    python -m benchmarks.quant_quality [--model PATH]
"""

from __future__ import annotations

import argparse
import math
import os

from benchmarks.common import print_header

# Written for this benchmark in TinyStories' style (simple words, short sentences); never used by
# the tests.
STORIES = [
    "Tom had a small red boat. Every morning he took it to the pond near his house. One day the wind "
    "was strong and the boat went far away. Tom was sad, but his dad helped him get it back with a long "
    "stick. Tom said thank you and they went home to eat lunch.",
    "There was a little cat named Mia. Mia liked to sleep in the sun by the window. One day she saw a "
    "bird outside. She jumped up and ran to the door, but the bird flew away. Mia was not sad. She went "
    "back to the window and slept again.",
    "Sara and Ben wanted to build a big castle in the sand. They got a bucket and a spoon. They made "
    "towers and a wall. Then a wave came and broke the wall. Sara laughed and said, \"Let's build it "
    "again, but stronger!\" They worked together until the sun went down.",
    "Once there was a kind old man who had a garden full of flowers. A little girl came to see him "
    "every day. He gave her a yellow flower and told her to take care of it. The girl put it in water "
    "and it grew big and pretty. She was very happy.",
]


def perplexity(llm, tok) -> float:
    from kvledger import SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nll, n = 0.0, 0
    for text in STORIES:
        ids = tok.encode(text)
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= lp[ids[pos]].logprob
            n += 1
    return math.exp(nll / n)


def main() -> None:
    from kvledger import LLM
    from kvledger.model.default import resolve_named_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stories260k")
    args = ap.parse_args()
    print_header("perplexity: quantised weights vs float32, held-out stories")
    path = resolve_named_model(args.model)
    base = None
    # (label, dtype, quantization, KVLEDGER_INT4_ACTIVATIONS): int4 with float activations (float32's
    # default), and W4A8 (int8 activations per group of 32: the default for bf16 models) in both dtypes.
    arms = [("float32", "float32", None, "auto"), ("int8", "float32", "int8", "auto"),
            ("int4", "float32", "int4", "float"), ("int4 W4A8", "float32", "int4", "int8"),
            ("bfloat16", "bfloat16", None, "auto"), ("bf16 int4 W4A8", "bfloat16", "int4", "auto")]  # fmt: skip
    for label, dtype, q, acts in arms:
        os.environ["KVLEDGER_INT4_ACTIVATIONS"] = acts
        llm = LLM(path, dtype=dtype, quantization=q, calibrate_preemption=False)
        ppl = perplexity(llm, llm.get_tokenizer())
        base = base or ppl
        held = llm.engine.executor.worker.ready.weight_bytes
        print(f"{label:>14}: perplexity {ppl:8.4f} ({ppl / base - 1:+.2%} vs float32), weights {held:,} B")
    os.environ.pop("KVLEDGER_INT4_ACTIVATIONS")


if __name__ == "__main__":
    main()
