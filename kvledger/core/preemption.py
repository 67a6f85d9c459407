"""Whom to evict under memory pressure, and whether to swap or recompute each victim.

The victim policy evicts the request with the largest estimated remaining generation, damped
by an aging factor (halved per preemption already suffered, shrinking with steps spent
waiting) so that a long request cannot be evicted forever; after
``max_preemptions_before_protect`` evictions it is taken last. A request resumed in the
previous step is not chosen while another is eligible (no thrashing).

The mode is chosen per victim by a cost model calibrated at start-up: swapping moves the
victim's private blocks out and back (2 x bytes / measured copy bandwidth + a fixed cost per
swap), recomputing re-runs a prefill whose measured time grows faster than linearly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.core.request import Request


def select_victim(
    candidates: list[Request], policy: str, step: int, max_preemptions_before_protect: int
) -> Request:
    if not candidates:
        raise ValueError("no candidates to preempt")

    def tier(r: Request) -> int:
        # 0: freely eligible; 1: just resumed; 2: already evicted many times.
        if r.num_preemptions >= max_preemptions_before_protect:
            return 2
        if r.last_resumed_step >= step - 1:
            return 1
        return 0

    best_tier = min(tier(r) for r in candidates)
    pool = [r for r in candidates if tier(r) == best_tier]
    if policy == "fcfs":
        return max(pool, key=lambda r: (r.arrival_time, r.request_id))
    if policy == "priority":
        return max(pool, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    return max(pool, key=lambda r: (victim_score(r), r.arrival_time, r.request_id))


def victim_score(r: Request) -> float:
    """Remaining generation, aged: each preemption halves it, waiting shrinks it."""
    return r.remaining_tokens * 0.5**r.num_preemptions / (1.0 + r.steps_waited / 64.0)


@dataclass
class PreemptionCostModel:
    """Seconds to swap (out and back) vs recompute a victim; the cheaper mode wins."""

    swap_bandwidth: float = 10e9  # bytes/s each way (host <-> device copies)
    swap_fixed_s: float = 1e-4  # per swap-out + swap-in pair (launch, bookkeeping)
    prefill_coeffs: tuple[float, float, float] = (0.0, 1e-5, 1e-9)  # c0 + c1 n + c2 n^2
    mode: str = "auto"  # auto | swap | recompute
    recompute_threshold: int | None = None  # override: tokens below which we recompute

    def swap_cost(self, num_bytes: int) -> float:
        return self.swap_fixed_s + 2.0 * num_bytes / self.swap_bandwidth

    def prefill_time(self, num_tokens: int) -> float:
        c0, c1, c2 = self.prefill_coeffs
        return c0 + c1 * num_tokens + c2 * num_tokens * num_tokens if num_tokens > 0 else 0.0

    def recompute_cost(self, num_tokens: int, num_cached_tokens: int = 0) -> float:
        """Marginal prefill time of the tokens not served by surviving prefix-cache blocks.

        The fixed per-forward cost c0 is left out: the recompute rides in a step that runs
        anyway. The swap side keeps its fixed cost (one copy per layer per direction), which is
        what makes short victims cheaper to recompute.
        """
        _, c1, c2 = self.prefill_coeffs
        n, c = num_tokens, min(num_cached_tokens, num_tokens)
        return c1 * (n - c) + c2 * (n * n - c * c)

    def choose(self, num_tokens: int, swap_bytes: int, num_cached_tokens: int = 0) -> str:
        if self.mode != "auto":
            return self.mode
        if self.recompute_threshold is not None:
            return "recompute" if num_tokens < self.recompute_threshold else "swap"
        swap = self.swap_cost(swap_bytes)
        return "swap" if swap < self.recompute_cost(num_tokens, num_cached_tokens) else "recompute"

    def crossover_tokens(self, bytes_per_token: int, limit: int = 1 << 20) -> int | None:
        """Smallest sequence length at which swapping is cheaper (None if never up to limit)."""
        lo, hi = 1, limit
        if self.swap_cost(hi * bytes_per_token) >= self.recompute_cost(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.swap_cost(mid * bytes_per_token) < self.recompute_cost(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "swap_bandwidth_bytes_per_s": self.swap_bandwidth,
            "swap_fixed_s": self.swap_fixed_s,
            "prefill_coeffs": list(self.prefill_coeffs),
            "recompute_threshold": self.recompute_threshold,
        }
