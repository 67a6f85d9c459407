"""Prompt lookup (vLLM's ``ngram`` method): propose the tokens that followed the last time the
context's final n tokens occurred, for the longest n in [prompt_lookup_min, prompt_lookup_max].

Each request keeps an index of its own n-grams (n-gram -> where its latest occurrence ended),
grown by the tokens appended since the last proposal, so a proposal costs O(new tokens x n
range) instead of a scan of the whole context (vLLM rescans the context each step). The
latest occurrence is taken: replayed on stories260k greedy continuations it drafted as well as
the earliest (1.58 vs 1.56 tokens per step, docs/measurements/spec_decode.md). A match
that ends close to the present is continued through the proposal itself (an overlapping copy,
as LZ77's), so a periodic tail proposes full drafts instead of a few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class NgramIndex:
    """One request's n-gram index over its prompt and outputs."""

    min_n: int
    max_n: int
    # maps[n - min_n]: n-gram -> end (exclusive) of its latest occurrence that is not the tail.
    maps: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    num_indexed: int = 0  # n-grams ending before this position are in the maps

    def __post_init__(self) -> None:
        if not self.maps:
            self.maps = [{} for _ in range(self.max_n - self.min_n + 1)]

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams ending at positions [num_indexed, len - 1): every one but the
        tail's own (a match must lie in the past to have a continuation)."""
        end = len(tokens)
        if end < self.num_indexed:  # the context shrank (a stop string cut it): start over
            self.maps = [{} for _ in self.maps]
            self.num_indexed = 0
        lo = self.min_n
        for e in range(max(self.num_indexed, lo), end):
            for i, m in enumerate(self.maps):
                n = lo + i
                if e < n:
                    break
                m[tuple(tokens[e - n : e])] = e
        self.num_indexed = max(self.num_indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens``; [] when no n-gram of the tail recurs."""
        if k <= 0:
            return []
        self._catch_up(tokens)
        end = len(tokens)
        for i in range(len(self.maps) - 1, -1, -1):
            n = self.min_n + i
            if end < n:
                continue
            e = self.maps[i].get(tuple(tokens[end - n :]))
            if e is None:
                continue
            out: list[int] = []
            for j in range(k):
                p = e + j
                out.append(tokens[p] if p < end else out[p - end])
            return out
        return []
