"""Which replica serves a request: ``--dp-routing {cache_aware,round_robin,least_loaded}``.

``cache_aware`` is NVIDIA Dynamo's KV-router cost on exact state: for each live replica,

    cost = overlap_weight * prefill_blocks + active_blocks + new_blocks

- ``prefill_blocks``: blocks the replica would still have to prefill, its queue plus this
  request's uncached part: (queued_tokens + prompt_tokens - overlap_blocks * block_size) / block_size;
- ``overlap_blocks``: the request's leading blocks the replica holds, looked up by the request's
  chained hashes (kvledger/cache/block_hash.py) in the replica's event-fed index, or about to
  hold (the prompt blocks of requests already sent there, so a burst of one tenant does not
  scatter before the first events come back);
- ``active_blocks`` (the KV-usage load): the private blocks of its in-flight requests (partial
  prompt block and output). Full prompt blocks are not load: they are the prefix cache itself
  and stay in the pool as cached blocks once the requests end; counting them made a replica
  that hosts busy tenants look loaded and pushed their next requests elsewhere, copying the
  prefix (the simulator showed it: hit rate 0.68 instead of 0.80 at 60 req/s per replica);
- ``new_blocks``: the request's blocks the replica does not hold, which it would add (Dynamo's
  "potential active blocks" is ``active_blocks + new_blocks``).

``overlap_weight`` defaults to 0.25, not Dynamo's 1.0: in the simulator (benchmarks/
dp_routing_sim.py, 4 replicas, pools holding about one replica's share of tenants) 1.0 spilled
tenants onto less-queued replicas under overload and lost hit rate (0.80 vs 0.84 at 0.25; 0.5
gave 0.82, 0.1 gave 0.83 with a worse TTFT p99).

The lowest cost wins; ties go to the replica with fewer requests, then in turn. ``least_loaded``
is the same cost without the overlap; ``round_robin`` takes live replicas in turn.

Four rules around the cost, for ``cache_aware`` only (issue 18: without them the simulator gave
0.77-0.92x the throughput of a model of sglang-router's cache_aware, see
docs/measurements/data_parallel.md):

1. **Placement history.** When no replica holds (or is about to hold) any of the request's
   blocks, the request goes back to the replica the router last sent that prefix to: a bounded
   LRU map from block hash to rank (``history_blocks`` entries), matched like the index, longest
   leading run. The exact index forgets a tenant once its blocks are evicted everywhere; routing
   its next request by load alone scattered tenants over replicas, so each held more distinct
   prompts than its pool fits and evicted more. The history is what sglang-router's tree is (it
   remembers what was sent, not what is cached), used only where the exact state says nothing.
2. **New prefixes to the least placement volume.** A prefix with neither cache nor history goes
   to the replica with the fewest history blocks (prompt volume recently sent there), not the
   least loaded one: load at a tenant's first request says little about the work the tenant
   brings later, and balancing placed volume keeps each replica's working set near its pool
   (sglang-router's "smallest tree"). ``history_blocks=0`` turns rules 1 and 2 off: such a
   request then goes by the cost, i.e. to the least loaded replica.
3. **Imbalance guard.** A replica whose in-flight requests exceed both ``balance_abs`` more and
   ``balance_rel`` times those of the least loaded live replica is not a candidate, however much
   of the prefix it holds (sglang-router's defaults: 64 and 1.5). Under saturation this bounds
   how long a tenant's replica may lag the others; below it, the cost alone decides. Tighter
   thresholds (16 and 1.5) lost throughput in the simulator: each forced move copies a prefix.
4. **Moving floor.** In the cost, a replica that lacks the longest match counts as at least
   ``move_floor`` x the average load (queued tokens, active blocks) of the replicas that lack it.
   A request leaves its prefix's holder only when the holder is busier than a typical other
   replica by more than the copy costs, not merely busier than the momentarily idlest one: with
   64 replicas one is always idle, and comparing against it moved busy tenants to replicas whose
   own tenants filled them soon after, splitting prefixes (N=64, seed 0, 40 req/s per replica:
   230 requests sent to a replica without the prefix, tenants on 1.45 replicas on average vs 1.0
   under sglang_model; hit rate 0.785 vs 0.854). 1.0 left 0.95x sglang_model at N=16 and 64;
   1.25 gave >= 0.975x at N=4, 16, 64 on four seed/rate settings; 0.5 gave 0.76x at N=64; no
   moves at all (only the guard) 0.89x. ``move_floor=0`` turns it off.

The router learns load from its own bookkeeping (``dispatched``, ``prefilled``, ``finished``),
which is exact and immediate, not from polled metrics that lag by an interval.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvledger.cache.block_hash import DEFAULT_HASH_ALGO, hash_request_blocks
from kvledger.errors import ConfigError
from kvledger.router.index import KVIndex

ROUTING_POLICIES = ("cache_aware", "round_robin", "least_loaded")
DEFAULT_OVERLAP_WEIGHT = 0.25
DEFAULT_HISTORY_BLOCKS = 1 << 18  # 4 M tokens of placed prefixes at 16 tokens a block; ~30 MB
DEFAULT_BALANCE_ABS = 64
DEFAULT_BALANCE_REL = 1.5
DEFAULT_MOVE_FLOOR = 1.25


class NoReplicaError(RuntimeError):
    """Every replica is out of rotation."""


@dataclass
class _InFlight:
    rank: int
    hashes: list[int]
    queued: int  # uncached prompt tokens still to prefill (0 once prefilled)
    tail_blocks: int  # blocks beyond the hashed full prompt blocks: partial block + output


@dataclass
class ReplicaState:
    rank: int
    alive: bool = True
    index: KVIndex = field(default_factory=KVIndex)
    queued_tokens: int = 0
    tail_blocks: int = 0
    active: Counter = field(default_factory=Counter)  # in-flight prompt block hash -> holders
    num_requests: int = 0
    dispatched: int = 0  # total, for /metrics
    hit_blocks: int = 0  # total overlap at dispatch, for /metrics

    @property
    def active_blocks(self) -> int:
        return self.tail_blocks

    def overlap(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.index.hashes and h not in self.active:
                break
            n += 1
        return n


@dataclass
class Decision:
    rank: int
    overlap_blocks: int
    cost: float
    reason: str = "cost"  # cost | history | new | round_robin: which rule placed it


class Router:
    def __init__(
        self,
        num_replicas: int,
        policy: str = "cache_aware",
        block_size: int = 16,
        hash_algo: str = DEFAULT_HASH_ALGO,
        overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
        history_blocks: int = DEFAULT_HISTORY_BLOCKS,
        balance_abs: int = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
        move_floor: float = DEFAULT_MOVE_FLOOR,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ConfigError(f"dp routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if num_replicas < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.policy = policy
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.overlap_weight = overlap_weight
        self.replicas = [ReplicaState(r) for r in range(num_replicas)]
        self._next = 0
        self._inflight: dict[str, _InFlight] = {}
        self.history_blocks = history_blocks
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.move_floor = move_floor
        self._history: dict[int, int] = {}  # block hash -> rank it was last sent to; insertion = LRU order
        self.history_volume = [0] * num_replicas  # history entries per rank

    # ------------------------------------------------------------ decisions
    def block_hashes(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        return hash_request_blocks(token_ids, self.block_size, salt, self.hash_algo)

    def live(self) -> list[ReplicaState]:
        return [r for r in self.replicas if r.alive]

    def choose(self, token_ids: list[int], salt: str | None = None, hashes: list[int] | None = None) -> Decision:
        live = self.live()
        if not live:
            raise NoReplicaError("no data-parallel replica is alive")
        start = self._next % len(self.replicas)
        order = sorted(live, key=lambda r: (r.rank - start) % len(self.replicas))
        self._next += 1
        if self.policy == "round_robin":
            return Decision(order[0].rank, 0, 0.0, "round_robin")
        overlaps = [0] * len(self.replicas)
        if self.policy == "cache_aware":
            if hashes is None:
                hashes = self.block_hashes(token_ids, salt)
            order = self.balanced(order)
            for r in order:
                overlaps[r.rank] = r.overlap(hashes)
            if hashes and self.history_blocks > 0 and not any(overlaps[r.rank] for r in order):
                home = self.history_home(hashes)
                if home is not None and any(r.rank == home for r in order):
                    return Decision(home, 0, 0.0, "history")
                r = min(order, key=lambda r: (self.history_volume[r.rank], r.num_requests))
                return Decision(r.rank, 0, 0.0, "new")
        best: Decision | None = None
        best_key: tuple | None = None
        bs = self.block_size
        top = max(overlaps[r.rank] for r in order)
        others = [r for r in order if overlaps[r.rank] < top]
        floor_q = floor_a = 0.0
        if self.policy == "cache_aware" and self.move_floor > 0 and top and others:
            # Rule 4: a replica without the longest match counts as loaded like the average such one.
            floor_q = self.move_floor * sum(r.queued_tokens for r in others) / len(others)
            floor_a = self.move_floor * sum(r.active_blocks for r in others) / len(others)
        for r in order:
            overlap = overlaps[r.rank]
            queued, active = r.queued_tokens, r.active_blocks
            if overlap < top:
                queued, active = max(queued, floor_q), max(active, floor_a)
            prefill = (queued + len(token_ids) - overlap * bs) / bs
            new_blocks = -(-len(token_ids) // bs) - overlap
            cost = self.overlap_weight * prefill + active + new_blocks
            key = (cost, r.num_requests)
            if best_key is None or key < best_key:
                best, best_key = Decision(r.rank, overlap, cost), key
        assert best is not None
        return best

    def balanced(self, live: list[ReplicaState]) -> list[ReplicaState]:
        """The imbalance guard (rule 3): drop replicas with more than ``balance_abs`` and more than
        ``balance_rel`` x the in-flight requests of the least loaded one (order kept)."""
        lo = min(r.num_requests for r in live)
        limit = max(lo + self.balance_abs, lo * self.balance_rel)
        return [r for r in live if r.num_requests <= limit]

    def history_home(self, hashes: list[int]) -> int | None:
        """The rank the longest leading run of ``hashes`` was last sent to (rule 1), or None."""
        home = None
        for h in hashes:
            rank = self._history.get(h)
            if rank is None:
                break
            home = rank
        return home

    def _remember(self, rank: int, hashes: list[int]) -> None:
        hist, vol = self._history, self.history_volume
        for h in hashes:
            old = hist.pop(h, None)
            if old is not None:
                vol[old] -= 1
            hist[h] = rank  # re-inserted: now the most recent
            vol[rank] += 1
        while len(hist) > self.history_blocks:
            vol[hist.pop(next(iter(hist)))] -= 1

    # ------------------------------------------------------------ bookkeeping
    def dispatched(
        self, request_id: str, decision: Decision, token_ids: list[int], max_tokens: int, hashes: list[int] | None = None
    ) -> None:
        """The request went to ``decision.rank``: count its prefill and its blocks there."""
        r = self.replicas[decision.rank]
        if hashes is None:
            hashes = self.block_hashes(token_ids)
        queued = max(0, len(token_ids) - decision.overlap_blocks * self.block_size)
        tail = -(-(len(token_ids) + max_tokens) // self.block_size) - len(hashes)
        self._inflight[request_id] = _InFlight(decision.rank, hashes, queued, tail)
        r.queued_tokens += queued
        r.tail_blocks += tail
        r.active.update(hashes)
        r.num_requests += 1
        r.dispatched += 1
        r.hit_blocks += decision.overlap_blocks
        if self.policy == "cache_aware" and self.history_blocks > 0:
            self._remember(decision.rank, hashes)

    def prefilled(self, request_id: str) -> None:
        """Its first token came back: its prompt is no longer queued work."""
        f = self._inflight.get(request_id)
        if f is not None and f.queued:
            self.replicas[f.rank].queued_tokens -= f.queued
            f.queued = 0

    def finished(self, request_id: str) -> None:
        f = self._inflight.pop(request_id, None)
        if f is None:
            return
        r = self.replicas[f.rank]
        r.queued_tokens -= f.queued
        r.tail_blocks -= f.tail_blocks
        r.active.subtract(f.hashes)
        for h in f.hashes:
            if r.active[h] <= 0:
                del r.active[h]
        r.num_requests -= 1

    def mark_dead(self, rank: int) -> list[str]:
        """Take a replica out of rotation; returns its in-flight request ids (they fail)."""
        r = self.replicas[rank]
        r.alive = False
        r.index.clear()
        # Its placements are void (a restarted replica comes back empty): new prefixes may go there.
        self._history = {h: k for h, k in self._history.items() if k != rank}
        self.history_volume[rank] = 0
        lost = [rid for rid, f in self._inflight.items() if f.rank == rank]
        for rid in lost:
            self.finished(rid)
        return lost
