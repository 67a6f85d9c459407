"""Hugging Face ``generate`` with static batches: the baseline of issue 3.

This is how people batch with plain ``transformers``: chunk the requests in arrival order
into batches of ``batch_size``, left-pad the prompts, and call ``generate`` once per batch.
With ``ignore_eos`` semantics a batch runs until its *longest* request is done, so every
row is decoded for ``max(max_tokens)`` steps; only each request's own ``max_tokens`` count
as useful generated tokens (the rest is reported as waste).

``ignore_eos`` is reproduced exactly by running ``generate`` with ``eos_token_id=None``:
nothing stops early and the EOS logit is NOT masked (``min_new_tokens`` would mask it and
could change greedy tokens relative to an engine that merely ignores EOS).

TTFT: all requests arrive at t0 (offline). A streamer records the wall time at which each
``generate`` call emits its first new token, so a request's TTFT = the queueing behind
earlier batches + its own batch's prefill + first sampling step. Measured, not estimated.

Runs in the system Python (torch + transformers). CLI: ``python -m benchmarks.hf_static``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ContentionProbe,
    Timer,
    ensure_model,
    make_workload,
    peak_rss_mib_self,
    print_header,
    print_result_table,
    save_json,
    ttft_stats,
    workload_summary,
)


class _FirstTokenClock:
    """``generate`` streamer: remembers when the first *new* tokens were pushed."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value: Any) -> None:
        # Call 1 is the prompt (input_ids); call 2 carries the first generated token per row.
        self.calls += 1
        if self.calls == 2 and self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def load_hf_model(model_path: str | Path, threads: int | None = None, dtype: str = "float32"):
    """Load the model (float32 unless told) for greedy generation with EOS disabled (ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype)).eval()
    gc = model.generation_config
    gc.eos_token_id = None  # ignore_eos: never stop early, never mask EOS
    gc.pad_token_id = 0
    gc.do_sample = False
    gc.temperature = gc.top_p = gc.top_k = None
    return model


def hf_greedy_one(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference greedy tokens for one request, unbatched, no padding, float32."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def hf_greedy_with_margins(
    model, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """Like :func:`hf_greedy_one`, plus the top-1 minus top-2 logit gap at every step.

    The gap tells whether a divergence between two engines happened at a near-tie
    (float32 summation-order noise) or at a clear decision (a real bug).
    """
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    margins = []
    for lg in out.logits:
        top2 = torch.topk(lg[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(prompt) :].tolist(), margins


def _generate_batch(model, batch: list[dict[str, Any]]):
    """One static batch: left-pad, decode max(max_tokens) steps for every row.

    Returns (sequences, padded prompt length, wall time of the first new token).
    """
    import torch

    plen = max(len(r["prompt_token_ids"]) for r in batch)
    steps = max(r["max_tokens"] for r in batch)
    ids = torch.zeros((len(batch), plen), dtype=torch.long)
    mask = torch.zeros((len(batch), plen), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding
        p = r["prompt_token_ids"]
        ids[i, plen - len(p) :] = torch.tensor(p)
        mask[i, plen - len(p) :] = 1
    clock = _FirstTokenClock()
    with torch.inference_mode():
        seq = model.generate(
            ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, streamer=clock
        )
    assert seq.shape[1] == plen + steps, "generate stopped early: EOS not disabled?"
    return seq, plen, clock.first_token_time or float("nan")


def run_hf_static(
    model_path: str | Path,
    workload: list[dict[str, Any]],
    batch_size: int = 16,
    threads: int | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    """Run the whole workload as static batches; return figures and per-request outputs.

    Returned keys: engine, tok_per_s (useful tokens / wall), wall_s, startup_s, ttft_*,
    computed_tokens (rows x steps actually decoded), waste_frac, outputs (token id lists,
    in workload order), ttfts_s, peak_rss_mib (of this process).
    """
    import torch

    with Timer() as t_start:
        model = load_hf_model(model_path, threads)
        if warmup:  # first-call overheads (allocator, kernels) belong to start-up
            w = torch.full((2, 8), 5, dtype=torch.long)
            with torch.inference_mode():
                model.generate(w, attention_mask=torch.ones_like(w), max_new_tokens=4)

    outputs: list[list[int]] = [[] for _ in workload]
    ttfts: list[float] = [0.0] * len(workload)
    computed = 0
    with ContentionProbe() as probe:
        t0 = time.perf_counter()
        for b0 in range(0, len(workload), batch_size):
            batch = workload[b0 : b0 + batch_size]
            seq, plen, first_t = _generate_batch(model, batch)
            computed += seq.shape[0] * (seq.shape[1] - plen)
            for i, r in enumerate(batch):
                outputs[b0 + i] = seq[i, plen : plen + r["max_tokens"]].tolist()
                ttfts[b0 + i] = first_t - t0
            print(
                f"[hf_static] batch {b0 // batch_size + 1}: {len(batch)} rows x "
                f"{seq.shape[1] - plen} steps, t={time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        wall = time.perf_counter() - t0

    useful = sum(r["max_tokens"] for r in workload)
    return {
        "engine": f"hf-static-bs{batch_size}",
        "tok_per_s": useful / wall,
        "wall_s": wall,
        "startup_s": t_start.s,
        "useful_tokens": useful,
        "computed_tokens": computed,
        "waste_frac": 1 - useful / computed,
        **ttft_stats(ttfts),
        "ttft_method": "streamer: wall time of each generate() call's first new token, from t0",
        "ttfts_s": ttfts,
        "outputs": outputs,
        "threads": torch.get_num_threads(),
        "contention": probe.as_dict(),
        "peak_rss_mib": peak_rss_mib_self(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench-30m", choices=["bench-30m", "bench-60m"])
    ap.add_argument("--model", help="model folder (default: build/reuse the preset)")
    ap.add_argument("--workload", type=Path, help="workload JSON (default: make_workload)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--result-json", type=Path)
    ap.add_argument("--quiet", action="store_true", help="no table (the caller prints one)")
    a = ap.parse_args(argv)

    path = a.model or ensure_model(a.preset)
    if a.workload:
        wl = json.loads(a.workload.read_text())
    else:
        wl = make_workload(n=a.num_requests, seed=a.seed)
    res = run_hf_static(path, wl, batch_size=a.batch_size, threads=a.threads)
    if a.result_json:
        save_json(res, a.result_json)
    if a.quiet:
        return
    print_header("HF generate, static batches")
    print(f"model   : {path}\nworkload: {workload_summary(wl)}")
    print(
        f"decoded {res['computed_tokens']} row-steps for {res['useful_tokens']} useful tokens "
        f"(waste {res['waste_frac']:.0%})"
    )
    print_result_table([res])


if __name__ == "__main__":
    main()
