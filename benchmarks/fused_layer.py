"""The native decoder layer (kvledger.model.fused_layer) against the module path, whole steps.

One engine on the bench-60m model; once its requests are decoding, steps take turns between the
native layer and the modules (KVLEDGER_FUSED_LAYER, read every step; common.interleaved_ms, the
project's one interleaved timing loop), so that a slower spell of a shared host falls on both.
Two kinds of step: pure decodes of every request, and the same decodes beside a fresh prompt
(aborted after its step, so the batch stays the same). Both paths compute the same bits (tests/test_fused_layer.py), so the tokens do not
depend on which one ran a step. Prints the median step of each and their ratio.

    python -m benchmarks.fused_layer [--dtype float32 bfloat16] [--decodes 8 64] [--prompt 200]
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import ensure_model, interleaved_ms, print_header
from kvledger import LLM, SamplingParams


def measure(path: str, dtype: str, decodes: int, prompt: int, steps: int) -> None:
    llm = LLM(path, dtype=dtype, block_size=32, kv_cache_memory=1 << 30, max_model_len=2048)
    eng = llm.engine
    assert eng.executor.worker.model.fused_layers is not None, "the native layer does not apply here"
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4 * (steps + 3) + 16, ignore_eos=True, temperature=0)
    for i in range(decodes):
        eng.add_request(torch.randint(10, 30000, (150,), generator=g).tolist(), params, request_id=f"r{i}")
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(4):
        eng.step()
    one = SamplingParams(max_tokens=1, temperature=0)

    def step(path_on: str, mixed: bool):
        def run(i: int) -> None:
            os.environ["KVLEDGER_FUSED_LAYER"] = path_on
            rid = f"x{path_on}-{i}"
            if mixed:  # a fresh prompt beside the decodes, gone again after its step
                eng.add_request(torch.randint(10, 30000, (prompt,), generator=g).tolist(), one, request_id=rid)
            eng.step()
            if mixed:
                eng.abort_request(rid)

        return run

    calls = {(kind, on): step(on, kind == "mixed") for kind in ("decode", "mixed") for on in ("1", "0")}
    ms = interleaved_ms(calls, steps)
    os.environ.pop("KVLEDGER_FUSED_LAYER", None)
    for kind, label in (("decode", f"{decodes} decodes"), ("mixed", f"{decodes} decodes + {prompt}-token prompt")):
        a, b = ms[(kind, "1")], ms[(kind, "0")]
        print(f"{dtype:9s} {label:36s} native layer {a:7.2f} ms   modules {b:7.2f} ms   ratio {a / b:5.3f}")
    for r in list(eng.scheduler.running):
        eng.abort_request(r.request_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--decodes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each kind on each path")
    args = ap.parse_args()
    print_header("native decoder layer vs the modules (bench-60m, whole engine steps)")
    path = str(ensure_model("bench-60m"))
    for dtype in args.dtype:
        for n in args.decodes:
            measure(path, dtype, n, args.prompt, args.steps)


if __name__ == "__main__":
    main()
