"""freeze_gc_heap (kvledger/engine/gc_heap.py), in a child interpreter: freezing the test process's
own heap would keep every later test's garbage alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvledger.engine.gc_heap import GC_FREEZE_ENV

PROBE = r"""
import gc, json, weakref
from kvledger.engine.gc_heap import freeze_gc_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

gc.disable()  # no collection but the ones this probe asks for
before = cycle()  # garbage made before the freeze
frozen = freeze_gc_heap()
after = cycle()  # garbage made after it
gc.collect()
print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(), "before_freed": before() is None,
                  "after_freed": after() is None}))
"""


def _probe(env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop(GC_FREEZE_ENV, None)
    if env_value is not None:
        env[GC_FREEZE_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freeze_collects_first_then_keeps_collecting_what_comes_later():
    r = _probe(None)
    assert r["frozen"] == r["count"] > 1_000  # the interpreter's and kvledger's objects
    assert r["before_freed"], "garbage alive at the freeze must be collected, not frozen forever"
    assert r["after_freed"], "cycles made after the freeze are still collected"


def test_freeze_can_be_turned_off():
    r = _probe("0")
    assert r["frozen"] == 0 and r["count"] == 0


DEFER_PROBE = r"""
import gc, json
from kvledger.engine.gc_heap import deferred_full_collections

full = []
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(1))

def grow(n):  # long-lived growth: what sets off full collections
    return [[i] for i in range(n)]

before = gc.get_threshold()
with deferred_full_collections():
    kept = grow(300_000)
    inside = len(full)
restored = gc.get_threshold() == before
kept2 = grow(300_000)
print(json.dumps({"inside": inside, "after": len(full) - inside, "restored": restored}))
"""


def test_full_collections_wait_for_the_block_to_end():
    """What LLM.generate's step loop runs under: no full walk inside, the caller's thresholds after
    (and the same growth outside the block does set one off, so the probe can tell)."""
    env = dict(os.environ)
    env.pop(GC_FREEZE_ENV, None)
    out = subprocess.run([sys.executable, "-c", DEFER_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["inside"] == 0, r
    assert r["after"] >= 1, r
    assert r["restored"], r
