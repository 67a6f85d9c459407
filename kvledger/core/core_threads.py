"""How many torch threads the engine core process computes with, when the user did not say.

On a CPU server the engine core shares the machine with its HTTP front end (and, in a
benchmark, the load generator). A second OpenMP thread halves a big model's matmul time, but
for a small model it buys little and costs much: every parallel region wakes the worker and
waits for it, and the worker's core is the one the front end needs. Measured on 2 cores
(docs/benchmarks.md, issue 24): the 4 x 256 `kvledger-tiny` served 794 -> 1,424 tok/s at 8
streams and 1,557 -> 1,838 at 64 with one thread instead of two; the 60M model lost a fifth
of its 64-stream throughput with one (750-800 -> 603 tok/s).

So the core times its own decode-step matmuls (one decoder layer's weights, scaled by the
number of layers, and the LM head, at a decode step's rows) with one thread and with all, and
keeps all only if they save at least MIN_SAVED_S per step: the tiny model's whole step of
matmuls takes ~0.2 ms (2 threads save ~0.1), the 60M model's ~5-10 ms. (The matmuls' own
speed-up is no guide: the tiny model's are 1.8x faster with two threads, yet its steps are
mostly host work and it serves far better with one.)
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

MIN_SAVED_S = 1e-3  # per decode step: what the extra threads must buy, since they take the front end's core
ROWS = 16  # a decode step's rows


def _decode_matmuls(model: nn.Module) -> tuple[list, int]:
    """One decoder layer's matmuls and the LM head, with the number of layers."""
    from kvledger.model.layers import Linear

    layers = getattr(getattr(model, "model", None), "layers", None) or []
    head = getattr(model, "lm_head", None) or model.__dict__.get("tied_head")
    mods = [*(layers[0].modules() if layers else []), head]
    return [m for m in mods if isinstance(m, Linear)], len(layers)


def _time(linears, xs, threads: int, repeats: int = 5) -> list[float]:
    """Median seconds per product, each linear alone."""
    torch.set_num_threads(threads)
    out = []
    for lin, x in zip(linears, xs, strict=True):
        lin(x)  # warm: caches, oneDNN primitives
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lin(x)
            runs.append(time.perf_counter() - t0)
        out.append(statistics.median(runs))
    return out


@torch.inference_mode()
def choose_core_threads(model: nn.Module, max_threads: int) -> tuple[int, float]:
    """(threads, seconds ``max_threads`` save per decode step over one thread); leaves torch
    set to the chosen count."""
    linears, num_layers = _decode_matmuls(model)
    if max_threads <= 1 or not linears:
        torch.set_num_threads(max(1, max_threads))
        return max(1, max_threads), 0.0
    head = getattr(model, "lm_head", None) or model.__dict__.get("tied_head")
    weights = [1 if lin is head else num_layers for lin in linears]
    xs = [torch.zeros(ROWS, lin.weight.shape[1], dtype=lin.weight.dtype) for lin in linears]
    one = _time(linears, xs, 1)
    many = _time(linears, xs, max_threads)
    saved = sum(w * (a - b) for w, a, b in zip(weights, one, many, strict=True))
    threads = max_threads if saved >= MIN_SAVED_S else 1
    torch.set_num_threads(threads)
    return threads, saved
