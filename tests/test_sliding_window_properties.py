"""The KV cache state machine again, with a sliding window (issue 20) and with a hybrid model's
groups (one full-attention and one sliding group over one pool): blocks wholly outside the
window are released after every step, and every position a future query can still see must
resolve to its own value, through prefix hits, forks, frees and swaps."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_kv_cache_properties import NUM_BLOCKS, SETTINGS, KVCacheMachine

WINDOW = 6  # 1.5 blocks: a query sees two or three blocks


class WindowedKVCacheMachine(KVCacheMachine):
    WINDOWS = [WINDOW]
    released_seen = 0  # across examples: the runs must really release blocks

    def _publish(self, rid: str) -> None:
        super()._publish(rid)
        self.kv.release_outside_window(rid, len(self.tokens[rid]))
        WindowedKVCacheMachine.released_seen += self.kv.requests[rid].tables[-1].num_released > 0

    # Speculative rejection would need keys already released: not offered with a window.
    reject_and_correct = None


class HybridKVCacheMachine(WindowedKVCacheMachine):
    WINDOWS = [None, WINDOW]  # a full-attention group and a sliding one, one shared pool
    NUM_BLOCKS = NUM_BLOCKS * 3 // 2


def test_kv_cache_state_machine_with_a_sliding_window():
    WindowedKVCacheMachine.released_seen = 0
    run_state_machine_as_test(WindowedKVCacheMachine, settings=settings(SETTINGS, max_examples=50))
    assert WindowedKVCacheMachine.released_seen > 0


def test_kv_cache_state_machine_with_hybrid_groups():
    WindowedKVCacheMachine.released_seen = 0
    run_state_machine_as_test(HybridKVCacheMachine, settings=settings(SETTINGS, max_examples=50))
    assert WindowedKVCacheMachine.released_seen > 0
