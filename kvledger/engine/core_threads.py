"""How many torch threads the engine core process computes with, when the user did not say.

On a CPU server the engine core shares the machine with its HTTP front end (and, in a
benchmark, the load generator). A second OpenMP thread halves a big model's matmul time, but
for a small model it buys little and costs much: every parallel region wakes the worker and
waits for it, and the worker's core is the one the front end needs. Measured on 2 cores
(docs/measurements/serving_settings.md, "the engine core's thread count"): the 4 x 256
`kvledger-tiny` served 794 -> 1,424 tok/s at 8 streams and 1,557 -> 1,838 at 64 with one thread
instead of two; the 60M model lost a fifth of its 64-stream throughput with one (750-800 -> 603
tok/s).

So the core times its own decode-step matmuls with one thread (one decoder layer's weights,
scaled by the number of layers, and the LM head, at a decode step's rows; the fastest of a few
tries, since another process starting beside it only ever adds time) and keeps all threads only
if that work is at least MIN_WORK_S per step: splitting less saves under ~1 ms a step, less than
the core it takes from the front end is worth. The tiny model's step of matmuls is ~1.0 ms, the
60M model's 7 (bf16) to 13 ms (float32). (Timing the split itself is no guide: the tiny model's matmuls are 1.8x
faster with two threads, yet it serves far better with one; and a busy neighbour at start-up
makes the split look slower than it is.)

With one thread chosen, what grows with the load rather than the model still takes all threads
(``native.set_split_threads``): a decode attention over megabytes of K/V and a step of 32 or
more tokens (``native.SPLIT_STEP_TOKENS``: any step carrying a prompt's prefill, or 32+ decoding
rows). At 64 streams the tiny model's core spent 41 % of its time in one-thread decode
attention beside an idle core; a prefill on one thread set the inter-token p99 of the streams
decoding beside it.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from kvledger.kernels import native

MIN_WORK_S = 2e-3  # one thread's matmul time per decode step worth splitting
ROWS = 16  # a decode step's rows
REPEATS = 15


def _decode_matmuls(model: nn.Module) -> tuple[list, list[int]]:
    """One decoder layer's matmuls and the LM head, with how many times a step runs each."""
    from kvledger.model.layers import Linear

    layers = model.model.layers
    linears = [m for m in layers[0].modules() if isinstance(m, Linear)]
    head = [model.head] if model.head is not None else []  # None: tied and unpacked (F.linear)
    return [*linears, *head], [len(layers)] * len(linears) + [1] * len(head)


def _time(linears, xs, threads: int, repeats: int = 5) -> list[float]:
    """Fastest seconds per product, each linear alone (the minimum: another process starting
    up beside the core only ever adds time)."""
    torch.set_num_threads(threads)
    out = []
    for lin, x in zip(linears, xs, strict=True):
        lin(x)  # warm: caches, oneDNN primitives
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lin(x)
            runs.append(time.perf_counter() - t0)
        out.append(min(runs))
    return out


@torch.inference_mode()
def choose_core_threads(model: nn.Module, max_threads: int) -> tuple[int, float]:
    """(threads, one thread's seconds of matmul per decode step); leaves torch set to the
    chosen count, and large decode attentions and large steps (native.DECODE_SPLIT_BYTES,
    SPLIT_STEP_TOKENS) free to use all ``max_threads`` when that count is one."""
    if max_threads <= 1:
        torch.set_num_threads(max(1, max_threads))
        return max(1, max_threads), 0.0
    linears, runs = _decode_matmuls(model)
    # the model's activations (a quantised Linear's weight holds codes, not [out, in] floats)
    xs = [torch.zeros(ROWS, lin.in_features, dtype=model.dtype) for lin in linears]
    work = sum(n * t for n, t in zip(runs, _time(linears, xs, 1, repeats=REPEATS), strict=True))
    threads = max_threads if work >= MIN_WORK_S else 1
    torch.set_num_threads(threads)
    # What grows with the load, not the model, still splits (native.set_split_threads).
    native.set_split_threads(max_threads if threads < max_threads else 0)
    return threads, work
