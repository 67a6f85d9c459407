"""kvledger vs vLLM's CPU build (issue 7).

Same token-id workload for both: 64 requests, prompts 32-256 tokens, outputs 16-64 tokens
for 90% and 256-512 for 10%, greedy, ignore_eos; random-weight Llama "bench-60m" (8 layers,
hidden 512, GQA 8/2, 60.0M params), run by both engines in --dtype (float32 or bfloat16);
kvledger's KV cache format can be set apart (--kv-cache-dtype int8 / fp8 / fp8_int8). vLLM runs in its own virtualenv
(``benchmarks/setup_vllm_env.sh``) as a separate process (``benchmarks/vllm_runner.py``,
block size 32, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``);
kvledger runs in a fresh system-Python process (``benchmarks/kvledger_runner.py``).

Exactness: both engines' greedy tokens are compared with HF float32 greedy decoding run one
request at a time on a subset (``--check-n``), and with each other on every request. In
bfloat16 the arithmetic differs between engines (and from float32), so the same comparisons,
plus one with HF bfloat16, are reported as agreement (tokens before the first difference),
not claimed identical.

``--quantization w8a8``: both engines run the same compressed-tensors INT8 W8A8 checkpoint
(per-channel int8 weights, dynamic per-token int8 activations), written from the preset's float
folder by ``benchmarks/w8a8_checkpoint.py`` as llm-compressor writes one; kvledger reads its
``quantization_config`` in ``LLM(path)``, vLLM takes its compressed-tensors path
(``CompressedTensorsW8A8Int8``). HF cannot run that checkpoint without the compressed-tensors
package, so the HF comparison is then with the *float* model it was written from: agreement
(how far W8A8 drifts from the float model), not exactness; the engines are compared with each
other on every request as before.

    bash benchmarks/setup_vllm_env.sh                  # once
    python -m benchmarks.vs_vllm_cpu                   # both engines
    python -m benchmarks.vs_vllm_cpu --dtype bfloat16  # both engines in bf16
    python -m benchmarks.vs_vllm_cpu --only vllm       # one engine alone
    python -m benchmarks.vs_vllm_cpu --only kvledger --reuse-vllm   # compare with last vLLM run
    python -m benchmarks.vs_vllm_cpu --quantization w8a8 --dtype bfloat16   # same W8A8 checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_OUT,
    REPO_ROOT,
    ProcTreeRSSPoller,
    claim_out_dir,
    compare_tokens,
    default_vllm_venv,
    ensure_model,
    exactness_report,
    exit_on_sigterm,
    hf_references,
    kill_group,
    kv_bytes_per_token,
    make_workload,
    model_num_params,
    pick_check_indices,
    print_header,
    print_ratio,
    print_result_table,
    run_kvledger,
    save_json,
    workload_sha,
    workload_summary,
)
from benchmarks.w8a8_checkpoint import ensure_w8a8_checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="kvledger vs vLLM CPU")
    ap.add_argument("--only", choices=["vllm", "kvledger"], help="run a single engine")
    ap.add_argument(
        "--preset", default="bench-60m", choices=["bench-30m", "bench-60m", "bench-230m", "bench-230m-v512"]
    )
    ap.add_argument("--model", help="model folder (default: build/reuse the preset)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="for both engines")
    ap.add_argument(
        "--vllm-venv", default=str(default_vllm_venv()),
        help="vLLM's venv (default: $VLLM_VENV, else <kvledger cache dir>/bench_envs/vllm)",
    )
    ap.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-block-size", type=int, default=32, help="vLLM CPU attention: 32")
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="no torch.compile")
    ap.add_argument("--vllm-timeout", type=int, default=1800, help="seconds")
    ap.add_argument(
        "--reuse-vllm",
        action="store_true",
        help="reuse OUT_DIR/vllm.json if it was made for the same model and workload",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "w8a8"],
        help="w8a8: both engines run the same compressed-tensors INT8 W8A8 checkpoint of the model",
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_int8"], help="kvledger only"
    )
    ap.add_argument("--block-size", type=int, default=16, help="kvledger block size")
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        help="kvledger KV blocks (default: the same GiB of KV as --kv-space-gib gives vLLM)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, help="kvledger token budget")
    ap.add_argument("--check-n", type=int, default=8, help="requests in the HF exactness check")
    ap.add_argument("--strict", action="store_true", help="exit 1 on failure or mismatch")
    ap.add_argument("--out-dir", type=Path, default=BENCH_OUT / "vs_vllm_cpu")
    return ap.parse_args(argv)


def run_vllm(a: argparse.Namespace, model: Path, wl_path: Path, fingerprint: dict) -> dict:
    """Run ``vllm_runner.py`` in the vLLM venv (log to OUT_DIR/vllm.log); load its JSON."""
    out = a.out_dir / "vllm.json"
    if a.reuse_vllm and out.exists():
        prev = json.loads(out.read_text())
        if prev.get("fingerprint") == fingerprint:
            print(f"\nreusing {out} (same model and workload)")
            return prev
        print(f"\n{out} is for another model/workload: running vLLM again")
    py = Path(a.vllm_venv) / "bin" / "python"
    if not py.exists():
        raise RuntimeError(f"no vLLM venv at {a.vllm_venv}: run benchmarks/setup_vllm_env.sh")
    cmd = [
        str(py),
        str(REPO_ROOT / "benchmarks" / "vllm_runner.py"),
        str(model),
        str(wl_path),
        str(out),
        "--threads",
        str(a.threads),
        "--kv-space-gib",
        str(a.kv_space_gib),
        "--block-size",
        str(a.vllm_block_size),
        "--dtype",
        a.dtype,
    ] + (["--enforce-eager"] if a.vllm_enforce_eager else [])
    log = a.out_dir / "vllm.log"
    print(f"\n$ {' '.join(cmd)}  > {log} 2>&1", flush=True)
    if out.exists():
        out.unlink()
    with open(log, "w") as lf:
        proc = subprocess.Popen(
            cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
        try:
            with ProcTreeRSSPoller(proc.pid) as poll:
                rc = proc.wait(timeout=a.vllm_timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            kill_group(proc)  # the runner exits with os._exit; reap EngineCore/worker too
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"vllm_runner exited with {rc}; last log lines:\n{tail}")
    res = json.loads(out.read_text())
    res["peak_rss_tree_mib_outer"] = poll.peak_mib
    res["fingerprint"] = fingerprint
    save_json(res, out)
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    claim_out_dir(a.out_dir)
    exit_on_sigterm()
    import torch  # only so the header shows torch's version and threads

    torch.set_num_threads(a.threads)
    float_model = Path(a.model or ensure_model(a.preset, a.seed))
    model = ensure_w8a8_checkpoint(float_model) if a.quantization == "w8a8" else float_model
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    wl = make_workload(n=a.num_requests, seed=a.seed, vocab_size=vocab)
    wl_path = a.out_dir / "workload.json"
    save_json(wl, wl_path)
    fingerprint = {"model": str(model), "workload_sha": workload_sha(wl), "dtype": a.dtype}

    print_header("kvledger vs vLLM CPU")
    from kvledger.kernels import native_build

    print(f"model   : {model} ({model_num_params(model) or '?'} params, {a.dtype})")
    if a.quantization == "w8a8":
        print(f"weights : compressed-tensors INT8 W8A8 (written from {float_model})")
    print(f"kvledger: native kernels {native_build.selected_isa() or 'off (torch)'}, kv_cache_dtype {a.kv_cache_dtype}")
    print(f"workload: {workload_summary(wl)}, sha {fingerprint['workload_sha']}")

    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    if a.only in (None, "vllm"):
        try:
            results["vllm"] = run_vllm(a, model, wl_path, fingerprint)
        except RuntimeError as e:
            failures["vllm"] = str(e)
    # Like-for-like KV memory with vLLM's VLLM_CPU_KVCACHE_SPACE, in the model dtype (a
    # quantised kvledger cache gets the same number of blocks: fewer bytes).
    per_token = kv_bytes_per_token(model, 2 if a.dtype == "bfloat16" else 4)
    if a.num_kv_blocks is None:
        a.num_kv_blocks = a.kv_space_gib * 2**30 // (per_token * a.block_size)
    print(
        f"KV space: vLLM {a.kv_space_gib} GiB (block 32); kvledger {a.num_kv_blocks} blocks x "
        f"{a.block_size} tokens x {per_token} B = "
        f"{a.num_kv_blocks * a.block_size * per_token / 2**30:.2f} GiB ({a.dtype})"
    )
    if a.only in (None, "kvledger"):
        kv_args = ["--model", str(model), "--workload", str(wl_path), "--threads", str(a.threads)]
        try:
            results["kvledger"] = run_kvledger(kv_args, a, a.out_dir / "kvledger.json")
        except RuntimeError as e:
            failures["kvledger"] = str(e)
        if a.only == "kvledger" and a.reuse_vllm and (a.out_dir / "vllm.json").exists():
            prev = json.loads((a.out_dir / "vllm.json").read_text())
            if prev.get("fingerprint") == fingerprint:
                results["vllm"] = prev

    print()
    print_result_table(list(results.values()))
    if "vllm" in results:
        v = results["vllm"]
        print(f"vLLM quantization: {v.get('quantization')}")
        print(
            f"vLLM: peak RSS is summed over its process tree (main, EngineCore, worker); "
            f"summed PSS {v.get('peak_pss_mib', 0):.0f} MiB. TTFT: {v['ttft_method']}"
        )
    if "kvledger" in results:
        print(f"kvledger TTFT: {results['kvledger']['ttft_method']}")
    for name, err in failures.items():
        print(f"{name}: FAILED ({err})")

    ratio, exact, cross = None, None, None
    if "vllm" in results and "kvledger" in results:
        ratio = print_ratio(results["kvledger"], results["vllm"])
        kv, vl = results["kvledger"]["outputs"], results["vllm"]["outputs"]
        same = sum(compare_tokens(x, None, y)["match"] for x, y in zip(vl, kv))
        cross = {"identical": same, "checked": len(wl)}
        print(f"exactness kvledger vs vLLM (all requests): {same}/{len(wl)} identical")
    agree_bf16 = None
    if results and a.check_n > 0:
        idx = pick_check_indices(wl, a.check_n)
        outs = {k: v["outputs"] for k, v in results.items()}
        # W8A8: HF runs the float model the checkpoint was written from (agreement, not exactness).
        ref = "HF float32" + (" (float weights)" if model != float_model else "")
        exact = exactness_report(hf_references(float_model, wl, idx), outs, ref)
        if a.dtype != "float32":  # reported, not claimed identical: the arithmetic differs
            agree_bf16 = exactness_report(
                hf_references(float_model, wl, idx, a.dtype), outs, ref.replace("float32", a.dtype)
            )

    summary = {
        "command": " ".join(sys.argv),
        **fingerprint,
        "quantization": a.quantization,
        "results": {
            k: {kk: vv for kk, vv in v.items() if kk not in ("outputs", "ttft_s")}
            for k, v in results.items()
        },
        "failures": failures,
        "ratio_kvledger_over_vllm": ratio,
        "exactness_vs_hf": exact,
        "agreement_vs_hf_same_dtype": agree_bf16,
        "exactness_kvledger_vs_vllm": cross,
    }
    save_json(summary, a.out_dir / "summary.json")
    print(f"results in {a.out_dir}/")
    bad = bool(failures)
    if exact and a.dtype == "float32" and a.kv_cache_dtype == "auto" and a.quantization == "none":
        bad |= any(e["identical"] != e["checked"] for e in exact.values())
    return 1 if (a.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
