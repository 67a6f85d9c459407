"""Keep the start-up heap out of the cyclic garbage collector's way (vLLM's freeze_gc_heap).

A served process holds a few hundred thousand long-lived objects once its model, tokenizer and
web stack are loaded; every full (generation-2) collection walks all of them, 130-200 ms on the
tiny model's server here, and the step or stream waiting on it stalls for as long. Freezing the
heap after start-up moves those objects to the permanent generation, which collections skip;
objects made later are still collected as before. Only kvledger's own processes do this (the
`kvledger serve` front end and the engine core): a library must not freeze its caller's heap,
whose objects would then never be reclaimed if they became cyclic garbage. `LLM.generate` / `chat`
run with full collections deferred instead (`deferred_full_collections`): young generations are
collected as usual, the full walk waits until the call returns.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

from kvledger import envs

GC_FREEZE_ENV = "KVLEDGER_GC_FREEZE"  # "0": leave the collector as it is
_atexit_registered = False


def _turned_off() -> bool:
    return not envs.KVLEDGER_GC_FREEZE


def freeze_gc_heap() -> int:
    """Collect, then freeze everything alive; the number of frozen objects (0 when turned off).

    Collecting first matters: garbage frozen with the heap could never be reclaimed. At exit the
    heap is unfrozen, so finalizers run as in an unfrozen process.
    """
    global _atexit_registered
    if _turned_off():
        return 0
    gc.collect()
    gc.freeze()
    if not _atexit_registered:
        atexit.register(gc.unfreeze)
        _atexit_registered = True
    return gc.get_freeze_count()


@contextlib.contextmanager
def deferred_full_collections() -> Iterator[None]:
    """No automatic generation-2 collection inside the block (generations 0 and 1 as usual);
    the caller's thresholds are restored on the way out. Off with KVLEDGER_GC_FREEZE=0 too."""
    if _turned_off():
        yield
        return
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], 1 << 30)
    try:
        yield
    finally:
        now = gc.get_threshold()
        if now[2] == 1 << 30:  # unless the caller changed them meanwhile
            gc.set_threshold(now[0], now[1], old[2])
