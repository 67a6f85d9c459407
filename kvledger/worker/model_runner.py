"""The runner computes: one step message -> flat tensors -> one forward pass -> samples.

It reads nothing but the step's ``SchedulerOutput`` and what earlier messages told it (its
``RequestStates`` and ``BlockTable``s), so the local runner and every tensor-parallel rank run
the same code on the same message. Per step it brings its request states and block tables up
to date, carries out the block copies the scheduler asked for (swap-out, then copy-on-write,
then swap-in, so that a block freed by a swap-out is read before anything reuses it), builds
the step's positions / slot mapping / block tables, runs the model once for all prefill chunks
and decodes together, and samples the requests whose next token is due.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvledger.cache.kv_tier_messages import TierReport
from kvledger.core.sched_output import SchedulerOutput
from kvledger.kernels import native
from kvledger.logprobs import Logprob
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.pooling.pooler import PoolingAccumulator
from kvledger.sample.sampler import SampleRequest, make_logprobs, sample
from kvledger.spec_decode import tree
from kvledger.spec_decode.rejection import num_accepted
from kvledger.storage.kv_cache import HostKVPool, KVCachePool
from kvledger.structured.bitmask import GrammarBitmask
from kvledger.worker.block_table import BlockTable
from kvledger.worker.request_state import CachedRequestState, RequestStates

if TYPE_CHECKING:  # hints only: the worker sits below the engine core (tests/test_layers.py)
    from kvledger.core.scheduler import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """What comes back from a step (plain data: it crosses from a rank to the engine)."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob] | None] = field(default_factory=dict)
    # Speculative decoding: each speculating request's accepted drafts (``sampled`` is then
    # the token after them) and their logprobs.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    # Token trees: the accepted path's nodes (kvledger.spec_decode.tree.walk), whose K/V the
    # runner has moved to their positions' slots.
    spec_tree_paths: dict[str, list[int]] = field(default_factory=dict)
    # A draft model's drafts this step (worker/drafter.py), which the scheduler only knew as
    # placeholders: the engine gives them to their requests before the update.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    pooler_output: dict[str, list[float]] = field(default_factory=dict)  # pooling requests done
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0
    kv_tiers: TierReport | None = None  # the tiered prefix cache's loads / stores (storage/kv_tiers.py)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    states: list[CachedRequestState]  # the batch's requests, in order
    sample_rows: list[int]  # flat row of each request due a token
    # Who samples from which of those rows, in sampling order: a due request, and at an n > 1
    # request's first sample its children too (index into sample_rows, state).
    samplers: list[tuple[int, CachedRequestState]]
    prompt_rows: list[tuple[CachedRequestState, int, int, int]]  # (state, row, count, start)
    # Speculating requests and their drafts; each one's 1 + len(drafts) rows are consecutive
    # samplers.
    verify: list[tuple[CachedRequestState, list[int]]] = field(default_factory=list)
    # Those whose drafts are a token tree: its parents, and the flat row of its root (the slots of
    # its chunk are meta.slot_mapping from there).
    trees: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    # Pooling requests: (id, params, first row, rows, start, prompt length); see pooling/pooler.py.
    pooling: list[tuple] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVCachePool,
        host_pool: HostKVPool | None,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        layer_group: tuple[int, ...] | None = None,
        layer_caches: list | None = None,
        rope_long_from: int | None = None,
        graphs=None,
        drafter=None,
        tiers=None,
    ) -> None:
        """``layer_group``: a hybrid model's group of each layer (None: one group), and
        ``layer_caches`` each layer's cache (shared tensors when grouped); ``rope_long_from``:
        LongRoPE's switch point (Scheduler.rope_long_from); ``graphs``: CUDA graphs of decode
        steps (kvledger.worker.cuda_graphs); ``drafter``: a draft model's proposer
        (kvledger.worker.drafter)."""
        self.model = model
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.device = device
        self.block_size = block_size
        self.requests = RequestStates(eos_token_ids)
        # The runner's own block tables, one per KV cache group, updated from each step's
        # table deltas only.
        self.block_tables: list[BlockTable] = [BlockTable()]
        self.layer_group = layer_group
        self.layer_caches = layer_caches if layer_caches is not None else kv_pool.layers
        self.rope_long_from = rope_long_from
        self.generator = torch.Generator().manual_seed(seed)
        self.graphs = graphs
        self.drafter = drafter
        self.num_tree_moves = 0  # token trees: K/V rows moved for paths off the chain (tests read it)
        self.tiers = tiers  # storage.kv_tiers.TierWorker: moves blocks to / from lower tiers
        self._forks: list[tuple[str, str]] = []  # n > 1 (parent, child) forked this step
        self.pooler = PoolingAccumulator()  # pooling requests' partial pools across chunks
        # Quantised KV with sinks / a recent window: which full-precision overlay slot each
        # request owns (kvledger.storage.kv_overlay.OverlaySlots); None for unquantised caches.
        self.overlay = None
        if kv_pool.overlay is not None:
            from kvledger.storage.kv_overlay import OverlaySlots

            self.overlay = OverlaySlots(kv_pool)

    @property
    def block_table(self) -> BlockTable:
        """Group 0's tables (every layer's, unless the model is hybrid)."""
        return self.block_tables[0]

    def update_states(self, so: SchedulerOutput) -> None:
        """Requests and block tables as the message says, before anything runs."""
        if self.overlay is not None and so.finished_req_ids:
            self.overlay.release(so.finished_req_ids)
        self.requests.update(so)
        if so.finished_req_ids:
            self.pooler.drop(so.finished_req_ids)
        deltas = so.table_deltas
        if deltas.changed:
            top = max(d.group for d in deltas.changed)
            while len(self.block_tables) <= top:
                self.block_tables.append(BlockTable())
        for g, bt in enumerate(self.block_tables):
            bt.apply(deltas, g)

    # -- block movement --------------------------------------------------------------------
    def apply_block_ops(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        if so.blocks_to_swap_out:
            t0 = time.perf_counter()
            self.host_pool.swap_out(so.blocks_to_swap_out)
            out.swap_out_seconds = time.perf_counter() - t0
        self.kv_pool.copy_blocks(so.blocks_to_copy)
        if so.blocks_to_swap_in:
            t0 = time.perf_counter()
            self.host_pool.swap_in(so.blocks_to_swap_in)
            out.swap_in_seconds = time.perf_counter() - t0

    # -- the step ---------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the step into the model's inputs (no model call: benchmarked on its own).

        The per-step hot path: list comprehensions over the batch, no per-request calls.
        """
        requests = self.requests
        states = [requests[rid] for rid in so.req_ids]
        query_lens = so.num_scheduled_tokens
        starts = so.num_computed_tokens
        spec = so.spec_token_ids
        seq_lens = [c + n for c, n in zip(starts, query_lens)]
        rows = self.block_table.rows(so.req_ids)  # rows of the runner's table
        decode_only = max(query_lens) == 1
        if decode_only:  # one token each
            input_ids = [r.all_token_ids[c] for r, c in zip(states, starts)]
            offsets: list[int] | range = range(len(states))  # each request's first flat row
            last_rows: list[int] | range = offsets
        else:
            input_ids = []
            for r, c, e in zip(states, starts, seq_lens):
                input_ids.extend(r.all_token_ids[c:e])
                if spec and r.request_id in spec:  # the drafts follow the last accepted token
                    input_ids.extend(spec[r.request_id])
            offsets = [0, *itertools.accumulate(query_lens)]
            last_rows = [x - 1 for x in offsets[1:]]
        if spec:
            sample_rows, samplers, verify = self._verify_rows(states, offsets, last_rows, seq_lens, spec)
        else:
            due = [e == len(r.all_token_ids) and r.pooling_params is None for r, e in zip(states, seq_lens)]
            sample_rows = [x for x, d in zip(last_rows, due) if d]  # flat row of each due request
            samplers = [(i, r) for i, r in enumerate(r for r, d in zip(states, due) if d)]
            verify = []
        if any(r.children for _, r in samplers):
            samplers = self._with_children(samplers)
        prompt_rows: list[tuple[CachedRequestState, int, int, int]] = []
        for i in [i for i, r in enumerate(states) if r.sampling_params.prompt_logprobs is not None]:
            r, c = states[i], starts[i]
            if r.num_output_tokens == 0:
                # Row p predicts prompt token p + 1.
                last = min(c + query_lens[i], r.num_prompt_tokens - 1)
                if last > c:
                    prompt_rows.append((r, offsets[i], last - c, c))
        meta, positions = self._build_metadata(
            query_lens, seq_lens, starts, rows, self.block_size, decode_only
        )
        if self.layer_group is not None and len(self.block_tables) > 1:
            self._group_metadata(meta, so.req_ids, query_lens)
        if self.rope_long_from is not None:  # the table follows the whole sequence's length
            lens = np.asarray([len(r.all_token_ids) for r in states], dtype=np.int64)
            meta.rope_seq_lens = torch.from_numpy(lens).to(self.device)
        trees = {}
        if so.spec_tree_parents:
            positions, trees = self._tree_rows(meta, states, offsets, starts, so.spec_tree_parents)
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(self.device)
        inp = StepInputs(ids, positions, meta, states, sample_rows, samplers, prompt_rows, verify, trees)
        if any(r.pooling_params is not None for r in states):
            first = [0, *itertools.accumulate(query_lens)]
            inp.pooling = [
                (r.request_id, r.pooling_params, first[i], query_lens[i], starts[i], r.num_prompt_tokens)
                for i, r in enumerate(states) if r.pooling_params is not None
            ]  # fmt: skip
        return inp

    def _tree_rows(
        self,
        meta: AttentionMetadata,
        states: list[CachedRequestState],
        offsets: list[int] | range,
        starts: list[int],
        parents_of: dict[str, list[int]],
    ) -> tuple[torch.Tensor, dict[str, tuple[list[int], int]]]:
        """Token trees (kvledger.spec_decode.tree): node j keeps slot start + 1 + j (the
        slot mapping as built) but sits at position start + depth(j), and its row sees its
        ancestors only (meta.tree_mask). Returns the positions and each tree's (parents, root row)."""
        pos = self._np_positions.copy()
        mask = np.zeros(len(pos), dtype=np.uint64)
        trees = {}
        for i, st in enumerate(states):
            parents = parents_of.get(st.request_id)
            if parents is None:
                continue
            o = offsets[i]
            pos[o + 1 : o + 1 + len(parents)] = starts[i] + np.asarray(tree.depths(parents), dtype=np.int64)
            mask[o : o + 1 + len(parents)] = tree.ancestor_masks(parents)
            trees[st.request_id] = (parents, o)
        meta.tree_mask = torch.from_numpy(mask.view(np.int64))
        meta.tree_reqs = frozenset(i for i, st in enumerate(states) if st.request_id in trees)
        return torch.from_numpy(pos), trees

    @staticmethod
    def _verify_rows(
        states: list[CachedRequestState],
        offsets: list[int],
        last_rows: list[int],
        seq_lens: list[int],
        spec: dict[str, list[int]],
    ) -> tuple[list[int], list[tuple[int, CachedRequestState]], list[tuple[CachedRequestState, list[int]]]]:
        """Sample rows when some requests speculate: each of them samples all its rows (after
        the last accepted token and after each draft: the target's token for each prefix),
        the other due requests their last row, as usual."""
        sample_rows: list[int] = []
        samplers: list[tuple[int, CachedRequestState]] = []
        verify: list[tuple[CachedRequestState, list[int]]] = []
        for i, (r, e) in enumerate(zip(states, seq_lens)):
            drafts = spec.get(r.request_id)
            if drafts:
                verify.append((r, drafts))
                for x in range(offsets[i], offsets[i] + len(drafts) + 1):
                    samplers.append((len(sample_rows), r))
                    sample_rows.append(x)
            elif e == len(r.all_token_ids) and r.pooling_params is None:
                samplers.append((len(sample_rows), r))
                sample_rows.append(last_rows[i])
        return sample_rows, samplers, verify

    def _with_children(
        self, samplers: list[tuple[int, CachedRequestState]]
    ) -> list[tuple[int, CachedRequestState]]:
        """An n > 1 request's first row is sampled for its children too, which are forked
        from then on (every rank does this, sampling or not, so their states agree)."""
        out = []
        for i, st in samplers:
            out.append((i, st))
            if st.children and st.num_output_tokens == 0:
                children = self.requests.forked(st)
                out += [(i, child) for child in children]
                self._forks += [(st.request_id, c.request_id) for c in children]
        return out

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, sample: bool = True) -> ModelRunnerOutput:
        """Run one step. ``sample``: pick tokens here (False on tensor-parallel ranks other
        than 0, which still compute every logits row: the all-gather needs them)."""
        out = ModelRunnerOutput()
        self.update_states(so)
        if self.tiers is not None:  # stores read blocks before this step's copies write them
            out.kv_tiers = self.tiers.step(so)
        self.apply_block_ops(so, out)
        if self.drafter is not None:
            self.drafter.sync(so)
            if so.req_ids and self.drafter.wanted(so):
                out.draft_token_ids = self.drafter.propose(self, so)
                so = replace(so, spec_token_ids={**so.spec_token_ids, **out.draft_token_ids})
        if not so.req_ids:
            return out
        inp = self.prepare(so)
        if self.overlay is not None:  # quantised KV: full-precision sink / window slots
            self.overlay.annotate(inp.meta, inp.states, so.spec_token_ids)
        hidden = None
        if self.graphs is not None and inp.meta.is_pure_decode:
            hidden = self.graphs.run(inp.input_ids, inp.positions, inp.meta)
        if hidden is None:
            threads, before = native.step_threads(inp.input_ids.shape[0]), torch.get_num_threads()
            if threads:  # a large step on a core that computes small ones with fewer threads
                torch.set_num_threads(threads)
            try:
                hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.layer_caches)
            finally:
                if threads:
                    torch.set_num_threads(before)
        if self.overlay is not None:
            self.overlay.after_step(inp.meta, inp.states)
            for parent, child in self._forks:  # a child starts from its parent's rows
                self.overlay.fork(parent, child)
        self._forks.clear()
        if inp.pooling and sample:
            out.pooler_output = self.pooler.pool_step(hidden, inp.pooling, getattr(self.model, "score", None))
        rows = _logits_rows(inp)
        if not rows:
            return out
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[idx])
        if sample:
            self._consume_logits(inp, logits.float().cpu(), so.grammar_bitmask, out)
            if out.draft_token_ids:
                self.drafter.verified(out.spec_token_ids)
            if inp.trees:
                self._move_tree_paths(inp, out)
        return out

    def _move_tree_paths(self, inp: StepInputs, out: ModelRunnerOutput) -> None:
        """An accepted tree path that left the chain: its nodes' K/V go to the slots of the
        positions they now hold (start + 1, start + 2, ...), in this step, so that the slots the
        scheduler keeps hold the accepted tokens' K/V (kvledger.spec_decode.tree.moves)."""
        src: list[int] = []
        dst: list[int] = []
        slots = inp.meta.slot_mapping
        for rid, path in out.spec_tree_paths.items():
            root = inp.trees[rid][1]
            for j, i in tree.moves(path):
                src.append(root + 1 + j)
                dst.append(root + 1 + i)
        if not src:
            return
        self.num_tree_moves += len(src)
        src_t = slots[torch.tensor(src, dtype=torch.long)]
        dst_t = slots[torch.tensor(dst, dtype=torch.long)]
        data = self.kv_pool.data  # [layers, 2, blocks, block_size, kv heads, head dim]
        flat = data.view(data.shape[0], 2, -1, *data.shape[4:])
        flat[:, :, dst_t] = flat[:, :, src_t]

    def _consume_logits(
        self,
        inp: StepInputs,
        logits: torch.Tensor,
        bitmask: GrammarBitmask | None,
        out: ModelRunnerOutput,
    ) -> None:
        """Sample the due requests and fill prompt logprobs from the rows of ``_logits_rows``."""
        n_sample = len(inp.sample_rows)
        self._sample(logits[:n_sample], inp.samplers, bitmask, out, inp.verify, inp.trees)
        off = n_sample
        for st, _, count, start in inp.prompt_rows:
            lp = logits[off : off + count].log_softmax(dim=-1)
            off += count
            targets = st.all_token_ids[start + 1 : start + 1 + count]
            k = st.sampling_params.prompt_logprobs
            out.prompt_logprobs[st.request_id] = make_logprobs(lp, targets, k)

    def _build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        starts: list[int],
        rows: list[int],
        bs: int,
        decode_only: bool = False,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        dev = self.device
        num_reqs = len(query_lens)
        # Block tables: one gather from the runner's array, whose rows are zero past each
        # table (padding reads block 0, masked out by seq_lens).
        rows_arr = np.asarray(rows)
        bt = self.block_table
        max_blocks = int(bt.num_blocks[rows_arr].max())
        block_tables = bt.array[rows_arr, :max_blocks]
        if decode_only:  # one query row per request, at position start
            positions = np.asarray(starts, dtype=np.int64)
            qsl = np.arange(num_reqs + 1, dtype=np.int64)
            slot_mapping = block_tables[np.arange(num_reqs), positions // bs] * bs + positions % bs
        else:
            ql = np.asarray(query_lens, dtype=np.int64)
            qsl = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(ql, out=qsl[1:])
            req_idx = np.repeat(np.arange(num_reqs), ql)
            positions = (
                np.arange(qsl[-1]) - qsl[:-1][req_idx] + np.asarray(starts, dtype=np.int64)[req_idx]
            )
            slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            block_size=bs,
            max_query_len=1 if decode_only else max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        self._np_positions = positions
        return meta, torch.from_numpy(positions).to(dev)

    def _group_metadata(self, meta: AttentionMetadata, rids: list[str], query_lens: list[int]) -> None:
        """Hybrid models: each further group's block tables and slots, the step otherwise the
        same; ``meta.per_layer`` then gives each layer its group's view."""
        bs = self.block_size
        pos = self._np_positions
        req_idx = np.repeat(np.arange(len(rids)), np.asarray(query_lens, dtype=np.int64))
        views = []
        for bt in self.block_tables[1:]:
            rows = np.asarray(bt.rows(rids))
            max_blocks = int(bt.num_blocks[rows].max())
            tables = bt.array[rows, :max_blocks]
            slots = tables[req_idx, pos // bs] * bs + pos % bs
            views.append((torch.from_numpy(tables).to(self.device), torch.from_numpy(slots).to(self.device)))
        meta.set_group_views(views, self.layer_group)

    def _sample(
        self,
        logits: torch.Tensor,
        samplers: list[tuple[int, CachedRequestState]],
        bitmask: GrammarBitmask | None,
        out: ModelRunnerOutput,
        verify: list[tuple[CachedRequestState, list[int]]] = (),
        trees: dict[str, tuple[list[int], int]] | None = None,
    ) -> None:
        """A token for each sampler, from its row of ``logits``; a speculating request keeps
        its drafts up to the first row whose token differs, and that row's token
        (kvledger.spec_decode.rejection)."""
        if not samplers:
            return
        rows = [i for i, _ in samplers]
        owners = [st for _, st in samplers]
        sreqs = [SampleRequest(st.sampling_params, st.generator, st) for st in owners]
        # Without n > 1 children every row is sampled once, in order: no copy of the logits.
        logits = logits if len(rows) == logits.shape[0] else logits[rows]
        mask = _aligned_bitmask(bitmask, owners)  # structured outputs: one packed mask per step
        tokens, logprobs = sample(logits, sreqs, self.generator, mask)
        for r, t, lp in zip(owners, tokens, logprobs):
            out.sampled[r.request_id] = t
            out.logprobs[r.request_id] = lp
        first_of: dict[str, int] = {}
        trees = trees or {}
        if verify:
            for j, st in enumerate(owners):
                first_of.setdefault(st.request_id, j)
        for st, drafts in verify:
            first = first_of[st.request_id]
            got = tokens[first : first + len(drafts) + 1]
            rid = st.request_id
            if rid in trees:  # the path the samples take through the tree
                path = tree.walk(drafts, trees[rid][0], got)
                rows = [0, *(j + 1 for j in path)]  # the rows that sampled each emitted token
                out.spec_tree_paths[rid] = path
            else:
                rows = list(range(num_accepted(drafts, got) + 1))
            out.sampled[rid] = got[rows[-1]]
            out.logprobs[rid] = logprobs[first + rows[-1]]
            out.spec_token_ids[rid] = [got[r] for r in rows[:-1]]
            out.spec_logprobs[rid] = [logprobs[first + r] for r in rows[:-1]]


def _aligned_bitmask(
    bitmask: GrammarBitmask | None, owners: list[CachedRequestState]
) -> tuple[torch.Tensor, list[int]] | None:
    """The engine's mask rows in the sampler's row order, and the constrained rows."""
    if bitmask is None:
        return None
    where = bitmask.rows
    rows = [i for i, st in enumerate(owners) if st.request_id in where]
    if not rows:
        return None
    # A speculating request's rows are consecutive in both orders, from its first.
    seen: dict[str, int] = {}
    src = []
    for i in rows:
        rid = owners[i].request_id
        k = seen[rid] = seen.get(rid, -1) + 1
        src.append(where[rid] + k)
    mask = bitmask.mask
    if src != rows or mask.shape[0] < len(owners):
        aligned = mask.new_full((len(owners), mask.shape[1]), -1)
        aligned[rows] = mask[src]
        mask = aligned
    return mask, rows


def _logits_rows(inp: StepInputs) -> list[int]:
    """Hidden rows that need logits: the sampled ones, then each prompt-logprobs run."""
    rows = list(inp.sample_rows)
    for _, first, count, _ in inp.prompt_rows:
        rows.extend(range(first, first + count))
    return rows
