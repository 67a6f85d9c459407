"""Run one token-id workload through kvledger's offline API; figures + outputs as JSON.

The hook for the kvledger side of ``vs_hf.py`` / ``vs_vllm_cpu.py``. It uses only the
public offline API::

    from kvledger import LLM, SamplingParams
    llm = LLM(model=path, dtype="float32", block_size=..., num_kv_blocks=...,
              max_num_batched_tokens=...)
    outs = llm.generate(list_of_token_id_lists,
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), ...],
                        use_tqdm=False)
    outs[i].outputs[0].token_ids, outs[i].metrics.first_token_time / .arrival_time

``startup_s`` = constructor + one 2-token warm-up request (HF gets the same warm-up; vLLM
warms up inside its constructor). TTFT = ``metrics.first_token_time - metrics.arrival_time``
per request (seconds; both taken from the same clock by the engine); if the engine gives no
metrics, TTFT is reported as unavailable rather than guessed.

CLI (fresh process, so ``ru_maxrss`` is kvledger's own):
``python -m benchmarks.kvledger_runner --model DIR --workload WL.json --result-json OUT.json``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ContentionProbe, Timer, peak_rss_mib_self, save_json, ttft_stats


def _get(obj: Any, name: str) -> Any:
    """Attribute or dict key, None if absent."""
    if obj is None:
        return None
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def run_kvledger(
    model_path: str | Path,
    workload: list[dict[str, Any]],
    block_size: int | None = None,
    num_kv_blocks: int | None = None,
    max_num_batched_tokens: int | None = None,
    threads: int | None = None,
    warmup: bool = True,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Generate the whole workload in one ``llm.generate`` call; see module docstring."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from kvledger import LLM, SamplingParams

    engine_kw = {
        k: v
        for k, v in dict(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype,
        ).items()
        if v is not None
    }
    with Timer() as t_start:
        llm = LLM(model=str(model_path), dtype=dtype, **engine_kw)
        if warmup:
            llm.generate(
                [[5] * 8],
                [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)],
                use_tqdm=False,
            )

    prompts = [r["prompt_token_ids"] for r in workload]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in workload
    ]
    with ContentionProbe() as probe:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0

    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    ttfts: list[float] = []
    ttft_note = "kvledger RequestOutput.metrics: first_token_time - arrival_time"
    for o in outs:
        m = _get(o, "metrics")
        ft, at = _get(m, "first_token_time"), _get(m, "arrival_time")
        if ft is None or at is None:
            ttfts, ttft_note = [], f"unavailable: RequestOutput.metrics={m!r}"
            break
        ttfts.append(ft - at)

    n_gen = sum(len(t) for t in token_ids)
    requested = sum(r["max_tokens"] for r in workload)
    return {
        "engine": "kvledger",
        "tok_per_s": n_gen / wall,
        "wall_s": wall,
        "startup_s": t_start.s,
        "generated_tokens": n_gen,
        "requested_tokens": requested,
        "length_errors": [
            i for i, (t, r) in enumerate(zip(token_ids, workload)) if len(t) != r["max_tokens"]
        ],
        **ttft_stats(ttfts),
        "ttfts_s": ttfts or None,
        "ttft_method": ttft_note,
        "contention": probe.as_dict(),
        "settings": {"threads": torch.get_num_threads(), "dtype": dtype, **engine_kw},
        "outputs": token_ids,
        "peak_rss_mib": peak_rss_mib_self(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvledger runner for the peer benchmarks")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True, type=Path)
    ap.add_argument("--result-json", required=True, type=Path)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--num-kv-blocks", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_int8"])
    a = ap.parse_args(argv)
    res = run_kvledger(
        a.model,
        json.loads(a.workload.read_text()),
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        max_num_batched_tokens=a.max_num_batched_tokens,
        threads=a.threads,
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
    )
    save_json(res, a.result_json)
    print(f"[kvledger_runner] {res['tok_per_s']:.1f} tok/s, wall {res['wall_s']:.2f} s")


if __name__ == "__main__":
    main()
