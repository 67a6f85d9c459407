"""step(): schedule -> execute -> sample -> update. The one loop every front end drives."""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from kvledger.cache.attention_policy import cdiv
from kvledger.cache.kv_events import make_batch, make_publisher
from kvledger.config import EngineConfig
from kvledger.core.detokenizer import IncrementalDetokenizer
from kvledger.core.preemption import PreemptionCostModel
from kvledger.core.request import Request, RequestStatus
from kvledger.core.scheduler import Scheduler, SchedulerOutput
from kvledger.core.step_trace import StepTrace
from kvledger.errors import ConfigError, EngineFailedError, InvalidRequestError
from kvledger.ledger.accounting import (
    QUANTIZED_KV_DTYPES,
    ModelSpec,
    kv_bytes_per_token,
    per_request_overhead_bytes,
)
from kvledger.ledger.kv_cache_groups import kv_cache_layout
from kvledger.ledger.snapshot import LedgerSnapshot
from kvledger.logprobs import Logprob
from kvledger.model.layers import warm_up_gemm_shapes
from kvledger.model.loader import load_model, load_tokenizer
from kvledger.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvledger.sampling_params import RequestOutputKind, SamplingParams
from kvledger.storage import host_memory
from kvledger.storage.kv_cache import HostKVPool, KVCachePool
from kvledger.storage.kv_overlay import SINK_CACHE_ENTRIES
from kvledger.structured.manager import StructuredOutputManager
from kvledger.worker.model_runner import ModelRunner, RunnerOutput

logger = logging.getLogger("kvledger")

