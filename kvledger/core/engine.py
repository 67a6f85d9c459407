"""step(): schedule -> execute -> update -> outputs. The one loop every front end drives.

The engine is assembled by ``kvledger.engine.builder.build_engine`` and receives its parts
finished: the scheduler (with its block manager and cost model), the executor (the in-process
worker, or tensor-parallel ranks), the tokenizer and the model's facts. It owns the user
requests (groups of sequences), the grammar compiles, KV events and the output processing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvledger.cache.kv_events import make_batch, make_publisher
from kvledger.config import EngineConfig
from kvledger.core.input_processor import InputProcessor
from kvledger.core.output_processor import OutputProcessor, RequestGroup
from kvledger.core.request import Request, RequestStatus
from kvledger.core.sched_output import SchedulerOutput
from kvledger.core.scheduler import Scheduler
from kvledger.core.step_trace import StepTrace
from kvledger.errors import EngineFailedError, InvalidRequestError
from kvledger.ledger.live import SwapStats, live_ledger
from kvledger.ledger.snapshot import LedgerSnapshot
from kvledger.outputs import RequestOutput
from kvledger.pooling import requests as pooling
from kvledger.pooling.config import PoolerConfig, load_pooler_config
from kvledger.pooling.params import PoolingParams
from kvledger.sampling_params import SamplingParams
from kvledger.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from kvledger.engine.builder import ModelFacts
    from kvledger.executor.base import Executor
    from kvledger.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("kvledger")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        facts: ModelFacts,
        scheduler: Scheduler,
        executor: Executor,
        tokenizer: Any,
    ) -> None:
        self.config = config
        self.facts = facts
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.cost_model = scheduler.cost_model
        self.executor = executor
        self.tokenizer = tokenizer
        self.device = config.device
        self.tp = config.tensor_parallel_size
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.eos_token_ids = facts.eos_token_ids
        self.bytes_per_token = facts.bytes_per_token
        self.calibration = facts.calibration
        self.inputs = InputProcessor(
            tokenizer, facts.vocab_size, facts.eos_token_ids, facts.max_model_len,
            config.max_logprobs, scheduler.check_prompt,
        )  # fmt: skip
        self.outputs = OutputProcessor(tokenizer)
        self.structured = StructuredOutputManager(
            tokenizer, facts.vocab_size, facts.eos_token_ids, config.structured_outputs_backend
        )
        self.default_sampling_params = facts.default_sampling_params
        # runner='pooling': the model embeds (kvledger/pooling); None: it generates.
        self.pooler_config: PoolerConfig | None = None
        if config.runner == "pooling":
            self.pooler_config = load_pooler_config(config.model, facts.hf_config, config.pooler_config)
        else:
            pooling.check_generates(facts.hf_config)
        self.groups: dict[str, RequestGroup] = {}
        self._counter = itertools.count()
        self.swaps = SwapStats()
        self.num_generated_tokens = 0
        self.stream_outputs = False  # True: step() reports every updated request (servers)
        self.step_trace = StepTrace.from_env()  # KVLEDGER_STEP_TRACE: a line per step
        # Called with each step's SchedulerOutput before the model runs (requests' computed
        # counts are still the step's start): the simulator's calibration reads steps here.
        self.schedule_observers: list[Callable[[SchedulerOutput], None]] = []
        # KV events: recorded by the pool where its prefix index changes, published per step.
        self.kv_event_publisher = make_publisher(config.kv_events_config, config.data_parallel_rank)
        if self.kv_event_publisher is not None:
            self.kv.pool.enable_events()
            if self.kv.tiers is not None:
                self.kv.tiers.events = []
        self._publish_kv_events()

    # -- facts the front ends read ------------------------------------------------------------
    @property
    def model_dtype(self):
        return self.facts.dtype

    @property
    def hf_config(self) -> dict:
        return self.facts.hf_config

    @property
    def spec(self):
        return self.facts.spec

    @property
    def kv_layout(self):
        return self.facts.kv_layout

    def _publish_kv_events(self) -> None:
        """Hand the pool's events since the last call to the publisher (its thread sends)."""
        if self.kv_event_publisher is not None:
            events = self.kv.pool.take_events()
            if self.kv.tiers is not None and self.kv.tiers.events:  # medium CPU / DISK
                events, self.kv.tiers.events = events + self.kv.tiers.events, []
            if events:
                self.kv_event_publisher.publish(make_batch(events))

    def shutdown(self) -> None:
        """Flush and close the KV-event publisher (its sockets free their ports); stop the
        workers."""
        self._close_kv_tiers()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        self.executor.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()
            self.step_trace = None

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def validate_prompt(self, token_ids: list[int]) -> None:
        self.inputs.validate_prompt(token_ids)

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        if pooling.resolve(self.pooler_config, params) is None:
            self.inputs.check_params(params)  # type: ignore[arg-type]

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        params = params or (PoolingParams() if self.pooler_config is not None else SamplingParams())
        pooling_params = pooling.resolve(self.pooler_config, params)
        if pooling_params is not None:  # prefill only: pooled, never sampled (pooling/requests.py)
            params = pooling.PREFILL_ONLY
        self.inputs.check_params(params)
        if params.structured_outputs is not None:
            self.structured.resolve(params.structured_outputs)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.inputs.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.inputs.validate_prompt(token_ids)
        rid = request_id if request_id is not None else str(next(self._counter))
        if rid in self.groups:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = self.inputs.make_sequences(rid, token_ids, params, arrival, priority, cache_salt)
        seqs[0].pooling_params = pooling_params
        self.groups[rid] = RequestGroup(rid, text, seqs)
        if params.structured_outputs is not None and not self.structured.submit(seqs[0]):
            return rid  # it joins the scheduler when its grammar is compiled
        self.scheduler.add_request(seqs[0])
        return rid

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if seq.is_finished:
                continue
            if seq.status is RequestStatus.WAITING and seq.request_id not in self.scheduler.requests:
                self.structured.discard(seq)  # an unforked child, or still compiling
            self.scheduler.finish_request(seq, "abort")
        self._flush_finished()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def make_output(self, group: RequestGroup) -> RequestOutput:
        return self.outputs.make_output(group)

    def reset_prefix_cache(self, *, reset_connector: bool = False) -> bool:
        """Forget every cached prefix block (vLLM's name): the device pool's and the host tier's
        (on a CPU server the host tier is more of the same memory, and vLLM's reset clears its
        CPU offload cache too). The disk tier is kept (it is what survives restarts) unless
        ``reset_connector`` (vLLM's flag for the connector's cache): then this model's block
        files and index are deleted. Refused (False, with a warning saying why) while requests
        hold blocks: their blocks may be shared prefixes."""
        if self.has_unfinished_requests() or self.kv.num_used_blocks:
            logger.warning(
                "reset_prefix_cache refused: %d unfinished request(s) hold %d KV blocks; "
                "call it again once they finish (or abort them)",
                len(self.groups),
                self.kv.num_used_blocks,
            )
            return False
        dropped = self.kv.pool.reset_prefix_cache()
        tiers = self.kv.tiers
        if tiers is None:
            logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        else:
            host, disk = tiers.reset(disk=reset_connector)
            logger.info("prefix cache reset: %d cached blocks dropped, %d from the host tier, %d "
                        "from the disk tier%s", dropped, host, disk,
                        "" if reset_connector else " (kept: reset_connector=True deletes them)")  # fmt: skip
            if disk:  # the files go now, and the index with them
                stores, _, deletes = tiers.take_ops()
                so = SchedulerOutput(step=self.scheduler.step, kv_stores=stores, kv_deletes=deletes)
                ro = self.executor.execute_model(so)
                if ro.kv_tiers is not None:
                    tiers.on_report(ro.kv_tiers)
                tiers.save_index()
        self._publish_kv_events()
        return True

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: set[str] = set()
        if self.structured.compiling:
            self._admit_compiled(touched)
        so = self.scheduler.schedule()
        for observe in self.schedule_observers:
            observe(so)
        so.grammar_bitmask = self.structured.grammar_bitmask(so, self.scheduler.requests)
        trace = self.step_trace is not None and so.req_ids
        if trace:
            composition, start = StepTrace.composition(so, self.scheduler.requests), time.monotonic()
        ro = self._execute(so)
        if ro.kv_tiers is not None:  # loads done: those requests run from the next step
            self.scheduler.on_tier_report(ro.kv_tiers)
        self._account_swaps(so, ro)
        now = time.monotonic()
        for rid, vec in ro.pooler_output.items():  # pooling requests: their prompt is done
            self.scheduler.requests[rid].pooled = vec
            touched.add(rid)
        for rid, lps in ro.prompt_logprobs.items():
            for d in lps:
                self.outputs.decode_logprobs(d)
            self.scheduler.requests[rid].prompt_logprobs.extend(lps)
        for rid, drafts in ro.draft_token_ids.items():  # a draft model's, for the placeholders
            self.scheduler.requests[rid].spec_token_ids = drafts
        spec = ro.spec_token_ids
        for req in self.scheduler.update_from_output(
            so, ro.sampled, now, self._fork_children, spec
        ):
            rid = req.request_id
            if spec and rid in spec:  # accepted drafts, then the token after them
                lps = [*ro.spec_logprobs[rid], ro.logprobs.get(rid)][: req.num_new_tokens]
                stop_str = self.outputs.process_tokens(req, lps)
                self.num_generated_tokens += req.num_new_tokens
            else:
                self.num_generated_tokens += 1
                stop_str = self.outputs.process_token(req, ro.logprobs.get(rid))
            if stop_str is not None:
                self._stop(req, stop_str, now)
            touched.add(req.parent_id or req.request_id)
        for rid in so.ended:
            touched.add(self._group_of(rid))
        self._flush_finished()
        self._publish_kv_events()
        outputs = self.outputs.collect(self.groups, touched, self.stream_outputs)
        if trace:
            self.step_trace.record(start, time.monotonic(), composition, not self.has_unfinished_requests())
        return outputs

    def _close_kv_tiers(self) -> None:
        """A graceful shutdown writes the device's cached blocks that are on no disk yet, waits
        for every write and saves the disk index, so a restart starts warm."""
        tiers = self.kv.tiers
        if tiers is None or self.executor.dead is not None or getattr(self, "_tiers_closed", False):
            return
        self._tiers_closed = True
        tiers.store_all(self.kv.pool.indexed_blocks())
        stores, _, deletes = tiers.take_ops()
        so = SchedulerOutput(step=self.scheduler.step, kv_stores=stores, kv_deletes=deletes)
        for ro in (self.executor.execute_model(so), None):
            rep = ro.kv_tiers if ro is not None else self.executor.flush_kv_tiers()
            if rep is not None:
                tiers.on_report(rep)
        tiers.save_index()

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.executor.execute_model(so)
        except Exception as e:
            if self.executor.dead is not None:
                # A rank died or hung: no request can go on. Free them all, then say why.
                for rid in list(self.groups):
                    self.abort_request(rid)
                raise EngineFailedError(f"tensor-parallel engine failed: {e}") from e
            raise

    def _flush_finished(self) -> None:
        """With nothing left to run, tell the workers now which requests finished (a busy
        engine's next step carries them), so an idle server keeps nothing of them."""
        if self.scheduler.has_unfinished() or self.executor.dead is not None:
            return
        so = self.scheduler.take_finished_ids()
        if so is not None:
            self.executor.execute_model(so)

    def _group_of(self, seq_id: str) -> str:
        """The user request a sequence belongs to (a rare lookup: sequences the scheduler
        ended itself)."""
        if seq_id in self.groups:
            return seq_id
        return next((g for g, grp in self.groups.items() if any(s.request_id == seq_id for s in grp.seqs)), seq_id)

    def _stop(self, req: Request, stop_str: str, now: float) -> None:
        """The token completed a stop string: it names the finish reason."""
        req.stop_reason = stop_str
        if req.is_finished:  # it also hit its length
            req.finish_reason = "stop"
        else:
            self.scheduler.finish_request(req, "stop")
            req.finished_time = now

    def _fork_children(self, req: Request) -> list[Request]:
        """n > 1: the parent's prompt is computed; its children share its blocks from now on."""
        children, req.children = req.children, []
        forked = []
        for child in children:
            if child.is_finished:
                continue
            self.kv.fork(req.request_id, child.request_id)
            child.num_computed_tokens = req.num_computed_tokens
            child.num_cached_tokens = req.num_cached_tokens
            child.rope_long = req.rope_long
            child.prompt_logprobs = req.prompt_logprobs
            child.first_scheduled_time = req.first_scheduled_time
            self.scheduler.add_forked(child)
            forked.append(child)
        return forked

    def _admit_compiled(self, touched: set[str]) -> None:
        """Requests whose grammar finished compiling join the scheduler's waiting queue."""
        if not self.scheduler.has_unfinished():
            self.structured.wait(0.005)  # nothing else to run: do not spin
        ready, failed = self.structured.take_ready()
        for req in ready:
            self.scheduler.add_request(req)
        for req, err in failed:
            logger.error("request %s: grammar compilation failed: %s", req.request_id, err)
            for seq in [req, *req.children]:
                seq.status = RequestStatus.FINISHED
                seq.finish_reason = "abort"
            touched.add(req.request_id)

    def _account_swaps(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> None:
        st = self.swaps
        st.out_blocks += len(so.blocks_to_swap_out)
        st.in_blocks += len(so.blocks_to_swap_in)
        st.out_s += ro.swap_out_seconds
        st.in_s += ro.swap_in_seconds

    # -- the ledger -----------------------------------------------------------------------------
    def ledger(self) -> LedgerSnapshot:
        return live_ledger(
            self.kv,
            self.executor,
            kv_cache_dtype=self.config.cache.kv_cache_dtype,
            scale_bytes_per_token=self.facts.scale_bytes_per_token,
            overlay_bytes_per_request=self.facts.overlay_bytes_per_request,
            device=str(self.device),
            preemptions=self.scheduler.num_preemptions,
            swaps=self.swaps,
            gpu_memory_utilization=self.config.cache.gpu_memory_utilization,
            memory_profile=self.facts.memory_profile,
            speculation=self._speculation_row(),
        )

    def _speculation_row(self) -> dict | None:
        spec = self.scheduler.speculator
        if spec is None:
            return None
        row = spec.stats.ledger_row(self.kv.bytes_per_token, self.kv.bytes_per_block)
        draft = self.facts.draft_bytes_per_token
        if draft:  # the draft model's KV: its share of every block (worker/drafter.py)
            block = draft * self.kv.block_size
            row["draft_model"] = {
                "model": str(self.config.speculative_config.model),
                "kv_bytes_per_token": draft,
                "kv_bytes_per_block": block,
                "used_kv_bytes": self.kv.num_used_blocks * block,
                "total_kv_bytes": self.kv.pool.num_blocks * block,
                "weight_bytes": self.executor.ranks[0].draft_weight_bytes,
                "num_forwards": self.executor.stats().draft_forwards,
            }
        return row
