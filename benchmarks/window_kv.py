"""KV bytes held by one 32k-token request of a sliding-window model, with and without freeing
the blocks outside the window (issue 20): the ledger's figures for Gemma 3 27B, and the
engine's measured pool against the ledger on small random-weight Gemma-3-like models.

Measured: one request of 32,752 prompt tokens + 18 greedy tokens through kvledger's engine
(chunked prefill, then decode), the pool's used blocks read from the live ledger after every
step: "held" is the pool when the request's context reaches 32,768 tokens (used blocks times
bytes per block), "peak" the most it held at any step (a prefill chunk adds its own blocks). Two tiny models share the shape (12 layers,
window 1024, 2 KV heads x 16): "gemma3-like" with Gemma 3's 5:1 local/global pattern, and
"all-local" with every layer sliding. The Gemma-3-like model runs twice: with kvledger's KV cache
groups (vLLM's hybrid KV cache manager layout: sliding groups free blocks outside the window) and
with --disable-hybrid-kv-cache-manager (one block table for every layer: nothing freed).

    python -m benchmarks.window_kv
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_header

CONTEXT = 32768


def ledger_gemma3_27b(context: int) -> None:
    from kvledger.ledger.accounting import format_bytes, parse_size, plan_capacity
    from kvledger.ledger.spec import PRESETS

    spec = PRESETS["gemma-3-27b"]
    plan = plan_capacity(spec, parse_size("80GiB"), context_len=context, block_size=16)
    print(f"\nledger: {spec.name} ({spec.num_full_layers} full + {spec.num_sliding_layers} sliding layers, "
          f"window {spec.sliding_window}), bf16, block 16, one 80 GiB device (0.9 usable)")
    print(f"  KV per token: {plan.bytes_per_token:,} B charged per token by every layer, "
          f"{plan.asymptotic_bytes_per_token:,} B asymptotic (full layers only), "
          f"{plan.bytes_per_token_at_context:,.0f} B at {context:,} tokens")
    w, wo = plan.request_bytes_with_window_freeing, plan.request_bytes_without_window_freeing
    print(f"  one {context:,}-token request: {format_bytes(w)} with window freeing, "
          f"{format_bytes(wo)} without ({wo / w:.2f}x)")
    print(f"  {context:,}-token requests that fit: {plan.max_concurrency_with_window_freeing} with, "
          f"{plan.max_concurrency_without_window_freeing} without")
    print(f"  kvledger's pool: {plan.num_full_groups} full + {plan.num_sliding_groups} sliding KV cache "
          f"groups of {plan.group_size} layers: {plan.blocks_per_request:,} blocks = "
          f"{format_bytes(plan.request_cost_bytes(context))} per request, {plan.max_concurrency} fit")


def build(path: Path, all_local: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    types = ["sliding_attention" if (i + 1) % 6 or all_local else "full_attention" for i in range(12)]
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=1024,
        layer_types=types, max_position_embeddings=CONTEXT + 16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))


def measure(name: str, all_local: bool, chunk: int, disable_hybrid: bool = False) -> None:
    from kvledger import LLM, SamplingParams
    from kvledger.ledger.accounting import format_bytes, request_kv
    from kvledger.ledger.spec import load_model_spec

    with tempfile.TemporaryDirectory() as d:
        build(Path(d), all_local)
        spec = load_model_spec(d)
        llm = LLM(d, block_size=16, max_num_batched_tokens=chunk, calibrate_preemption=False,
                  disable_hybrid_kv_cache_manager=disable_hybrid)
        eng = llm.engine
        prompt = [3 + i % 250 for i in range(CONTEXT - 16)]
        sp = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
        eng.add_request(prompt, sp, request_id="r")
        peak, held, t0 = 0, None, time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            snap = eng.ledger()
            peak = max(peak, snap.used_blocks)
            if "r" in snap.requests and snap.requests["r"].num_tokens == CONTEXT:
                held = snap.used_blocks
        seconds = time.perf_counter() - t0
        measured = held * snap.bytes_per_block
        r = request_kv(spec, CONTEXT, 16, "auto")
        ledger = r.bytes_without_window_freeing if disable_hybrid else r.bytes
        groups = len(eng.kv_layout.groups)
        print(f"\nmeasured: {name} ({spec.num_full_layers} full + {spec.num_sliding_layers} sliding, "
              f"float32), {CONTEXT:,} tokens in chunks of {chunk}, {seconds:.1f} s")
        print(f"  pool at {CONTEXT:,} tokens: {held:,} blocks x {snap.bytes_per_block:,} B = "
              f"{format_bytes(measured)} (peak {peak:,} blocks; {groups} KV cache group(s) of "
              f"{eng.kv_layout.group_size} layers)")
        print(f"  ledger   : {format_bytes(ledger)} held by kvledger's pool; "
              f"{format_bytes(r.bytes_with_window_freeing)} with window freeing, "
              f"{format_bytes(r.bytes_without_window_freeing)} without")
        print(f"  measured == ledger: {measured == ledger}")
        print(json.dumps({"model": name, "held_blocks": held, "peak_blocks": peak, "measured_bytes": measured,
                          "ledger_bytes": ledger}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print_header(f"KV held by one {CONTEXT:,}-token request: sliding windows freed or not")
    ledger_gemma3_27b(CONTEXT)
    measure("gemma3-like", all_local=False, chunk=args.chunk)
    measure("gemma3-like, --disable-hybrid-kv-cache-manager", all_local=False, chunk=args.chunk, disable_hybrid=True)
    measure("all-local", all_local=True, chunk=args.chunk)


if __name__ == "__main__":
    main()
