"""The runner computes: one scheduler step -> flat tensors -> one forward pass -> samples.

It carries out the block copies the scheduler asked for (swap-out, then copy-on-write, then
swap-in, so that a block freed by a swap-out is read before anything reuses it), builds the
step's positions / slot mapping / block tables, runs the model once for all prefill chunks
and decodes together, and samples the requests whose next token is due.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.core.request import Logprob, Request
from kvledger.core.scheduler import SchedulerOutput
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.kv_cache import HostKVPool, KVCachePool
from kvledger.model.sampler import SampleRequest, make_logprob, sample


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprob | None] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    swap_out_seconds: float = 0.0
    swap_in_seconds: float = 0.0


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVCachePool,
        host_pool: HostKVPool | None,
        kv: KVCacheManager,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.generator = torch.Generator().manual_seed(seed)

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

    # -- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        self.apply_block_ops(so, out)
        if not so.scheduled:
            return out
        bs = self.block_size
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # flat row of the last token for requests due a sample
        sample_reqs: list[Request] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (req, flat row, count, start)
        row = 0
        for s in so.scheduled:
            req = s.request
            start, n = req.num_computed_tokens, s.num_new_tokens
            input_ids.extend(req.all_token_ids[start : start + n])
            query_lens.append(n)
            seq_lens.append(start + n)
            starts.append(start)
            tables.append(self.kv.block_table(req.request_id))
            if start + n == req.num_tokens:
                sample_rows.append(row + n - 1)
                sample_reqs.append(req)
            if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0:
                # Row p predicts prompt token p + 1.
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append((req, row, last - start, start))
            row += n

        meta, positions = self._build_metadata(query_lens, seq_lens, starts, tables, bs)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, meta, self.kv_pool.layers)

        rows = list(sample_rows)
        for _, first, count, _ in prompt_rows:
            rows.extend(range(first, first + count))
        if not rows:
            return out
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[idx]).float().cpu()
        self._sample(logits[: len(sample_rows)], sample_reqs, out)
        off = len(sample_rows)
        for req, _, count, start in prompt_rows:
            lp = logits[off : off + count].log_softmax(dim=-1)
            off += count
            targets = req.all_token_ids[start + 1 : start + 1 + count]
            k = req.sampling_params.prompt_logprobs
            out.prompt_logprobs[req.request_id] = [
                make_logprob(lp[j], t, k) for j, t in enumerate(targets)
            ]
        return out

    def _build_metadata(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        starts: list[int],
        tables: list[list[int]],
        bs: int,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long
        )
        ql = torch.tensor(query_lens, dtype=torch.long)
        req_idx = torch.repeat_interleave(torch.arange(len(query_lens)), ql)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        torch.cumsum(ql, 0, out=qsl[1:])
        positions = torch.arange(int(qsl[-1])) - qsl[:-1][req_idx] + torch.tensor(starts)[req_idx]
        slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=block_tables.to(dev),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        return meta, positions.to(dev)

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
                sreqs.append(SampleRequest(r.sampling_params, r.generator))
                owners.append(r)
        if not rows:
            return
        tokens, logprobs = sample(logits[rows], sreqs, self.generator)
        for r, t, lp in zip(owners, tokens, logprobs):
            out.sampled[r.request_id] = t
            out.logprobs[r.request_id] = lp
