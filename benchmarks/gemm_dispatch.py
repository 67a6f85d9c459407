"""Is the product kvledger runs ever slower than the library beside it? (issue 41)

For every row count of a list from 1 to 2,048, in float32 and bfloat16, one decoder layer's
products of the 60M model (bench-60m; its own packed weights) timed three ways in one process,
calls alternated: the native row-wise kernel on m rows, oneDNN on the row bucket kvledger pads to
(gemm_rows.gemm_rows_bucket, padded in place as the model's activations are), and oneDNN on exactly
m rows (what torch alone would run). The dispatch is calibrated first (fresh, as a first start
does, not read from the cache); the table prints what it picks, and the time of that pick over the
fastest of the three: the target is <= 1.05 at every row count. The builtin rules (measured on Zen 4)
are scored beside it.

    python -m benchmarks.gemm_dispatch [--dtype float32,bfloat16] [--model bench-60m] [--rows 1,8,700] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import ensure_model, interleaved_ms, print_header
from kvledger.kernels import native
from kvledger.kernels.gemm_dispatch import GemmDispatch
from kvledger.kernels.gemm_rows import gemm_rows_bucket
from kvledger.model import gemm_calibration
from kvledger.model.loader import load_model

ROWS = [
    1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 64, 80, 100, 128, 160, 200, 256, 300, 384, 450,
    512, 600, 700, 768, 900, 1000, 1024, 1025, 1100, 1200, 1300, 1536, 1700, 1900, 2000, 2048,
]  # fmt: skip
TARGET = 1.05


def _library_exact(lin, x: torch.Tensor) -> torch.Tensor:
    if lin.packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
    return torch.nn.functional.linear(x, lin.weight, lin.bias)


def score(model_name: str, dtype: torch.dtype, rows: list[int]) -> tuple[float, float]:
    model = load_model(str(ensure_model(model_name)), dtype=dtype).model
    linears = gemm_calibration.layer_linears(model)
    t0 = time.perf_counter()
    d = gemm_calibration.measure(linears, dtype, max(rows))
    print(f"\n== {model_name} {dtype}: calibrated in {time.perf_counter() - t0:.2f} s ({len(d.rows)} row counts)")
    builtin = GemmDispatch("builtin")
    print(
        f"{'rows':>6} {'bucket':>6} {'native':>9} {'oneDNN@bkt':>10} {'oneDNN@m':>9}  {'picks':<7}"
        f"{'pick/best':>9}  {'builtin':<7}{'pick/best':>9}"
    )
    worst = worst_builtin = 0.0
    with torch.inference_mode():
        for m in rows:
            mp = gemm_rows_bucket(m)
            g = torch.Generator().manual_seed(m)
            # m-row views of bucket-row tensors: oneDNN pads them in place, as the model's inputs
            xs = [torch.randn(mp, lin.small.k, generator=g).to(dtype)[:m] for lin in linears]
            pairs = list(zip(linears, xs, strict=True))
            calls = {
                "native": lambda i, p=pairs: [native.small_gemm(x, lin.small, lin.bias) for lin, x in p],
                "bucket": lambda i, p=pairs: [lin._big(x) for lin, x in p],
                "exact": lambda i, p=pairs: [_library_exact(lin, x) for lin, x in p],
            }
            reps = 15 if m <= 256 else 7
            t = interleaved_ms(calls, reps, warmup=2)
            best = min(t.values())
            pick = "native" if d.native_takes(m, dtype) else "oneDNN"
            ratio = t["native" if pick == "native" else "bucket"] / best
            bpick = "native" if builtin.native_takes(m, dtype) else "oneDNN"
            bratio = t["native" if bpick == "native" else "bucket"] / best
            worst, worst_builtin = max(worst, ratio), max(worst_builtin, bratio)
            flag = "  <-- over" if ratio > TARGET else ""
            print(
                f"{m:6d} {mp:6d} {t['native']:9.3f} {t['bucket']:10.3f} {t['exact']:9.3f}  {pick:<7}"
                f"{ratio:9.3f}  {bpick:<7}{bratio:9.3f}{flag}"
            )
    print(f"worst pick/best: calibrated {worst:.3f}, builtin {worst_builtin:.3f} (target <= {TARGET})")
    return worst, worst_builtin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-60m")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 keeps a shared machine's stalls out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_header("GEMM dispatch vs the fastest kernel per row count")
    if native.library() is None:
        raise SystemExit("native kernels unavailable here: nothing to dispatch")
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.dtype.split(","):
        score(args.model, getattr(torch, name), rows)


if __name__ == "__main__":
    main()
