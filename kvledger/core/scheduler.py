"""Iteration-level scheduling: the batch is re-formed at every step.

Each step the scheduler (1) gives every running request its next tokens (one for a decode,
a chunk for an unfinished prefill) within a token budget, (2) preempts victims until those
tokens' blocks fit, (3) swaps swapped-out requests back in, oldest first, and (4) admits
waiting requests FCFS while the budget, ``max_num_seqs`` and the free blocks allow. It only
decides: no tensors here, so the simulator replays exactly this code with a cost model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.cache.kv_tier_messages import TierReport
from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.core.kv_loading import TierLoading
from kvledger.core.preemption import PreemptionCostModel, select_victim
from kvledger.core.request import Request, RequestStatus, check_stop
from kvledger.core.sched_output import NewRequestData, SchedulerOutput
from kvledger.spec_decode.speculator import Speculator


def build_kv_manager(
    config: SchedulerConfig,
    cache: CacheConfig,
    num_blocks: int,
    bytes_per_token: int,
    windows: list[int | None] | None = None,
) -> KVCacheManager:
    """The block manager for a pool of ``num_blocks`` (the engine's builder and the simulator).
    ``windows``: each KV cache group's sliding window (None: full attention;
    kvledger.ledger.kv_cache_groups), one full-attention group if not given;
    ``bytes_per_token`` is one pool slot (a group's layers).

    The host swap pool holds ``swap_space`` GiB, at most as many blocks as the device pool,
    and none when preemption is recompute-only.
    """
    bytes_per_block = bytes_per_token * cache.block_size
    num_host = min(int(cache.swap_space * (1 << 30)) // bytes_per_block, num_blocks)
    if config.preemption_mode == "recompute":
        num_host = 0
    return KVCacheManager(
        num_blocks,
        cache.block_size,
        bytes_per_token=bytes_per_token,
        enable_prefix_caching=cache.enable_prefix_caching,
        num_host_blocks=num_host,
        hash_algo=cache.prefix_caching_hash_algo,
        windows=windows,
    )


class Scheduler:
    @classmethod
    def build(
        cls,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        bytes_per_token: int,
        cost_model: PreemptionCostModel | None = None,
        windows: list[int | None] | None = None,
    ) -> Scheduler:
        """A scheduler over a new block manager (``build_kv_manager``): the simulator's."""
        kv = build_kv_manager(config, cache, num_blocks, bytes_per_token, windows)
        return cls(config, kv, cost_model)

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        cost_model: PreemptionCostModel | None = None,
        rope_long_from: int | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """``speculator``: proposes draft tokens for decoding requests (speculative decoding;
        None: one token per decode step)."""
        self.config = config
        self.kv = kv_cache_manager
        self.cost_model = cost_model or PreemptionCostModel(
            mode=config.preemption_mode, recompute_threshold=config.recompute_threshold
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.step = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}
        # LongRoPE models (original_max_position_embeddings): a sequence longer than this uses
        # the long factors for every position, as HF, which recomputes the whole cache when a
        # sequence first crosses it. None: no such switch.
        self.rope_long_from = rope_long_from
        self.num_rope_recomputes = 0
        # Requests finished since the last step that the runner(s) know (SchedulerOutput's
        # finished_req_ids).
        self.finished_req_ids: list[str] = []
        self.speculator = speculator
        self.tier_loading = TierLoading()  # requests whose prefix loads from a lower tier

    # -- queue management ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.waiting_since_step = self.step
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_forked(self, child: Request) -> None:
        """A child of an n > 1 request; its blocks were forked from the parent's already."""
        child.status = RequestStatus.RUNNING
        child.admitted_step = self.step
        self.requests[child.request_id] = child
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.tier_loading)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.tier_loading)

    def finish_request(self, request: Request, reason: str) -> None:
        """Retire a request now: its blocks go straight back to the pool, and the runner(s)
        drop what they keep of it with the next step. A request the scheduler never held (an
        n > 1 child not yet forked, one still compiling its grammar) is only marked."""
        if request.is_finished:
            return
        if self.requests.get(request.request_id) is request:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            elif request.status is RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.tier_loading.cancel(self, request)
            if request.request_id in self.kv.requests:
                self.kv.free(request.request_id)
            del self.requests[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.speculator is not None and reason != "abort":
            self.speculator.on_finished(request, len(self.running))
        if request.num_synced_tokens:
            self.finished_req_ids.append(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, "abort")
        return request

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step += 1
        out = SchedulerOutput(step=self.step)
        budget = self.config.max_num_batched_tokens
        bs = self.kv.block_size

        # 1. Running requests first: a decode token each, or the next prefill chunk.
        #    (The per-step hot path: plain attribute reads, no per-request method calls.)
        plan: list[tuple[Request, int]] = []  # (request, new tokens), in batch order
        items: list[tuple[str, int]] = []  # (request_id, tokens) for the block manager
        total_blocks = self.kv.pool.num_blocks
        windowed = self.kv.windowed
        ended: list[Request] = []
        if self.rope_long_from is not None:
            self._recompute_rope_crossings()
        # Prefill tokens this step may still take: capped while decodes run (see config).
        prefill_left = budget
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is not None and self.config.enable_chunked_prefill and any(
            len(r.all_token_ids) - r.num_computed_tokens == 1 for r in self.running
        ):
            prefill_left = min(cap, budget)
        spec = self.speculator
        if spec is not None and not spec.enabled_for_batch(len(self.running)):
            spec = None
        for req in self.running:
            n = len(req.all_token_ids) - req.num_computed_tokens
            if n > budget:
                n = budget
            if n > 1:
                if n > prefill_left:
                    n = prefill_left
                prefill_left -= n
            if n <= 0:
                continue
            if windowed:  # blocks behind a window are released, not needed
                alone = self.kv.blocks_alone(req.num_computed_tokens, req.num_computed_tokens + n)
            else:
                alone = (req.num_computed_tokens + n + bs - 1) // bs
            if alone > total_blocks:
                ended.append(req)  # it can never fit, even alone: stop it (after the loop)
                continue
            drafts = None
            if n == 1 and spec is not None:  # a decode: verify drafts with its next token
                room = total_blocks * bs - req.num_computed_tokens  # drafts never end a request
                if self.rope_long_from is not None and not req.rope_long:
                    # LongRoPE: no verification row at or past the switch (its factors change)
                    room = min(room, self.rope_long_from - req.num_computed_tokens)
                drafts, parents = spec.propose(req, min(budget, room) - 1, req.remaining_tokens - 1)
                n += len(drafts)
            plan.append((req, n))
            items.append((req.request_id, n))
            budget -= n
            if drafts:  # (a token tree's parents too: kvledger.spec_decode.tree)
                req.spec_token_ids, req.spec_parents = drafts, parents
        for req in ended:
            self.finish_request(req, "length")
            out.ended.append(req.request_id)

        # 2. Preempt until the planned tokens' blocks fit (drafts are dropped first: they never
        #    cost another request its place).
        drafting = spec is not None
        while plan and not self.kv.fits_many(items, self.config.max_num_batched_tokens - budget):
            if drafting:
                budget += self._drop_drafts(plan, items)
                drafting = False
                continue
            victim = select_victim(
                self.running,
                self.config.victim_policy,
                self.step,
                self.config.max_preemptions_before_protect,
            )
            for i, (r, n) in enumerate(plan):
                if r is victim:
                    budget += n
                    del plan[i]
                    del items[i]
                    break
            self._preempt(victim, out)
        ok = self.kv.allocate_many(items, checked=True)
        assert ok, "blocks were reserved for the running requests"

        # 3. Swapped-out requests come back before anything new is admitted (FCFS).
        while (
            self.swapped
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 1:
                n = min(n, prefill_left)
                if n <= 0:
                    break
                prefill_left -= n
            need = self.kv.swap_in_blocks_needed(req.request_id, n)
            if need + self._readmit_headroom() > self.kv.num_free_blocks:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(req.request_id))
            ok = self.kv.allocate_slots(req.request_id, n)
            assert ok
            self._start_running(req)
            plan.append((req, n))
            budget -= n

        # 4. Admit waiting requests FCFS while budget, seats and blocks allow.
        preempted_now = {rid for rid, _ in out.preempted}
        while (
            self.waiting
            and not self.swapped
            and budget > 0
            and prefill_left > 0
            and len(self.running) + len(self.tier_loading) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.status is RequestStatus.WAITING and req.request_id in preempted_now:
                break  # evicted this very step: re-admitting it now would only thrash
            salt = self._kv_salt(req)
            reuse = req.sampling_params.prompt_logprobs is None and not (
                req.pooling_params is not None and req.pooling_params.needs_all_rows
            )
            if not reuse:
                computed, num_cached = [], 0  # every prompt position's logits / hidden rows are needed
            else:
                computed, num_cached = self.kv.get_computed_blocks(req.all_token_ids, salt)
            n = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget, prefill_left)
            need = self.kv.blocks_needed(req.request_id, n, computed)
            reserve = self.config.watermark_blocks if self.running else 0
            if req.num_preemptions:
                # A victim comes back only when its whole context fits with room to grow.
                full = self.kv.blocks_needed(req.request_id, req.num_tokens - num_cached, computed)
                reserve = max(reserve, full - need + self._readmit_headroom())
            if reuse and self.kv.tiers is not None and self.tier_loading.try_start(
                self, req, num_cached, salt, reserve
            ):
                self.waiting.popleft()
                out.admitted.append(req.request_id)
                continue
            if need + reserve > self.kv.num_free_blocks:
                break
            ok = self.kv.allocate_slots(req.request_id, n, computed, salt)
            assert ok
            self.waiting.popleft()
            if self.rope_long_from is not None:
                req.rope_long = len(req.all_token_ids) > self.rope_long_from
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            self._start_running(req)
            out.admitted.append(req.request_id)
            plan.append((req, n))
            budget -= n
            prefill_left -= n

        for req in self.waiting:
            req.steps_waited += 1
        for req in self.swapped:
            req.steps_waited += 1
        out.blocks_to_copy = self.kv.take_block_copies()
        out.table_deltas = self.kv.take_table_deltas()
        if self.kv.tiers is not None:
            self.kv.tiers.on_evicted(self.kv.pool.evicted)
            self.kv.pool.evicted = []
            out.kv_stores, out.kv_loads, out.kv_deletes = self.kv.tiers.take_ops()
        self._describe_batch(plan, out)
        return out

    def on_tier_report(self, rep: TierReport) -> None:
        """The worker's tier answer: loaded requests run from their loaded prefix."""
        self.tier_loading.finish(self, rep)

    @staticmethod
    def _drop_drafts(plan: list[tuple[Request, int]], items: list[tuple[str, int]]) -> int:
        """Unschedule every planned draft (the batch does not fit with them); the tokens freed."""
        freed = 0
        for i, (r, n) in enumerate(plan):
            k = len(r.spec_token_ids)
            if k:
                plan[i], items[i] = (r, n - k), (r.request_id, n - k)
                r.spec_token_ids, r.spec_parents = [], None
                freed += k
        return freed

    def _describe_batch(self, plan: list[tuple[Request, int]], out: SchedulerOutput) -> None:
        """The batch as plain data for the runner(s): ids, new and computed tokens, each new
        request's prompt and parameters once, and the tokens each request gained since the
        runner last saw it."""
        out.req_ids = ids = [r.request_id for r, _ in plan]
        out.num_scheduled_tokens = [n for _, n in plan]
        out.num_computed_tokens = [r.num_computed_tokens for r, _ in plan]
        spec = {r.request_id: r.spec_token_ids for r, _ in plan if r.spec_token_ids}
        if self.speculator is not None:
            out.spec_token_ids = spec
            out.spec_tree_parents = {r.request_id: r.spec_parents for r, _ in plan if r.spec_parents}
            self.speculator.stats.last_step_draft_slots = sum(map(len, spec.values()))
        new_tokens = out.new_token_ids
        for (req, _), rid in zip(plan, ids):
            toks = req.all_token_ids
            sent = req.num_synced_tokens
            if len(toks) > sent:  # (a decode step: one token each)
                if not sent:
                    out.new_reqs.append(self._new_request_data(req))
                    sent = req.num_synced_tokens
                    if len(toks) == sent:
                        continue
                new_tokens[rid] = toks[sent:]
                req.num_synced_tokens = len(toks)
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []

    @staticmethod
    def _new_request_data(req: Request) -> NewRequestData:
        """A request the runner has not seen: its prompt (its outputs follow as new tokens) and
        its unforked n > 1 children, which the runner keeps from now on too."""
        req.num_synced_tokens = req.num_prompt_tokens
        for child in req.children:
            child.num_synced_tokens = child.num_prompt_tokens
        return NewRequestData(
            req_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            index=req.index,
            children=[(c.request_id, c.index) for c in req.children],
            bad_words_token_ids=req.bad_words_token_ids,
            pooling_params=req.pooling_params,
        )

    def take_finished_ids(self) -> SchedulerOutput | None:
        """An empty step that only tells the runner(s) which requests finished, or None when
        none did since the last step (the engine sends it when it goes idle, so an idle server
        keeps nothing of a finished request)."""
        if not self.finished_req_ids:
            return None
        out = SchedulerOutput(step=self.step, table_deltas=self.kv.take_table_deltas())
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        return out

    def _kv_salt(self, req: Request) -> str | None:
        """The request's prefix-cache salt; LongRoPE K computed with the long factors are
        different content from the short ones, so they are cached apart."""
        if self.rope_long_from is None or len(req.all_token_ids) <= self.rope_long_from:
            return req.cache_salt
        return "\x00longrope-long:" + ("\x00" if req.cache_salt is None else req.cache_salt)

    def _recompute_rope_crossings(self) -> None:
        """Running requests whose sequence just grew past the LongRoPE switch point hold K
        rotated with the short factors: free them and recompute the whole sequence with the
        long ones (HF's Phi-3 drops its cache there), ahead of every waiting request."""
        long_from = self.rope_long_from
        crossed = [
            r for r in self.running
            if not r.rope_long and r.num_computed_tokens and len(r.all_token_ids) > long_from
        ]
        for req in reversed(crossed):
            self.running.remove(req)
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            self.num_rope_recomputes += 1

    def _readmit_headroom(self) -> int:
        """Free blocks a preempted request must leave for the running ones' next blocks.

        Without it a victim comes back as soon as its own blocks fit, runs the pool dry again
        and evicts (or is evicted) at once: two long requests would trade places forever.
        """
        return len(self.running)

    def update_after_step(
        self, so: SchedulerOutput, now: float, accepted: Mapping[str, list[int]] | None = None
    ) -> list[Request]:
        """Account the step's computed tokens; return the requests now due a sampled token.
        ``accepted``: each speculating request's accepted drafts (the runner's verification).

        Shared by the engine and the simulator, so both advance requests identically.
        """
        due = []
        requests = self.requests
        reqs = [requests[rid] for rid in so.req_ids]
        for req, n in zip(reqs, so.num_scheduled_tokens):
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.num_computed_tokens += n
            if req.spec_token_ids:
                self._roll_back_rejected(req, (accepted or {}).get(req.request_id, []))
                due.append(req)
            elif req.num_computed_tokens == len(req.all_token_ids):
                due.append(req)
        self.kv.cache_computed_blocks(reqs)
        return due

    def _roll_back_rejected(self, req: Request, accepted: list[int]) -> None:
        """A verified speculation: the rejected drafts' slots go back now (num_computed_tokens
        and the block tables end at the last accepted token; blocks held only for rejected
        tokens return to the pool), and full blocks of accepted tokens are published (never
        a block holding an unverified token: publishing stops at num_computed_tokens)."""
        drafts = req.spec_token_ids
        a = len(accepted)  # the runner's: a chain's agreeing prefix, or a tree's path
        rejected = len(drafts) - a
        stats = self.speculator.stats
        if rejected:
            req.num_computed_tokens -= rejected
            used = self.kv.num_used_blocks
            self.kv.trim(req.request_id, req.num_computed_tokens)
            freed = used - self.kv.num_used_blocks
            stats.last_step_released_blocks += freed
            stats.released_blocks += freed
        if a and self.kv.enable_prefix_caching:
            self.kv.cache_blocks(req.request_id, req.all_token_ids + accepted[:a], req.num_computed_tokens)
        self.speculator.observe(req, len(drafts), a)

    def update_from_output(
        self,
        so: SchedulerOutput,
        sampled: Mapping[str, int] | Callable[[Request], int],
        now: float,
        fork: Callable[[Request], list[Request]] | None = None,
        accepted: Mapping[str, list[int]] | None = None,
    ) -> list[Request]:
        """The one post-step update (vLLM v1's name), for the engine and the simulator alike.

        Accounts the step's computed tokens and publishes full blocks, then appends each due
        request's sampled token (``sampled``: by request id, or a function of the request, as
        the simulator's placeholder tokens), after a speculating request's ``accepted`` drafts,
        and finishes it at EOS, a stop token id or its length (a stop among the accepted
        drafts drops the tokens after it; ``Request.num_new_tokens`` says how many stayed).
        ``fork`` (the engine's) turns an n > 1 parent's children into running requests once
        the shared prompt is computed. Returns the requests that got a token,
        children before their parent; what needs the tokenizer (text, stop strings) is the
        caller's.
        """
        token_of = sampled if callable(sampled) else (lambda r: sampled[r.request_id])
        updated = []
        if self.speculator is not None:
            self.speculator.stats.last_step_released_blocks = 0
        for req in self.update_after_step(so, now, accepted):
            if req.pooling_params is not None:  # prefill only: the runner pooled its prompt
                self.finish_request(req, "stop")
                req.finished_time = now
                continue
            if fork is not None and req.children and req.num_output_tokens == 0:
                for child in fork(req):
                    self._append_token(child, token_of(child), now)
                    updated.append(child)
            if req.spec_token_ids:
                self._append_verified(req, accepted[req.request_id], token_of(req), now)
            else:
                self._append_token(req, token_of(req), now)
            updated.append(req)
        return updated

    def _append_verified(self, req: Request, accepted: list[int], token: int, now: float) -> None:
        """A speculating request's accepted drafts, then the verification's own token, each
        checked for a stop as if it had been decoded alone."""
        req.spec_token_ids, req.spec_parents = [], None
        n = 0
        for t in [*accepted, token]:
            self._append_token(req, t, now)
            n += 1
            if req.is_finished:
                break
        req.num_new_tokens = n

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.append_output_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        reason = check_stop(req, token)
        # Structured outputs: the matcher sees exactly the accepted tokens (kvledger.structured).
        if req.grammar is not None and req.grammar.accept(token) and reason is None:
            reason = "stop"  # the grammar reached its end
        if reason is not None:
            self.finish_request(req, reason)
            req.finished_time = now

    def check_prompt(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this many tokens can never run here; None if it can."""
        n, max_len = num_prompt_tokens, self.config.max_model_len
        if max_len is not None and n >= max_len:
            return (
                f"prompt has {n} tokens, but the model's context is {max_len} tokens "
                "(max_model_len) including at least one output token"
            )
        need = self.kv.prompt_blocks_bound(n, self.config.max_num_batched_tokens)
        if need > self.kv.pool.num_blocks:
            return f"prompt of {n} tokens needs {need} KV blocks; the pool only has {self.kv.pool.num_blocks}"
        return None

    def _start_running(self, req: Request) -> None:
        if req.num_preemptions:
            req.last_resumed_step = self.step
        if req.admitted_step < 0:
            req.admitted_step = self.step
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        rid = victim.request_id
        self.running.remove(victim)
        victim.spec_token_ids, victim.spec_parents = [], None  # dropped with its slots
        victim.num_preemptions += 1
        mode = self.choose_mode(victim)
        if mode == "swap" and self.kv.can_swap_out(rid):
            out.blocks_to_swap_out.extend(self.kv.swap_out(rid))
            victim.status = RequestStatus.SWAPPED
            self._insert_by_arrival(self.swapped, victim)
        else:
            mode = "recompute"
            self.kv.free(rid)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self._insert_by_arrival(self.waiting, victim, preempted_only=True)
        self.num_preemptions[mode] += 1
        out.preempted.append((rid, mode))

    def choose_mode(self, victim: Request) -> str:
        """Swap or recompute, by the cost model (or the configured override)."""
        kv = self.kv
        if kv.host_pool is None:
            return "recompute"
        private, shared_prefix = kv.preemption_footprint(victim.request_id)
        swap_bytes = private * kv.bytes_per_block
        # Only blocks other requests hold are sure to survive for a recompute to reuse.
        cached = min(shared_prefix * kv.block_size, victim.num_computed_tokens)
        return self.cost_model.choose(victim.num_computed_tokens, swap_bytes, cached)

    @staticmethod
    def _insert_by_arrival(queue: deque[Request], req: Request, preempted_only: bool = False) -> None:
        """Preempted requests go ahead of new ones, oldest first, so none is overtaken forever."""
        i = 0
        for i, other in enumerate(queue):  # noqa: B007
            if (preempted_only and other.num_preemptions == 0) or other.arrival_time > req.arrival_time:
                break
        else:
            i = len(queue)
        queue.insert(i, req)