_GiB = 1 << 30
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class _Group:
    """A user request: one sequence, or n > 1 forked sequences sharing a prompt."""

    request_id: str
    prompt: str | None
    seqs: list[Request]
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":  # steps reuse their activation memory, not re-fault it
            host_memory.keep_freed_memory()
        # The tokenizer loads (transformers import included) in a thread while the weights
        # load and the pools are sized; it is joined before the cost model calibrates.
        self._tokenizer_job = ThreadPoolExecutor(1, thread_name_prefix="kvledger-tok").submit(
            _maybe_tokenizer, config.tokenizer or config.model
        )
        self._free_at_start = (
            torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        )
        from kvledger.model.attention.triton_backend import resolve_attention_backend

        # Resolved before the weights load, so a bad choice fails fast with its reason.
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        self.tp = config.tensor_parallel_size
        # Tensor parallelism: this process is the driver and loads no weights (the ranks do).
        loaded = load_model(
            config.model, dtype=config.dtype, device=config.device, weights=self.tp == 1
        )
        self.model = loaded.model
        if self.attention_backend == "triton":
            from kvledger.model.attention.triton_backend import TritonAttentionBackend

            self.model.attn_backend = TritonAttentionBackend()
        self.model_dtype = loaded.dtype
        self.hf_config = loaded.hf_config
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size = loaded.config.vocab_size
        sc, cc = config.scheduler, config.cache
        if sc.max_model_len is None:
            sc.max_model_len = loaded.max_model_len
        elif sc.max_model_len > loaded.max_model_len:
            raise ConfigError(
                f"max_model_len {sc.max_model_len} exceeds the model's context of "
                f"{loaded.max_model_len} tokens"
            )
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < sc.max_model_len:
            raise ConfigError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off"
            )
        self.max_model_len = sc.max_model_len

        self.spec = ModelSpec.from_hf_config(self.hf_config, name=str(config.model))
        kv_dtype = _plan_kv_dtype(cc.kv_cache_dtype, self.model_dtype)
        mc = loaded.config
        if kv_dtype in QUANTIZED_KV_DTYPES and (mc.layer_types or mc.attn_softcap):
            raise ConfigError(
                f"kv_cache_dtype {cc.kv_cache_dtype} is not supported for {mc.architecture} with "
                "sliding-window or soft-capped attention; use kv_cache_dtype auto"
            )
        if self.tp > 1:
            from kvledger.distributed.sharding import check_tensor_parallel, tp_mlp_widths

            check_tensor_parallel(self.spec, self.tp, *tp_mlp_widths(mc))
            _check_devices(self.tp, self.device, config.distributed_executor_backend or "mp")
        # Per rank under tensor parallelism: each rank's pool holds its own KV heads.
        kv_bytes = kv_bytes_per_token(self.spec, kv_dtype, self.tp)
        self.bytes_per_token = kv_bytes.total  # K/V data + quantisation scales
        # Hybrid models (full + sliding layers): KV cache groups over one pool whose block holds
        # group_size layers, so the sliding groups can free blocks outside their window.
        windows = self.spec.layer_windows
        if sc.disable_hybrid_kv_cache_manager and self.spec.uniform_window is None:
            windows = [None] * len(windows)  # every layer allocated as full attention (vLLM's)
        self.kv_layout = kv_cache_layout(windows)
        if self.kv_layout.is_hybrid:  # (under TP each rank's pool holds its heads of them)
            self.bytes_per_token = kv_bytes.total // self.spec.num_layers * self.kv_layout.group_size
        self.scale_bytes_per_token = kv_bytes.scale_bytes
        bytes_per_block = self.bytes_per_token * cc.block_size
        overlay_slots, reserved = self._plan_overlay(kv_dtype)
        num_blocks = cc.num_kv_blocks or self._size_pool(bytes_per_block, reserved)
        if self.tp > 1:
            self._init_tensor_parallel(num_blocks, bytes_per_block, overlay_slots)
            return
        self.kv_pool = KVCachePool(
            num_layers=self.kv_layout.group_size,
            num_blocks=num_blocks,
            block_size=cc.block_size,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim,
            dtype=self.model_dtype,
            device=self.device,
            kv_cache_dtype=cc.kv_cache_dtype,
            sink_tokens=cc.kv_sink_tokens,
            recent_tokens=cc.kv_recent_tokens,
            overlay_slots=overlay_slots,
        )
        # The ledger's formula and the real allocation must agree.
        assert self.kv_pool.bytes_per_block == bytes_per_block, (self.kv_pool.bytes_per_block, bytes_per_block)
        self._build_scheduler(num_blocks)
        num_host_blocks = self.kv.host_pool.num_blocks if self.kv.host_pool else 0
        self.host_pool = HostKVPool(num_host_blocks, self.kv_pool) if num_host_blocks else None
        self.runner = ModelRunner(
            self.model, self.kv_pool, self.host_pool, cc.block_size, self.device, seed=config.seed
        )
        # LongRoPE: the table is chosen by the sequence's length, crossing it recomputes.
        rope = getattr(self.model, "rotary_emb", None)
        self.scheduler.rope_long_from = self.runner.rope_long_from = getattr(rope, "long_from", None)
        if self.kv_layout.is_hybrid:
            self.runner.layer_group = self.kv_layout.layer_group
            self.runner.layer_caches = [self.kv_pool.layers[j] for j in self.kv_layout.layer_slot]
        if config.populate_kv_cache and self.device.type == "cpu":
            t0 = time.perf_counter()
            self.kv_pool.populate()
            logger.info(
                "KV pool mapped at start-up: %.2f GiB in %.2f s",
                self.kv_pool.num_bytes / 2**30, time.perf_counter() - t0,
            )
        if config.warm_up_gemm_shapes and self.device.type == "cpu":
            t0 = time.perf_counter()
            done, total = warm_up_gemm_shapes(self.model, sc.max_num_batched_tokens, sc.max_num_seqs)
            logger.info(
                "oneDNN GEMM shapes created at start-up: %d of %d in %.2f s",
                done, total, time.perf_counter() - t0,
            )
        if (
            not self.kv_layout.is_hybrid
            and self.device.type == "cuda"
            and self.attention_backend == "triton"
            and not config.enforce_eager
            and self.kv_pool.overlay is None
        ):
            from kvledger.worker.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(
                self.model,
                self.kv_pool.layers,
                sc.max_num_seqs,
                self.max_model_len,
                cc.block_size,
                self.spec.num_kv_heads,
                self.device,
            )
        self._finish_init()

    def _build_scheduler(self, num_blocks: int) -> None:
        sc, cc = self.config.scheduler, self.config.cache
        self.cost_model = PreemptionCostModel(
            mode=sc.preemption_mode, recompute_threshold=sc.recompute_threshold
        )
        self.scheduler = Scheduler.build(
            sc,
            cc,
            num_blocks,
            self.bytes_per_token,
            self.cost_model,
            self.kv_layout.windows,
        )
        self.kv = self.scheduler.kv
        self.executor = None
        self.tp_ranks: list = []  # WorkerReady of each rank (tensor parallelism)

    def _init_tensor_parallel(self, num_blocks: int, bytes_per_block: int, overlay_slots: int) -> None:
        """Start the ranks (kvledger.distributed): each loads its shard and builds its pools of
        ``num_blocks`` blocks for its own KV heads; the scheduler and block manager stay here."""
        from kvledger.executor.messages import WorkerSpec
        from kvledger.executor.tp_executor import TPExecutor

        config, cc = self.config, self.config.cache
        self._build_scheduler(num_blocks)
        self.kv_pool = None
        self.host_pool = None
        backend = config.distributed_executor_backend or "mp"
        threads = config.tp_worker_threads or max(1, _num_cpus() // self.tp)
        spec = WorkerSpec(
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            max_model_len=self.max_model_len,
            block_size=cc.block_size,
            num_blocks=num_blocks,
            num_host_blocks=self.kv.host_pool.num_blocks if self.kv.host_pool else 0,
            kv_cache_dtype=cc.kv_cache_dtype,
            kv_sink_tokens=cc.kv_sink_tokens,
            kv_recent_tokens=cc.kv_recent_tokens,
            overlay_slots=overlay_slots,
            attention_backend=self.attention_backend,
            num_threads=threads,
            dist_backend="nccl" if self.device.type == "cuda" else "gloo",
            collective_timeout_s=config.tp_step_timeout,
        )
        if self.kv_layout.is_hybrid:  # KV cache groups: a block holds group_size layers
            spec.layer_group = self.kv_layout.layer_group
            spec.layer_slot = self.kv_layout.layer_slot
        if config.warm_up_gemm_shapes:  # each rank creates its own shards' GEMM shapes
            sc = config.scheduler
            spec.warm_up_gemm_rows = (sc.max_num_batched_tokens, sc.max_num_seqs)
        spec.populate_kv_cache = config.populate_kv_cache
        self.executor = TPExecutor(
            spec, self.tp, backend, config.tp_driver_address, step_timeout_s=config.tp_step_timeout
        )
        self._executor_finalizer = weakref.finalize(self, self.executor.close)
        self.tp_ranks = self.executor.ready
        if spec.warm_up_gemm_rows is not None:
            logger.info("oneDNN GEMM shapes created at start-up per rank: %s",
                        [r.gemm_shapes_warmed for r in self.tp_ranks])
        # Every rank's real pool must hold exactly what `kvledger plan --tp N` says per block.
        for r in self.tp_ranks:
            if r.bytes_per_block != bytes_per_block:
                self.executor.close()
                raise AssertionError(
                    f"rank {r.rank}'s pool holds {r.bytes_per_block} bytes per block; the ledger "
                    f"(kvledger plan --tp {self.tp}) says {bytes_per_block}"
                )
        self.runner = ModelRunner(None, None, None, cc.block_size, self.device, seed=config.seed)
        self.runner.executor = self.executor
        if self.kv_layout.is_hybrid:  # each group's tables and slots travel in the StepPlan
            self.runner.layer_group = self.kv_layout.layer_group
        if overlay_slots:  # quantised KV's overlay: bookkeeping here, rows on the ranks
            from kvledger.distributed.overlay_proxy import RemoteOverlayPool
            from kvledger.storage.kv_overlay import OverlaySlots

            row = self.tp_ranks[0].overlay_bytes_per_row
            self.runner.overlay = OverlaySlots(
                RemoteOverlayPool(cc.kv_sink_tokens, cc.kv_recent_tokens, overlay_slots, row)
            )
        rope = getattr(self.model, "rotary_emb", None)  # LongRoPE, as on one device
        self.scheduler.rope_long_from = self.runner.rope_long_from = getattr(rope, "long_from", None)
        self._finish_init()

    def _finish_init(self) -> None:
        config, sc = self.config, self.config.scheduler
        # KV events: recorded by the pool where its prefix index changes, published per step.
        self.kv_event_publisher = make_publisher(config.kv_events_config, config.data_parallel_rank)
        if self.kv_event_publisher is not None:
            self.kv.pool.enable_events()
        if config.swap_bandwidth:
            self.cost_model.swap_bandwidth = config.swap_bandwidth
        if config.prefill_cost:
            self.cost_model.prefill_coeffs = tuple(config.prefill_cost)
        self.calibration: dict | None = None
        # The calibration times real work: it must not share the CPU (and the GIL) with the
        # tokenizer's imports, which skewed it 5-30x when both ran at once.
        self.tokenizer = self._tokenizer_job.result()  # raises the tokenizer's error, if any
        if (
            config.calibrate_preemption
            and sc.preemption_mode == "auto"
            and sc.recompute_threshold is None
            and not (config.swap_bandwidth and config.prefill_cost)
        ):
            from kvledger.core.calibration import calibrate_cost_model

            calibrate_cost_model(self)
        self.default_sampling_params = _generation_defaults(config.model, config.generation_config)
        if self.default_sampling_params:
            logger.info(
                "sampling defaults from the model's generation_config.json: %s "
                "(generation_config='vllm' ignores them)",
                self.default_sampling_params,
            )
        self.groups: dict[str, _Group] = {}
        self._counter = itertools.count()
        self.swap_stats = {"out_blocks": 0, "in_blocks": 0, "out_s": 0.0, "in_s": 0.0}
        self.num_generated_tokens = 0
        self.stream_outputs = False  # True: step() reports every updated request (servers)
        self.step_trace = StepTrace.from_env()  # KVLEDGER_STEP_TRACE: a line per step
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand the pool's events since the last call to the publisher (its thread sends)."""
        if self.kv_event_publisher is not None:
            events = self.kv.pool.take_events()
            if events:
                self.kv_event_publisher.publish(make_batch(events))

    def shutdown(self) -> None:
        """Flush and close the KV-event publisher (its sockets free their ports)."""
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        if self.executor is not None:
            self.executor.close()  # the tensor-parallel workers exit
        if self.step_trace is not None:
            self.step_trace.close()
            self.step_trace = None

    # -- sizing -------------------------------------------------------------------------------
    def _plan_overlay(self, kv_dtype: str) -> tuple[int, int]:
        """Quantised formats keep each running request's sinks and recent window in the model
        dtype (the overlay, max_num_seqs + headroom slots) and a small cache of sinks for prefix
        hits; both come out of the KV budget. Returns (overlay slots, bytes reserved)."""
        cc, sc = self.config.cache, self.config.scheduler
        model_spec = replace(self.spec, dtype=_TORCH_DTYPE_NAMES[self.model_dtype])
        per_request = per_request_overhead_bytes(
            model_spec, kv_dtype, cc.kv_sink_tokens, cc.kv_recent_tokens, self.tp
        )
        self.overlay_bytes_per_request = per_request
        if not per_request:
            return 0, 0
        slots = sc.max_num_seqs + max(4, sc.max_num_seqs // 8)
        sinks = per_request_overhead_bytes(model_spec, kv_dtype, cc.kv_sink_tokens, 0, self.tp)
        return slots, slots * per_request + SINK_CACHE_ENTRIES * sinks

    def _size_pool(self, bytes_per_block: int, reserved: int = 0) -> int:
        """Blocks from the memory budget less `reserved` bytes (the quantised formats' overlay),
        never more than max_num_seqs full contexts need."""
        cc, sc = self.config.cache, self.config.scheduler
        budget = cc.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                # vLLM's gpu_memory_utilization: weights + activations (from a profiling run
                # of the largest step) + KV within that share of the device.
                from kvledger.worker.gpu_memory import kv_cache_budget, profile

                free, _ = torch.cuda.mem_get_info(self.device)
                self.memory_profile = profile(self, self._free_at_start or free)
                budget = kv_cache_budget(self.memory_profile, cc.gpu_memory_utilization)
            else:
                # The ranks of a tensor-parallel engine share this machine's memory.
                budget = min(4 * _GiB, int(_mem_available() * 0.2)) // self.tp
        budget -= reserved
        # A hybrid model's request holds blocks in each KV cache group.
        useful = sc.max_num_seqs * cdiv(self.max_model_len, cc.block_size) * len(self.kv_layout.groups)
        num_blocks = min(budget // bytes_per_block, useful)
        if num_blocks < 1:
            raise ConfigError(
                f"KV memory budget of {budget} bytes holds no block of {bytes_per_block} bytes"
            )
        return num_blocks

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if self.tokenizer is None:
            raise InvalidRequestError("this model folder has no tokenizer; pass prompts as token ids")
        return self.tokenizer(prompt).input_ids

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            bad = next(t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size))
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        why = self.scheduler.check_prompt(len(token_ids))
        if why is not None:
            raise InvalidRequestError(why)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary, the
        logprob cap, and that bad_words have a tokenizer."""
        self.check_logprobs(params)
        v = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if not 0 <= t < v), None)
            if bad is not None:
                raise InvalidRequestError(f"{name} has token id {bad}, outside the vocabulary [0, {v})")
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer, and this model folder has none")

    def check_logprobs(self, params: SamplingParams) -> None:
        """Logprob counts within ``max_logprobs`` (-1: no cap); -1 asks for the whole vocabulary."""
        cap = self.config.max_logprobs
        for what, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is None:
                continue
            n = self.vocab_size if k == -1 else k
            if cap != -1 and n > cap:
                raise InvalidRequestError(
                    f"Requested {what} logprobs of {n}"
                    + (" (-1: the whole vocabulary)" if k == -1 else "")
                    + f", which is greater than max allowed: {cap} (max_logprobs)"
                )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        self.check_params(params)
        if params.structured_outputs is not None:
            self.structured.resolve(params.structured_outputs)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.validate_prompt(token_ids)
        rid = request_id if request_id is not None else str(next(self._counter))
        if rid in self.groups:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        parent = self._new_seq(rid, token_ids, params, arrival, priority, 0)
        children = [
            self._new_seq(f"{rid}#{i}", token_ids, params, arrival, priority, i)
            for i in range(1, params.n)
        ]
        parent.children = children
        for c in children:
            c.parent_id = rid
        bad_words = self._bad_words_token_ids(params.bad_words) if params.bad_words else None
        for seq in (parent, *children):
            seq.cache_salt = cache_salt
            seq.bad_words_token_ids = bad_words
        self.groups[rid] = _Group(rid, text, [parent, *children])
        if params.structured_outputs is not None and not self.structured.submit(parent):
            return rid  # it joins the scheduler when its grammar is compiled
        self.scheduler.add_request(parent)
        return rid

    def _new_seq(
        self, rid: str, token_ids: list[int], params: SamplingParams, arrival: float, prio: int, i: int
    ) -> Request:
        req = Request(
            request_id=rid,
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival,
            priority=prio,
            max_total_tokens=self.max_model_len,
            index=i,
        )
        req.detokenizer = IncrementalDetokenizer.new(self.tokenizer, token_ids, params)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed + 1_000_003 * i)
        return req

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word as tokenized at the start of the text and, if that gives
        another first token of the same length, after a space (mid-text)."""
        out: list[list[int]] = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return [ids for ids in out if ids]

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.is_finished:
                if seq.status is RequestStatus.WAITING and seq.request_id not in self.scheduler.requests:
                    self.structured.discard(seq)
                    seq.status = RequestStatus.FINISHED  # an unforked child, or compiling
                    seq.finish_reason = "abort"
                else:
                    self.scheduler.finish_request(seq, "abort")
        self.runner.release_finished()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name). Refused (False, with a warning
        saying why) while requests hold blocks: their blocks may be shared prefixes."""
        if self.has_unfinished_requests() or self.kv.num_used_blocks:
            logger.warning(
                "reset_prefix_cache refused: %d unfinished request(s) hold %d KV blocks; "
                "call it again once they finish (or abort them)",
                len(self.groups),
                self.kv.num_used_blocks,
            )
            return False
        dropped = self.kv.pool.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        self._publish_kv_events()
        return True

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: set[str] = set()
        if self.structured.compiling:
            self._admit_compiled(touched)
        so = self.scheduler.schedule()
        trace = self.step_trace is not None and so.scheduled
        if trace:
            composition, start = StepTrace.composition(so), time.monotonic()
        try:
            ro = self.runner.execute(so)
        except Exception as e:
            if self.executor is not None and self.executor.dead is not None:
                # A rank died or hung: no request can go on. Free them all, then say why.
                for rid in list(self.groups):
                    self.abort_request(rid)
                raise EngineFailedError(f"tensor-parallel engine failed: {e}") from e
            raise
        self._account_swaps(so, ro)
        now = time.monotonic()
        for rid, lps in ro.prompt_logprobs.items():
            for d in lps:
                self._decode_logprobs(d)
            self.scheduler.requests[rid].prompt_logprobs.extend(lps)
        for req in self.scheduler.update_from_output(so, ro.sampled, now, self._fork_children):
            self._process_token(req, ro, now)
            touched.add(req.parent_id or req.request_id)
        for req in so.finished:
            touched.add(req.parent_id or req.request_id)
        self.runner.release_finished()
        self._publish_kv_events()
        outputs = self._collect_outputs(touched)
        if trace:
            self.step_trace.record(start, time.monotonic(), composition, not self.has_unfinished_requests())
        return outputs

    def _fork_children(self, req: Request) -> list[Request]:
        """n > 1: the parent's prompt is computed; its children share its blocks from now on."""
        children, req.children = req.children, []
        forked = []
        for child in children:
            if child.is_finished:
                continue
            self.kv.fork(req.request_id, child.request_id)
            self.runner.fork_overlay(req, child)
            child.num_computed_tokens = req.num_computed_tokens
            child.num_cached_tokens = req.num_cached_tokens
            child.rope_long = req.rope_long
            child.prompt_logprobs = req.prompt_logprobs
            child.first_scheduled_time = req.first_scheduled_time
            self.scheduler.add_forked(child)
            forked.append(child)
        return forked

    def _process_token(self, req: Request, ro: RunnerOutput, now: float) -> None:
        """What the new token needs beyond the scheduler's update: logprobs, text, stop strings."""
        token = req.output_token_ids[-1]
        self.num_generated_tokens += 1
        lp = ro.logprobs.get(req.request_id)
        if lp is not None:
            self._decode_logprobs(lp)
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[token].logprob
        # Each token is detokenized once; stop strings are searched in the new text only.
        stop_terminated = req.is_finished and req.finish_reason == "stop"
        stop_str = req.detokenizer.update([token], stop_terminated)
        if stop_str is not None:
            req.stop_reason = stop_str
            if req.is_finished:  # it also hit its length: the stop string names the reason
                req.finish_reason = "stop"
            else:
                self.scheduler.finish_request(req, "stop")
                req.finished_time = now

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

    def _decode_logprobs(self, d: dict[int, Logprob]) -> None:
        """Fill each Logprob's ``decoded_token`` (the token's text alone, cached by id)."""
        tok = self.tokenizer
        if tok is None:
            return
        cache = self._token_text
        for t, lp in d.items():
            text = cache.get(t)
            if text is None:
                text = cache[t] = tok.decode([t])
            lp.decoded_token = text

    def _account_swaps(self, so: SchedulerOutput, ro: RunnerOutput) -> None:
        st = self.swap_stats
        st["out_blocks"] += len(so.blocks_to_swap_out)
        st["in_blocks"] += len(so.blocks_to_swap_in)
        st["out_s"] += ro.swap_out_seconds
        st["in_s"] += ro.swap_in_seconds

    # -- outputs ------------------------------------------------------------------------------
    def _collect_outputs(self, touched: set[str]) -> list[RequestOutput]:
        outs = []
        for gid in touched:
            group = self.groups.get(gid)
            if group is None:
                continue
            if group.finished:
                del self.groups[gid]
            elif (
                not self.stream_outputs
                or group.seqs[0].sampling_params.output_kind is RequestOutputKind.FINAL_ONLY
            ):
                continue
            outs.append(self.make_output(group))
        return outs

    def make_output(self, group: _Group) -> RequestOutput:
        """The group's output now: cumulative, or (DELTA) only what is new since the last one.

        O(new tokens) per call for DELTA: no whole-output decode or copy.
        """
        first = group.seqs[0]
        delta = first.sampling_params.output_kind is RequestOutputKind.DELTA
        completions = []
        for seq in group.seqs:
            p = seq.sampling_params
            finished = seq.is_finished
            if finished:
                seq.detokenizer.finish()
            if delta:
                start = seq.num_sent_tokens
                new = start < seq.num_output_tokens or (finished and not seq.finish_sent)
                if not (new or group.finished):  # the last output lists every sequence
                    continue
                seq.num_sent_tokens, seq.finish_sent = seq.num_output_tokens, finished
                token_ids = seq.output_token_ids[start:]
                lps = seq.logprobs[start:] if p.logprobs is not None else None
            else:
                token_ids = list(seq.output_token_ids)
                lps = list(seq.logprobs) if p.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.get_next_output_text(finished, delta),
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob if lps is not None else None,
                    logprobs=lps,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_lps = None
        if first.sampling_params.prompt_logprobs is not None and not (
            delta and group.prompt_logprobs_sent
        ):
            prompt_lps = [None, *first.prompt_logprobs]
            group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=first.prompt_token_ids,  # never mutated: shared, not copied
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=prompt_lps,
            metrics=RequestMetrics(
                arrival_time=first.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=first.first_token_time,
                last_token_time=first.last_token_time,
                finished_time=first.finished_time,
                num_preemptions=sum(s.num_preemptions for s in group.seqs),
                num_generation_tokens=sum(s.num_output_tokens for s in group.seqs),
            ),
        )

    # -- the ledger ---------------------------------------------------------------------------
    def ledger(self) -> LedgerSnapshot:
        snap = self.kv.ledger()
        snap.kv_cache_dtype = self.config.cache.kv_cache_dtype
        snap.scale_bytes_per_token = self.scale_bytes_per_token
        snap.overlay_bytes_per_request = self.overlay_bytes_per_request
        snap.tensor_parallel_size = self.tp
        if self.kv_pool is None:  # tensor parallelism: the ranks hold the pools
            snap.device = str(self.device)
            snap.ranks = [
                {"rank": r.rank, "pid": r.pid, "host": r.host, "kv_heads": r.num_kv_heads,
                 "bytes_per_block": r.bytes_per_block, "device_pool_bytes": r.device_pool_bytes,
                 "host_pool_bytes": r.host_pool_bytes, "weight_bytes": r.weight_bytes,
                 "used_bytes": snap.used_blocks * r.bytes_per_block}
                for r in self.tp_ranks
            ]
            snap.device_pool_bytes = sum(r.device_pool_bytes for r in self.tp_ranks)
            snap.model_bytes_per_block = sum(r.bytes_per_block for r in self.tp_ranks)
            self._overlay_ledger(snap)
            self._swap_ledger(snap)
            return snap
        snap.model_bytes_per_block = snap.bytes_per_block
        self._overlay_ledger(snap)
        snap.device = str(self.device)
        pool = self.kv_pool
        snap.device_pool_bytes = pool.data.numel() * pool.data.element_size() + pool.overlay_bytes
        if self.device.type == "cuda":
            snap.device_memory = _cuda_memory(self)
        self._swap_ledger(snap)
        return snap

    def _overlay_ledger(self, snap: LedgerSnapshot) -> None:
        """The quantised formats' overlay and sink cache (one rank's bytes under TP)."""
        ov = self.runner.overlay
        pool = self.kv_pool if self.kv_pool is not None else (ov.pool if ov is not None else None)
        if pool is not None:
            snap.overlay_slots = pool.overlay_slots
            snap.overlay_bytes = pool.overlay_bytes
        if ov is not None:
            snap.overlay_slots_used = ov.num_used
            snap.sink_cache_entries = len(ov.sink_cache)
            snap.sink_cache_bytes = ov.sink_cache_bytes
            snap.sink_cache_hits = ov.sink_cache_hits
            snap.sink_cache_misses = ov.sink_cache_misses

    def _swap_ledger(self, snap: LedgerSnapshot) -> None:
        st = self.swap_stats
        snap.preemptions = dict(self.scheduler.num_preemptions)
        snap.swapped_out_blocks = st["out_blocks"]
        snap.swapped_in_blocks = st["in_blocks"]
        snap.swap_out_bytes = st["out_blocks"] * self.kv.bytes_per_block
        snap.swap_in_bytes = st["in_blocks"] * self.kv.bytes_per_block
        snap.swap_out_seconds = st["out_s"]
        snap.swap_in_seconds = st["in_s"]


