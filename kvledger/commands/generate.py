"""`kvledger generate [MODEL] --prompt ...`: offline generation, then the ledger."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvledger.commands.engine_args import add_engine_args, engine_kwargs


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text offline with the paged engine",
        description="Generate from one or more prompts. With no MODEL, uses the embedded "
        "default stories260k (a real 260K-parameter Llama trained on TinyStories; MIT). "
        "'kvledger-tiny' names the random-weight test model.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model folder, hub id, or kvledger-tiny (default: the embedded stories260k)",
    )
    p.add_argument("--model", dest="model_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print outputs and the ledger as JSON")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from kvledger.llm import LLM
    from kvledger.sampling_params import SamplingParams

    model = args.model_opt or args.model
    prompts = args.prompt or ["Once upon a time"]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(model, **engine_kwargs(args))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    ledger = llm.ledger()
    if args.json:
        json.dump(
            {
                "outputs": [
                    {
                        "prompt": o.prompt,
                        "num_cached_tokens": o.num_cached_tokens,
                        "completions": [
                            {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in o.outputs
                        ],
                    }
                    for o in outputs
                ],
                "ledger": ledger.to_dict(),
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    if model == "kvledger-tiny":
        print("# kvledger-tiny: fixed-seed RANDOM weights -- the text is gibberish by design\n")
    for o in outputs:
        for c in o.outputs:
            print(f"{o.prompt!r} -> {c.text!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    print(
        f"\nledger: {ledger.total_blocks} KV blocks x {ledger.block_size} tokens, "
        f"{ledger.bytes_per_token} B/token; used {ledger.used_blocks}, cached {ledger.cached_blocks}, "
        f"free {ledger.free_blocks}; prefix hits {ledger.prefix_cache_hits}/{ledger.prefix_cache_queries} tokens"
    )
    return 0
