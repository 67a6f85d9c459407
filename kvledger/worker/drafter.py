"""Draft-model speculation inside the runner (``speculative_config`` method ``draft_model``).

The draft is a smaller model with the target's vocabulary. Its KV lives in the same blocks as
the target's (vLLM v1's layout for draft models: the draft's layers join the KV cache spec and
share the target's block tables and slot mapping): a second pool of tensors indexed by the same
block ids, so every block the cache manager hands out holds the target's and the draft's KV for
the same token slots and ``bytes_per_block`` counts both. Nothing allocates or frees a draft
block on its own, so a rollback, a preemption or a free is one operation for both models.

The scheduler reserves a speculating request's ``1 + k`` slots with placeholder drafts; at the
start of the step the drafter fills them: one forward over the tokens the draft's cache lacks
(the bonus token, a fully accepted draft's last token, or the whole context the first time),
then ``k - 1`` one-token forwards, each writing its K/V into the slots the target verifies in
the same step. ``computed[rid]`` is how many leading positions hold the draft's KV; it is cut
back to the verified tokens when the step's verification is known and to the target's
``num_computed_tokens`` at every step (a rejected draft's slots are gone with the target's),
and dropped when a request is preempted (a swap moves the target's KV only,
a recompute starts again). Whatever the draft holds only changes which tokens are proposed; the
target's verification decides every emitted token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvledger.spec_decode.speculator import DRAFT_PLACEHOLDER

if TYPE_CHECKING:
    from kvledger.core.sched_output import SchedulerOutput
    from kvledger.storage.kv_cache import KVCachePool
    from kvledger.worker.model_runner import ModelRunner


class Drafter:
    def __init__(self, model: torch.nn.Module, pool: KVCachePool) -> None:
        self.model = model
        self.pool = pool
        self.computed: dict[str, int] = {}  # request id -> positions holding the draft's KV
        self.num_forwards = 0  # draft forward passes run (tests and benchmarks read it)
        self._proposed: dict[str, int] = {}  # this step's speculating requests: their start

    def sync(self, so: SchedulerOutput) -> None:
        """Forget what the step message says is gone, before anything runs."""
        computed = self.computed
        for rid in so.finished_req_ids:
            computed.pop(rid, None)
        for rid, _ in so.preempted:
            computed.pop(rid, None)
        for rid, c in zip(so.req_ids, so.num_computed_tokens):
            if computed.get(rid, 0) > c:  # slots past the verified tokens were rolled back
                computed[rid] = c

    @staticmethod
    def wanted(so: SchedulerOutput) -> bool:
        spec = so.spec_token_ids
        return bool(spec) and any(d and d[0] == DRAFT_PLACEHOLDER for d in spec.values())

    @torch.inference_mode()
    def propose(self, runner: ModelRunner, so: SchedulerOutput) -> dict[str, list[int]]:
        """The drafts for every placeholder in the step: greedy, k forwards of the draft."""
        spec = so.spec_token_ids
        starts = dict(zip(so.req_ids, so.num_computed_tokens))
        rids = [rid for rid, d in spec.items() if d and d[0] == DRAFT_PLACEHOLDER]
        k = [len(spec[rid]) for rid in rids]
        c = [starts[rid] for rid in rids]  # each one's last token sits at position c
        states = [runner.requests[rid] for rid in rids]
        first = [min(self.computed.get(rid, 0), ci) for rid, ci in zip(rids, c)]
        # Round 0: every token the draft has not seen, up to the last one.
        ids = [t for st, f, ci in zip(states, first, c) for t in st.all_token_ids[f : ci + 1]]
        tokens = self._forward(runner, rids, ids, [ci + 1 - f for f, ci in zip(first, c)], first)
        drafts = [[t] for t in tokens]
        # Rounds 1..k-1: the last draft at its position, for the requests that want more.
        for j in range(1, max(k)):
            live = [i for i in range(len(rids)) if k[i] > j]
            tokens = self._forward(
                runner,
                [rids[i] for i in live],
                [drafts[i][-1] for i in live],
                [1] * len(live),
                [c[i] + j for i in live],
            )
            for i, t in zip(live, tokens):
                drafts[i].append(t)
        for rid, ci, ki in zip(rids, c, k):
            self.computed[rid] = ci + ki  # positions c .. c + k - 1 were written
        self._proposed = dict(zip(rids, c))
        return dict(zip(rids, drafts))

    def verified(self, accepted: dict[str, list[int]]) -> None:
        """The step's verification: the draft's KV past the accepted drafts is rolled back
        with the target's (its slots are the target's, released by the scheduler now)."""
        for rid, c in self._proposed.items():
            n = c + 1 + len(accepted.get(rid, ()))
            if self.computed.get(rid, 0) > n:
                self.computed[rid] = n
        self._proposed = {}

    def _forward(
        self,
        runner: ModelRunner,
        rids: list[str],
        input_ids: list[int],
        query_lens: list[int],
        starts: list[int],
    ) -> list[int]:
        """One draft forward over the requests' rows; the argmax after each one's last row."""
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        rows = runner.block_table.rows(rids)
        decode_only = max(query_lens) == 1
        meta, positions = runner._build_metadata(
            query_lens, seq_lens, starts, rows, runner.block_size, decode_only
        )
        dev = runner.device
        ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(dev)
        hidden = self.model(ids, positions, meta, self.pool.layers)
        last = np.cumsum(query_lens) - 1
        logits = self.model.compute_logits(hidden[torch.from_numpy(last).to(dev)])
        self.num_forwards += 1
        return logits.argmax(dim=-1).tolist()
