"""The runner computes: one scheduler step -> flat tensors -> one forward pass -> samples.

It carries out the block copies the scheduler asked for (swap-out, then copy-on-write, then
swap-in, so that a block freed by a swap-out is read before anything reuses it), builds the
step's positions / slot mapping / block tables, runs the model once for all prefill chunks
and decodes together, and samples the requests whose next token is due.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvledger.cache.table_delta import TableDeltas
from kvledger.core.request import Request
from kvledger.core.scheduler import SchedulerOutput
from kvledger.kernels import native
from kvledger.logprobs import Logprob
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.sample.sampler import SampleRequest, make_logprobs, sample
from kvledger.storage.kv_cache import HostKVPool, KVCachePool
from kvledger.structured.state import MaskBuffer
from kvledger.worker.block_table import BlockTable


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob] | None] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    sample_reqs: list[Request]
    prompt_rows: list[tuple[Request, int, int, int]]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVCachePool,
        host_pool: HostKVPool | None,
        block_size: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.device = device
        self.block_size = block_size
        # The runner's own block tables, one per KV cache group (hybrid models,
        # kvledger.ledger.kv_cache_groups), updated from each step's table deltas only; and
        # which group each model layer reads (None: one group).
        self.block_tables: list[BlockTable] = [BlockTable()]
        self.layer_group: tuple[int, ...] | None = None
        # The model's per-layer caches (shared tensors when grouped); none in a TP driver.
        self.layer_caches = kv_pool.layers if kv_pool is not None else []
        self.rope_long_from: int | None = None  # LongRoPE: see Scheduler.rope_long_from
        self.masks = MaskBuffer()  # structured outputs' per-step grammar mask
        self.generator = torch.Generator().manual_seed(seed)
        # Quantised KV with sinks / a recent window: which full-precision overlay slot each
        # request owns (kvledger.storage.kv_overlay.OverlaySlots); None for unquantised caches.
        self.overlay = None
        # CUDA graphs of decode steps (kvledger.worker.cuda_graphs), set by the engine on CUDA.
        self.graphs = None
        # Tensor parallelism: the ranks run the model (kvledger.executor.tp_executor.TPExecutor);
        # this runner prepares each step's plan and samples from rank 0's logits.
        self.executor = None
        self.last_step_ranks: list = []  # the ranks' StepResults of the last step (timings)
        if kv_pool is not None and kv_pool.overlay is not None:
            from kvledger.storage.kv_overlay import OverlaySlots

            self.overlay = OverlaySlots(kv_pool)

    @property
    def block_table(self) -> BlockTable:
        """Group 0's tables (every layer's, unless the model is hybrid)."""
        return self.block_tables[0]

    def _apply_deltas(self, deltas: TableDeltas) -> None:
        if deltas.changed:
            top = max(d.group for d in deltas.changed)
            while len(self.block_tables) <= top:
                self.block_tables.append(BlockTable())
        for g, bt in enumerate(self.block_tables):
            bt.apply(deltas, g)

    # -- block movement --------------------------------------------------------------------
    def apply_block_ops(self, so: SchedulerOutput, out: RunnerOutput) -> None:
        if so.blocks_to_swap_out:
            t0 = time.perf_counter()
            self.host_pool.swap_out(so.blocks_to_swap_out)
            out.swap_out_seconds = time.perf_counter() - t0
        self.kv_pool.copy_blocks(so.blocks_to_copy)
        if so.blocks_to_swap_in:
            t0 = time.perf_counter()
            self.host_pool.swap_in(so.blocks_to_swap_in)
            out.swap_in_seconds = time.perf_counter() - t0

    @torch.inference_mode()
    def fork_overlay(self, parent: Request, child: Request) -> None:
        """An n > 1 child forked from parent starts with a copy of the parent's overlay slot."""
        if self.overlay is not None:
            self.overlay.fork(parent, child)

    def release_finished(self) -> None:
        """Drop the runner's per-request state (overlay slots) of requests that have finished,
        now rather than at the next step: an idle server keeps nothing of a finished request."""
        if self.overlay is not None:
            self.overlay.sweep()

    # -- the step ---------------------------------------------------------------------------
    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the step into the model's inputs (no model call: benchmarked on its own).

        The per-step hot path: list comprehensions over the batch, no per-request calls.
        """
        sched = so.scheduled
        reqs = [s.request for s in sched]
        query_lens = [s.num_new_tokens for s in sched]
        starts = [r.num_computed_tokens for r in reqs]
        seq_lens = [c + n for c, n in zip(starts, query_lens)]
        rows = self.block_table.rows([r.request_id for r in reqs])  # rows of the runner's table
        decode_only = max(query_lens) == 1
        if decode_only:  # one token each
            input_ids = [r.all_token_ids[c] for r, c in zip(reqs, starts)]
            offsets: list[int] | range = range(len(reqs))  # each request's first flat row
            last_rows: list[int] | range = offsets
        else:
            input_ids = []
            for r, c, e in zip(reqs, starts, seq_lens):
                input_ids.extend(r.all_token_ids[c:e])
            offsets = [0, *itertools.accumulate(query_lens)]
            last_rows = [x - 1 for x in offsets[1:]]
        due = [e == len(r.all_token_ids) for r, e in zip(reqs, seq_lens)]
        sample_rows = [x for x, d in zip(last_rows, due) if d]  # flat row of each due request
        sample_reqs = [r for r, d in zip(reqs, due) if d]
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (req, flat row, count, start)
        for i in [i for i, r in enumerate(reqs) if r.sampling_params.prompt_logprobs is not None]:
            r, c = reqs[i], starts[i]
            if r.num_output_tokens == 0:
                # Row p predicts prompt token p + 1.
                last = min(c + query_lens[i], r.num_prompt_tokens - 1)
                if last > c:
                    prompt_rows.append((r, offsets[i], last - c, c))
        meta, positions = self._build_metadata(
            query_lens, seq_lens, starts, rows, self.block_size, decode_only
        )
        if self.layer_group is not None and len(self.block_tables) > 1:
            self._group_metadata(meta, reqs, query_lens)
        if self.rope_long_from is not None:  # the table follows the whole sequence's length
            lens = np.asarray([len(r.all_token_ids) for r in reqs], dtype=np.int64)
            meta.rope_seq_lens = torch.from_numpy(lens).to(self.device)
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(self.device)
        return StepInputs(ids, positions, meta, sample_rows, sample_reqs, prompt_rows)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        self._apply_deltas(so.table_deltas)
        if self.overlay is not None and so.table_deltas.removed:
            self.overlay.drop_removed(so.table_deltas.removed)
        if self.executor is not None:
            return self._execute_on_ranks(so, out)
        self.apply_block_ops(so, out)
        if not so.scheduled:
            return out
        inp = self.prepare(so)
        if self.overlay is not None:  # quantised KV: full-precision sink / window slots
            self.overlay.annotate(inp.meta, [s.request for s in so.scheduled])
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
            self.overlay.after_step(inp.meta, [s.request for s in so.scheduled])
        rows = _logits_rows(inp)
        if not rows:
            return out
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[idx]).float().cpu()
        self._consume_logits(inp, logits, out)
        return out

    def _execute_on_ranks(self, so: SchedulerOutput, out: RunnerOutput) -> RunnerOutput:
        """Tensor parallelism: one StepPlan to every rank (block ops, inputs, logits rows);
        sampling and logprobs here, from rank 0's gathered logits, exactly as on one device."""
        from kvledger.executor.messages import StepPlan

        if not so.scheduled and not (so.blocks_to_swap_out or so.blocks_to_copy or so.blocks_to_swap_in):
            return out
        inp = self.prepare(so) if so.scheduled else None
        reqs = [s.request for s in so.scheduled]
        if self.overlay is not None and inp is not None:  # the driver keeps the slot bookkeeping
            self.overlay.annotate(inp.meta, reqs)
        rows = _logits_rows(inp) if inp is not None else []
        if inp is None:
            empty = np.zeros(0, dtype=np.int64)
            plan = StepPlan(empty, empty, empty, empty, empty, np.zeros((0, 0), dtype=np.int64),
                            0, 0, [], [], [])
        else:
            m = inp.meta
            plan = StepPlan(
                input_ids=inp.input_ids.numpy(), positions=inp.positions.numpy(),
                slot_mapping=m.slot_mapping.numpy(), query_start_loc=m.query_start_loc.numpy(),
                seq_lens=m.seq_lens.numpy(), block_tables=m.block_tables.numpy(),
                max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
                query_lens_list=m.query_lens_list, seq_lens_list=m.seq_lens_list, logits_rows=rows,
            )
            if m.rope_seq_lens is not None:  # LongRoPE: the table follows each sequence's length
                plan.rope_seq_lens = m.rope_seq_lens.numpy()
            if m.per_layer is not None:  # hybrid: each further group's view, in group order
                groups = m.group_views(self.layer_group)
                plan.group_block_tables = [g.block_tables.numpy() for g in groups]
                plan.group_slot_mappings = [g.slot_mapping.numpy() for g in groups]
            if m.overlay_slots is not None:
                plan.overlay_slots = m.overlay_slots
                plan.overlay_sink_from = m.overlay_sink_from
                plan.overlay_window_from = m.overlay_window_from
        if self.overlay is not None:  # pool operations since the last step, in order
            plan.overlay_ops = self.overlay.pool.take_ops()
        plan.blocks_to_swap_out = so.blocks_to_swap_out
        plan.blocks_to_copy = so.blocks_to_copy
        plan.blocks_to_swap_in = so.blocks_to_swap_in
        results = self.executor.execute(plan)
        self.last_step_ranks = results
        if self.overlay is not None and inp is not None:
            self.overlay.after_step(inp.meta, reqs)  # sink-cache saves go with the next plan
        out.swap_out_seconds = max(r.swap_out_seconds for r in results)
        out.swap_in_seconds = max(r.swap_in_seconds for r in results)
        if rows:
            self._consume_logits(inp, torch.from_numpy(results[0].logits), out)
        return out

    def _consume_logits(self, inp: StepInputs, logits: torch.Tensor, out: RunnerOutput) -> None:
        """Sample the due requests and fill prompt logprobs from the rows of ``_logits_rows``."""
        n_sample = len(inp.sample_rows)
        self._sample(logits[:n_sample], inp.sample_reqs, out)
        off = n_sample
        for req, _, count, start in inp.prompt_rows:
            lp = logits[off : off + count].log_softmax(dim=-1)
            off += count
            targets = req.all_token_ids[start + 1 : start + 1 + count]
            k = req.sampling_params.prompt_logprobs
            out.prompt_logprobs[req.request_id] = make_logprobs(lp, targets, k)

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

    def _group_metadata(self, meta: AttentionMetadata, reqs: list[Request], query_lens: list[int]) -> None:
        """Hybrid models: each further group's block tables and slots, the step otherwise the
        same; ``meta.per_layer`` then gives each layer its group's view."""
        bs = self.block_size
        pos = self._np_positions
        req_idx = np.repeat(np.arange(len(reqs)), np.asarray(query_lens, dtype=np.int64))
        views = []
        rids = [r.request_id for r in reqs]
        for bt in self.block_tables[1:]:
            rows = np.asarray(bt.rows(rids))
            max_blocks = int(bt.num_blocks[rows].max())
            tables = bt.array[rows, :max_blocks]
            slots = tables[req_idx, pos // bs] * bs + pos % bs
            views.append((torch.from_numpy(tables).to(self.device), torch.from_numpy(slots).to(self.device)))
        meta.set_group_views(views, self.layer_group)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], out: RunnerOutput) -> None:
        """One row per request; an n > 1 parent's first row is also sampled for its children."""
        rows: list[int] = []
        sreqs: list[SampleRequest] = []
        owners: list[Request] = []
        for i, req in enumerate(reqs):
            group = [req]
            if req.num_output_tokens == 0 and getattr(req, "children", None):
                group += req.children
            for r in group:
                rows.append(i)
                sreqs.append(SampleRequest(r.sampling_params, r.generator, r))
                owners.append(r)
        if not rows:
            return
        # Without n > 1 children every row is sampled once, in order: no copy of the logits.
        logits = logits if len(rows) == logits.shape[0] else logits[rows]
        bitmask = self.masks.fill(owners)  # structured outputs: one packed mask per step
        tokens, logprobs = sample(logits, sreqs, self.generator, bitmask)
        for r, t, lp in zip(owners, tokens, logprobs):
            out.sampled[r.request_id] = t
            out.logprobs[r.request_id] = lp


def _logits_rows(inp: StepInputs) -> list[int]:
    """Hidden rows that need logits: the sampled ones, then each prompt-logprobs run."""
    rows = list(inp.sample_rows)
    for _, first, count, _ in inp.prompt_rows:
        rows.extend(range(first, first + count))
    return rows