def _cuda_memory(engine) -> dict:
    """The device as torch sees it now, and the start-up profile the pool was sized from."""
    free, total = torch.cuda.mem_get_info(engine.device)
    d = {
        "total": total,
        "free": free,
        "torch_allocated": torch.cuda.memory_allocated(engine.device),
        "torch_reserved": torch.cuda.memory_reserved(engine.device),
        "gpu_memory_utilization": engine.config.cache.gpu_memory_utilization,
    }
    prof = getattr(engine, "memory_profile", None)
    if prof is not None:
        d.update(
            weights=prof.weights, peak_activation=prof.peak_activation, non_torch=prof.non_torch
        )
    return d


def _maybe_tokenizer(path: str):
    """The folder's tokenizer; None for a weights-only folder (token-id prompts only)."""
    from pathlib import Path

    p = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if p.is_dir() and not any((p / f).exists() for f in names):
        logger.warning("no tokenizer in %s: only token-id prompts are accepted", path)
        return None
    tok = load_tokenizer(path)
    tok.model_max_length = 1 << 60  # the engine checks lengths itself, with a clear error
    return tok


_GENERATION_KEYS = {  # generation_config.json key -> SamplingParams field (vLLM's set)
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _generation_defaults(model: str, mode: str) -> dict:
    """The sampling defaults a model folder's generation_config.json sets ("auto"), as vLLM
    reads them; nothing for "vllm" or without the file."""
    import json
    from pathlib import Path

    path = Path(model) / "generation_config.json"
    if mode != "auto" or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return {field: cfg[key] for key, field in _GENERATION_KEYS.items() if cfg.get(key) is not None}


def _plan_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model_dtype]


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_devices(tp: int, device: torch.device, backend: str) -> None:
    """One rank per device: refuse more ranks than this machine has (spawned workers only; an
    external launcher's workers bring their own devices)."""
    if backend != "mp":
        return
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if tp > n:
            raise ConfigError(f"tensor_parallel_size={tp} exceeds the {n} CUDA device(s) here")
    elif tp > _num_cpus():
        raise ConfigError(
            f"tensor_parallel_size={tp} exceeds the {_num_cpus()} CPU core(s) this process may "
            "use (each rank needs at least one)"
        )


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * _GiB
