"""Compile the Triton kernels for an H100/H200 (sm_90) without a GPU: Triton's front end, its
MLIR passes, LLVM and the ptxas it ships, down to a cubin. The interpreter tests prove the kernels'
arithmetic; this proves the compiled path accepts them. Run with TRITON_INTERPRET unset:

    python tests/triton_compile_check.py [--all]
"""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kvledger.model.attention.triton_kernels as tk  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
STRIDES_ATTN = ["stride_qt", "stride_qh", "stride_nt", "stride_nh", "stride_vnt", "stride_vnh",
                "stride_ot", "stride_oh",
                "stride_cs", "stride_ch", "stride_ss", "stride_bt", "stride_ovr", "stride_ovh"]  # fmt: skip
STRIDES_WRITE = ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs", "stride_ch", "stride_ss"]


def _compile(fn, sig: dict, consts: dict, name: str) -> bool:
    sig = {**sig, **{k: "constexpr" for k in consts}}
    t = time.time()
    try:
        k = triton.compile(ASTSource(fn, sig, consts), target=TARGET)
    except Exception as e:  # noqa: BLE001 - report any compiler error with the case
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:3000]}")
        return False
    print(f"ok   {name}: {time.time() - t:.1f} s, {len(k.asm['cubin'])} bytes of cubin")
    return True


def attention(
    dt: str, d: int, kfmt: int, vfmt: int, ov: bool, splits: int, block_m: int, win: bool = False
) -> bool:
    cdt = {0: dt, 1: "i8", 2: "u8"}
    sig = {
        "out_ptr": f"*{dt}", "part_ptr": "*fp32", "ml_ptr": "*fp32",
        "q_ptr": f"*{dt}", "kn_ptr": f"*{dt}", "vn_ptr": f"*{dt}",
        "kc_ptr": f"*{cdt[kfmt]}", "vc_ptr": f"*{cdt[vfmt]}", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
        "ovk_ptr": f"*{dt}", "ovv_ptr": f"*{dt}",
        "ov_base_ptr": "*i32", "sink_from_ptr": "*i32", "window_from_ptr": "*i32",
        "block_tables_ptr": "*i64", "seq_lens_ptr": "*i64", "qsl_ptr": "*i64",
        "scale": "fp32", "num_seqs": "i32", "sinks": "i32", "recent": "i32",
        "window": "i32", "softcap": "fp32",
        **{s: "i32" for s in STRIDES_ATTN},
    }  # fmt: skip
    consts = dict(GROUP=4, BLOCK_M=block_m, BLOCK_Q=block_m // 4, HEAD_DIM=d, HEAD_PAD=d,
                  TILE_N=64, BLOCK_SIZE=16, K_FMT=kfmt, V_FMT=vfmt, OVERLAY=ov,
                  NUM_SPLITS=splits, IEEE=dt == "fp32", UPCAST=False,
                  HAS_WINDOW=win, HAS_SOFTCAP=win)  # fmt: skip
    name = f"attention {dt} d{d} formats {kfmt}/{vfmt} overlay={ov} splits={splits} BLOCK_M={block_m}"
    name += " window+softcap" if win else ""
    return _compile(tk._attention_kernel, sig, consts, name)


def reduce(splits: int) -> bool:
    sig = {"out_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32", "stride_ot": "i32", "stride_oh": "i32"}
    return _compile(tk._reduce_kernel, sig, dict(HEAD_DIM=128, HEAD_PAD=128, NUM_SPLITS=splits), f"reduce splits={splits}")


def write_kv(dt: str, kf: int, vf: int) -> bool:
    cdt = {0: dt, 1: "i8", 2: "u8"}
    sig = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "slot_ptr": "*i64", "kc_ptr": f"*{cdt[kf]}",
           "vc_ptr": f"*{cdt[vf]}", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
           **{s: "i32" for s in STRIDES_WRITE}}  # fmt: skip
    consts = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_PAD=128, K_FMT=kf, V_FMT=vf)
    return _compile(tk._write_kv_kernel, sig, consts, f"write_kv {dt} formats {kf}/{vf}")


def main() -> int:
    ok = write_kv("bf16", 2, 1) and attention("bf16", 64, 0, 0, False, 8, 16) and reduce(8)
    if "--all" in sys.argv:
        for case in [("bf16", 128, 0, 0, False, 1, 64), ("fp16", 256, 0, 0, False, 4, 16),
                     ("bf16", 128, 1, 1, True, 1, 64), ("bf16", 128, 2, 1, True, 4, 16),
                     ("fp32", 64, 0, 0, False, 1, 16), ("bf16", 256, 0, 0, False, 2, 64, True)]:  # fmt: skip
            ok &= attention(*case)
        ok &= write_kv("bf16", 0, 0) and write_kv("fp16", 1, 1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
