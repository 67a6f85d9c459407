"""Attention policies of a KV cache group: which of a request's blocks its future queries see.

A group's layers attend either to every earlier token (``FullAttention``) or to the last
``window`` tokens only (``SlidingWindow``: Mistral v0.1, Phi-3 with a window, Gemma's local
layers). The policy is the one place that knows the difference. It answers the first block a
query still sees (blocks before it are released: table entry ``RELEASED``, no longer charged),
the bounds the scheduler checks before it admits a request, and the prefix-hit rule: a full
attention hit is the longest run of cached blocks from the start (prefix-closed); a windowed hit
is the longest prefix whose window is cached (blocks before the window may be gone).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvledger.cache.block_pool import BlockPool
from kvledger.errors import CacheError

# Block-table entries with no device block behind them.
SWAPPED = -1  # moved to the host pool (swap_out)
RELEASED = -2  # wholly behind the sliding window: no query will read it again

# One prompt block as a prefix lookup sees it: (chained hash, its tokens, its salt).
PromptBlock = tuple[int, tuple[int, ...], str | None]


def cdiv(a: int, b: int) -> int:
    """Blocks of size ``b`` that ``a`` tokens occupy (ceiling division)."""
    return -(-a // b)


def first_live_block(next_position: int, window: int, block_size: int) -> int:
    """Blocks before this one hold no key that a query at next_position or later can see:
    such a query sees positions p - window < j <= p only."""
    return max(0, next_position - window + 1) // block_size


class AttentionPolicy:
    """What a group's attention keeps live; the base is the full-attention arithmetic."""

    window: int | None = None
    releases = False  # whether blocks ever fall behind a window
    # Whether any prefix of a hit is a hit: then the blocks a table shares with others are a
    # prefix of it (hits and forks), which the simulator's memory probe relies on.
    prefix_closed = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def first_live_block(self, next_position: int) -> int:
        return 0

    def blocks_alone(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Blocks a request with num_tokens slots holds once num_computed_tokens are computed."""
        return cdiv(num_tokens, self.block_size) - self.first_live_block(num_computed_tokens)

    def prompt_blocks_bound(self, num_prompt_tokens: int, max_batched_tokens: int) -> int:
        """Most blocks a prompt holds at once while it prefills in chunks of at most
        max_batched_tokens (plus its first output slot)."""
        return cdiv(num_prompt_tokens + 1, self.block_size)

    def longest_hit(self, pool: BlockPool, prompt: Iterable[PromptBlock]) -> list[int]:
        raise NotImplementedError


class FullAttention(AttentionPolicy):
    """Every block stays live; a prefix hit is prefix-closed (any prefix of a hit is one)."""

    def longest_hit(self, pool: BlockPool, prompt: Iterable[PromptBlock]) -> list[int]:
        """Cached blocks that start the prompt, each verified after its parent by id."""
        hits: list[int] = []
        parent: int | None = None
        for h, tokens, salt in prompt:
            block_id = pool.lookup(h, tokens, parent, salt)
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_id
        return hits


class SlidingWindow(AttentionPolicy):
    """Each query sees its last ``window`` tokens: blocks wholly before that are released as
    the request advances, and a prefix hit needs only the blocks its window covers."""

    releases = True
    prefix_closed = False

    def __init__(self, block_size: int, window: int) -> None:
        if window <= 0:
            raise CacheError(f"sliding_window must be positive, got {window}")
        super().__init__(block_size)
        self.window = window

    def first_live_block(self, next_position: int) -> int:
        return first_live_block(next_position, self.window, self.block_size)

    def prompt_blocks_bound(self, num_prompt_tokens: int, max_batched_tokens: int) -> int:
        # Blocks behind the window are released between chunks.
        bound = cdiv(self.window + max_batched_tokens, self.block_size) + 1
        return min(super().prompt_blocks_bound(num_prompt_tokens, max_batched_tokens), bound)

    def longest_hit(self, pool: BlockPool, prompt: Iterable[PromptBlock]) -> list[int]:
        """The longest prefix whose window is cached, blocks before the window as RELEASED.

        Not prefix-closed (an evicted early block can matter to a short hit and not to a long
        one), so every length is tried from the longest. Within a run each block's parent is
        checked by id, as in the full-attention walk; a run's first block stands on its
        chained hash alone."""
        ids: list[int | None] = []
        run: list[int] = []  # length of the verified run of cached blocks ending at each index
        for h, tokens, salt in prompt:
            block_id = pool.lookup(h, tokens, None, salt, check_parent=False)
            if block_id is None:
                run.append(0)
            elif run and run[-1] and pool.blocks[block_id].parent_block_id == ids[-1]:
                run.append(run[-1] + 1)
            else:
                run.append(1)
            ids.append(block_id)
        for n in range(len(ids), 0, -1):
            first = self.first_live_block(n * self.block_size)
            if run[n - 1] >= n - first:
                return [RELEASED] * first + ids[first:n]
        return []


def attention_policy(block_size: int, window: int | None) -> AttentionPolicy:
    """The policy of a group whose layers attend to ``window`` tokens (None: all of them)."""
    return FullAttention(block_size) if window is None else SlidingWindow(block_size, window)
