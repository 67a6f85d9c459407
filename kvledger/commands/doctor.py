"""`kvledger doctor`: what this machine gives kvledger's CPU kernels, and which kernel takes which
products of a model here, with the times that decided it (kernels/gemm_dispatch.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvledger.model.default import DEFAULT_MODEL_NAME

# CPU flags that decide which kernels can run (shown when present, AMX's absence said).
FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
    "avx512_vnni", "avx_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="show the CPU's kernel paths and the GEMM dispatch chosen for a model here",
        description=(
            "Print the CPU model and the flags kvledger's kernels use (AVX2, AVX-512, "
            "AVX512-BF16/VNNI, AMX), the native build loaded, and for MODEL the GEMM dispatch: "
            "at each probed row count the native row-wise kernel's and oneDNN's time for one "
            "decoder layer's products, and which kernel takes which rows (KVLEDGER_GEMM_DISPATCH; "
            "calibrated at first start and cached per CPU, threads and shapes)."
        ),
    )
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL_NAME, help="HF model folder (default: the embedded stories260k)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="weights' dtype (default: the model's)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, metavar="N",
        help="rows of the largest step to calibrate for (default 2048, vLLM's CPU default)",
    )  # fmt: skip
    p.add_argument("--recalibrate", action="store_true", help="measure again, ignoring (and replacing) the cached times")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _cpu() -> dict:
    from kvledger.kernels.native_build import _cpu_flags, cpu_model, library, selected_isa

    name = cpu_model()
    flags = set(_cpu_flags().split())
    lib = library()
    return {
        "cpu": name,
        "flags": [f for f in FLAGS if f in flags],
        "amx": {"amx_tile", "amx_bf16"} <= flags,
        "native_isa": selected_isa() if lib is not None else None,
        "native_bf16_blocked": bool(lib is not None and lib.bf16_packed),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from kvledger import envs
    from kvledger.errors import ConfigError
    from kvledger.kernels.gemm_dispatch import TOLERANCE, GemmDispatch, dtype_name
    from kvledger.model import gemm_calibration
    from kvledger.model.default import resolve_named_model
    from kvledger.model.layers import _onednn_bf16
    from kvledger.model.loader import load_model

    if args.max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    info = _cpu()
    info["threads"] = torch.get_num_threads()
    info["onednn_bf16"] = _onednn_bf16()
    info["batch_invariant"] = envs.KVLEDGER_BATCH_INVARIANT
    mode = envs.KVLEDGER_GEMM_DISPATCH
    loaded = load_model(resolve_named_model(args.model), dtype=args.dtype)
    dtype, top = loaded.dtype, args.max_num_batched_tokens
    if args.recalibrate and mode == "calibrated":
        linears = gemm_calibration.layer_linears(loaded.model)
        d = gemm_calibration.measure(linears, dtype, top) if linears else GemmDispatch("builtin")
        if linears and not d.noisy:
            gemm_calibration.remember(loaded.model, top, d)
    else:
        d = gemm_calibration.model_dispatch(loaded.model, top, mode)
    info["model"], info["dtype"] = args.model, dtype_name(dtype)
    info["dispatch"] = {
        "mode": d.mode, "source": d.source, "seconds": d.seconds, "noisy": d.noisy, "tolerance": TOLERANCE,
        "rows": list(d.rows), "native_ms": list(d.native_ms), "onednn_ms": list(d.library_ms),
        "ranges": [{"first": a, "last": b, "kernel": "native" if n else "onednn"} for a, b, n in d.ranges(top, dtype)],
    }  # fmt: skip
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"CPU: {info['cpu']}; torch threads {info['threads']}")
    print(f"flags: {' '.join(info['flags']) or 'none of ' + ' '.join(FLAGS)}")
    if info["native_isa"] is None:
        print("native kernels: not loaded (KVLEDGER_NATIVE=0, no compiler or no AVX2): torch's kernels run")
    else:
        bf16 = "blocked bf16 (vdpbf16ps)" if info["native_bf16_blocked"] else "row-major bf16 (widened to float32)"
        print(f"native kernels: {info['native_isa']} build, {bf16}")
    print(f"oneDNN bf16: {'native' if info['onednn_bf16'] else 'not native here (emulated)'}")
    if info["amx"]:
        print("AMX: on this CPU; kvledger has no AMX tile kernels yet, oneDNN's products use it")
    else:
        print("AMX: not on this CPU")
    print(f"batch invariance (KVLEDGER_BATCH_INVARIANT): {'on' if info['batch_invariant'] else 'off'}")
    print(f"\nGEMM dispatch for {args.model} ({info['dtype']}), KVLEDGER_GEMM_DISPATCH={mode}:")
    if d.mode == "calibrated":
        how = f"measured in {d.seconds:.2f} s" if d.seconds else f"read from {d.source}"
        if d.noisy:
            how += "; unsteady timings (the cores busy?), so not cached: run again on a quiet machine"
        print(f"  one decoder layer's products, fastest of several rounds ({how}):")
        print(f"  {'rows':>6} {'native ms':>10} {'oneDNN ms':>10} {'ratio':>6}  takes")
        for m, a, b in zip(d.rows, d.native_ms, d.library_ms, strict=True):
            takes = "native" if d.native_takes(m, dtype) else "oneDNN"
            print(f"  {m:6d} {a:10.3f} {b:10.3f} {a / b:6.2f}  {takes}")
        print(
            f"  rule: the native kernel while its time is <= {TOLERANCE}x oneDNN's on the row's bucket "
            "(interpolated between the rows timed; it keeps the native decoder layer and bf16 row "
            "invariance there)"
        )
    elif d.source:
        print(f"  {d.source}")
    print("  " + d.describe(top, dtype))
    return 0
