"""The KV cache state machine again, with a sliding window (issue 20): blocks wholly outside
the window are released after every step, and every position a future query can still see
must resolve to its own value, through prefix hits, forks, frees and swaps."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_kv_cache_properties import BS, NUM_BLOCKS, NUM_HOST_BLOCKS, SETTINGS, KVCacheMachine

from kvledger.cache.kv_cache_manager import RELEASED, KVCacheManager, first_live_block

WINDOW = 6  # 1.5 blocks: a query sees two or three blocks


class WindowedKVCacheMachine(KVCacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(
            NUM_BLOCKS, BS, bytes_per_token=8, num_host_blocks=NUM_HOST_BLOCKS, sliding_window=WINDOW
        )

    released_seen = 0  # across examples: the runs must really release blocks

    def _publish(self, rid: str) -> None:
        super()._publish(rid)
        self.kv.release_outside_window(rid, len(self.tokens[rid]))
        WindowedKVCacheMachine.released_seen += self.kv.requests[rid].num_released > 0

    # Speculative rejection would need keys already released: not offered with a window.
    reject_and_correct = None

    def _visible(self, rid: str, pos: int) -> bool:
        req = self.kv.requests[rid]
        i = pos // BS
        if req.block_table[i] == RELEASED:
            assert i < first_live_block(len(self.tokens[rid]), WINDOW, BS), (rid, pos)
            return False
        return True


def test_kv_cache_state_machine_with_a_sliding_window():
    run_state_machine_as_test(WindowedKVCacheMachine, settings=settings(SETTINGS, max_examples=50))
    assert WindowedKVCacheMachine.released_seen > 0
