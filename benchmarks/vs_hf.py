"""kvledger vs Hugging Face ``generate`` with static batches (issue 3).

Same token-id workload for both: 64 requests, prompts 32-256 tokens, outputs 16-64 tokens
for 90% and 256-512 for 10%, greedy, ignore_eos; random-weight float32 Llama "bench-30m"
(31.4M params) on CPU. HF runs in batches of 16 in arrival order with left padding (each
batch lasts as long as its longest request); kvledger gets the whole list in one
``generate`` call. Each engine runs in its own fresh process so its peak RSS is its own.
Target: kvledger generated tokens/s >= 3x HF's.

Exactness: kvledger's greedy tokens (and HF's own batched ones) are compared with HF float32
greedy decoding run one request at a time (no padding) on a subset (``--check-n``).

    python -m benchmarks.vs_hf                   # both engines
    python -m benchmarks.vs_hf --only hf         # one engine alone
    python -m benchmarks.vs_hf --only kvledger
    python -m benchmarks.vs_hf --only kvledger --reuse-hf   # compare with the last HF run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import (
    BENCH_OUT,
    claim_out_dir,
    ensure_model,
    exactness_report,
    exit_on_sigterm,
    hf_references,
    make_workload,
    model_num_params,
    pick_check_indices,
    print_header,
    print_ratio,
    print_result_table,
    run_engine_subprocess,
    run_kvledger,
    save_json,
    workload_sha,
    workload_summary,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="kvledger vs HF generate (static batches)")
    ap.add_argument("--only", choices=["hf", "kvledger"], help="run a single engine")
    ap.add_argument("--preset", default="bench-30m", choices=["bench-30m", "bench-60m"])
    ap.add_argument("--model", help="model folder (default: build/reuse the preset)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    ap.add_argument("--threads", type=int, help="torch threads for both engines")
    ap.add_argument("--block-size", type=int, help="kvledger block size")
    ap.add_argument("--num-kv-blocks", type=int, help="kvledger KV blocks")
    ap.add_argument("--max-num-batched-tokens", type=int, help="kvledger token budget")
    ap.add_argument(
        "--reuse-hf",
        action="store_true",
        help="reuse OUT_DIR/hf.json if it was made for the same model, workload and batch size",
    )
    ap.add_argument("--check-n", type=int, default=8, help="requests in the exactness check")
    ap.add_argument("--target", type=float, default=3.0, help="kvledger/HF ratio to meet")
    ap.add_argument("--strict", action="store_true", help="exit 1 on FAIL or any mismatch")
    ap.add_argument("--out-dir", type=Path, default=BENCH_OUT / "vs_hf")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    claim_out_dir(a.out_dir)
    exit_on_sigterm()
    import torch  # only so the header shows torch's version and threads

    if a.threads:
        torch.set_num_threads(a.threads)
    model = Path(a.model or ensure_model(a.preset, a.seed))
    wl = make_workload(n=a.num_requests, seed=a.seed)
    wl_path = a.out_dir / "workload.json"
    save_json(wl, wl_path)

    print_header("kvledger vs HF generate (static batches)")
    print(f"model   : {model} ({model_num_params(model) or '?'} params, float32)")
    print(f"workload: {workload_summary(wl)}, sha {workload_sha(wl)}")

    common_args = ["--model", str(model), "--workload", str(wl_path)]
    if a.threads:
        common_args += ["--threads", str(a.threads)]
    results, failures = {}, {}
    fingerprint = {"model": str(model), "workload_sha": workload_sha(wl), "bs": a.batch_size}
    hf_json = a.out_dir / "hf.json"
    prev = json.loads(hf_json.read_text()) if (a.reuse_hf and hf_json.exists()) else None
    if prev is not None and prev.get("fingerprint") == fingerprint:
        print(f"\nreusing {hf_json} (same model, workload and batch size)")
        results["hf"] = prev
    elif a.only in (None, "hf"):
        try:
            results["hf"] = run_engine_subprocess(
                "benchmarks.hf_static",
                [*common_args, "--batch-size", str(a.batch_size), "--quiet"],
                hf_json,
            )
            results["hf"]["fingerprint"] = fingerprint
            save_json(results["hf"], hf_json)
        except RuntimeError as e:
            failures["hf"] = str(e)
    if a.only in (None, "kvledger"):
        kv_args = list(common_args)
        try:
            results["kvledger"] = run_kvledger(kv_args, a, a.out_dir / "kvledger.json")
        except RuntimeError as e:
            failures["kvledger"] = str(e)

    print()
    print_result_table(list(results.values()))
    if "hf" in results:
        h = results["hf"]
        print(
            f"HF static: {h['computed_tokens']} row-steps decoded for {h['useful_tokens']} "
            f"useful tokens (waste {h['waste_frac']:.0%}); TTFT: {h['ttft_method']}"
        )
    if "kvledger" in results:
        print(f"kvledger TTFT: {results['kvledger']['ttft_method']}")
    for name, err in failures.items():
        print(f"{name}: FAILED ({err})")

    ratio, exact = None, None
    if "hf" in results and "kvledger" in results:
        ratio = print_ratio(results["kvledger"], results["hf"], a.target)
    if results and a.check_n > 0:
        # HF's own batched (left-padded) outputs are checked too: they show how much padding
        # alone perturbs greedy tokens on this model.
        refs = hf_references(model, wl, pick_check_indices(wl, a.check_n))
        exact = exactness_report(refs, {k: v["outputs"] for k, v in results.items()})

    summary = {
        "command": " ".join(sys.argv),
        "model": str(model),
        "workload_sha": workload_sha(wl),
        "results": {
            k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()
        },
        "failures": failures,
        "ratio": ratio,
        "exactness": exact,
    }
    save_json(summary, a.out_dir / "summary.json")
    print(f"results in {a.out_dir}/")
    bad = bool(failures) or (ratio is not None and ratio < a.target)
    if exact and "kvledger" in exact:
        bad |= exact["kvledger"]["identical"] != exact["kvledger"]["checked"]
    return 1 if (a.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
