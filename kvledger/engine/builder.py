"""``build_engine(config)``: size the pools, start the workers, calibrate, then hand the
finished parts to ``LLMEngine``'s constructor (nothing writes into a part after building it).

Order matters for start-up time and for what each step can know: the tokenizer loads in a
thread while the weights load (the in-process worker) or the model's shape is read (tensor
parallelism: the ranks load their shards); the KV budget comes from the ledger's formulas
(on CUDA from a profile of the loaded worker); the block manager is built on that pool; the
preemption cost model is calibrated on the real runner once the tokenizer's imports are done
(they skewed the timings 5-30x when both ran at once); the scheduler gets the result.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvledger.cache.attention_policy import cdiv
from kvledger.cache.kv_block_file import OffloadSpec, model_directory, model_fingerprint
from kvledger.cache.kv_tiers import KVTiers
from kvledger.config import EngineConfig
from kvledger.core.engine import LLMEngine
from kvledger.core.preemption import PreemptionCostModel
from kvledger.core.scheduler import Scheduler, build_kv_manager
from kvledger.engine.calibration import Calibration, calibrate
from kvledger.errors import ConfigError
from kvledger.executor.base import Executor
from kvledger.hf.config import generation_defaults
from kvledger.hf.tokenizer import maybe_tokenizer
from kvledger.ledger.accounting import (
    QUANTIZED_KV_DTYPES,
    ModelSpec,
    kv_bytes_per_token,
    per_request_overhead_bytes,
    tier_capacity,
)
from kvledger.ledger.kv_cache_groups import KVCacheLayout, kv_cache_layout
from kvledger.model.loader import LoadedModel, load_model
from kvledger.spec_decode.speculator import Speculator
from kvledger.storage.kv_overlay import SINK_CACHE_ENTRIES
from kvledger.worker.messages import WorkerSpec
from kvledger.worker.worker import Worker

logger = logging.getLogger("kvledger")

_GiB = 1 << 30
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class ModelFacts:
    """What the engine knows of the served model and its KV pool (no weights, no tensors)."""

    hf_config: dict
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int
    spec: ModelSpec
    kv_layout: KVCacheLayout
    bytes_per_token: int  # one pool slot: K/V data + quantisation scales (per rank under TP)
    scale_bytes_per_token: int = 0
    overlay_bytes_per_request: int = 0
    num_blocks: int = 0
    memory_profile: object | None = None  # CUDA: worker/gpu_memory.MemoryProfile
    calibration: dict | None = None  # what the start-up calibration measured
    # The folder's generation_config.json sampling defaults (generation_config="auto").
    default_sampling_params: dict = field(default_factory=dict)
    # Speculation with a draft model: of bytes_per_token, the draft's KV (0: no draft model).
    draft_bytes_per_token: int = 0


def build_engine(config: EngineConfig) -> LLMEngine:
    config.validate()
    device = torch.device(config.device)
    # The tokenizer loads (transformers import included) in a thread while the weights load
    # and the pools are sized; it is joined before the cost model calibrates.
    tokenizer_job = ThreadPoolExecutor(1, thread_name_prefix="kvledger-tok").submit(
        maybe_tokenizer, config.tokenizer or config.model
    )
    try:
        return _build(config, device, tokenizer_job)
    except BaseException:
        # The tokenizer thread may be inside `import transformers`: let it finish before the
        # error reaches the caller, or a retry in this process meets a half-imported module.
        wait([tokenizer_job])
        raise


def _build(config: EngineConfig, device: torch.device, tokenizer_job: Future) -> LLMEngine:
    free_at_start = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    from kvledger.model.attention.triton_backend import resolve_attention_backend

    # Resolved before the weights load, so a bad choice fails fast with its reason.
    backend = resolve_attention_backend(config.attention_backend, device)
    tp, sc, cc = config.tensor_parallel_size, config.scheduler, config.cache
    draft = config.speculative_config
    draft = draft if draft is not None and draft.method == "draft_model" else None
    if draft is not None and tp > 1:
        raise ConfigError(
            "speculative_config method draft_model needs tensor_parallel_size 1 (the draft runs "
            "in the engine's one worker)"
        )
    if draft is not None and not Path(draft.model).is_dir():
        raise ConfigError(f"speculative_config.model: the draft model folder {draft.model} does not exist")
    spec = WorkerSpec(
        model=config.model, dtype=config.dtype, device=config.device, max_model_len=None,
        block_size=cc.block_size, attention_backend=backend, seed=config.seed,
        quantization=config.quantization, hf_overrides=config.hf_overrides,
        draft_model=None if draft is None else draft.model,
        draft_quantization=None if draft is None else draft.quantization,
    )  # fmt: skip
    worker = None
    if tp == 1:
        worker = Worker(spec)
        loaded = worker.loaded
    else:  # this process is the driver and loads no weights (the ranks do)
        loaded = load_model(
            config.model, dtype=config.dtype, device=config.device, weights=False, hf_overrides=config.hf_overrides
        )
    facts = _model_facts(config, loaded, device)
    if worker is not None and worker.draft is not None:
        facts.draft_bytes_per_token = _draft_bytes_per_token(config, facts, worker.draft, loaded)
        facts.bytes_per_token += facts.draft_bytes_per_token
    facts.default_sampling_params = generation_defaults(config.model, config.generation_config)
    if facts.default_sampling_params:
        logger.info(
            "sampling defaults from the model's generation_config.json: %s "
            "(generation_config='vllm' ignores them)",
            facts.default_sampling_params,
        )
    overlay_slots, reserved = _plan_overlay(config, facts)
    bytes_per_block = facts.bytes_per_token * cc.block_size
    if cc.num_kv_blocks:
        num_blocks = cc.num_kv_blocks
    else:
        budget = _kv_budget(config, facts, worker, device, free_at_start)
        num_blocks = _num_blocks(config, facts, budget - reserved, bytes_per_block)
    facts.num_blocks = num_blocks
    kv = build_kv_manager(sc, cc, num_blocks, facts.bytes_per_token, facts.kv_layout.windows)
    offload = _offload_spec(config, facts, bytes_per_block)
    if offload is not None:
        kv.attach_tiers(KVTiers(offload, cc.block_size))
    lay = facts.kv_layout
    spec = replace(
        spec,
        num_blocks=num_blocks,
        num_host_blocks=kv.host_pool.num_blocks if kv.host_pool else 0,
        kv_cache_dtype=cc.kv_cache_dtype,
        kv_sink_tokens=cc.kv_sink_tokens,
        kv_recent_tokens=cc.kv_recent_tokens,
        overlay_slots=overlay_slots,
        layer_group=lay.layer_group if lay.is_hybrid else None,
        layer_slot=lay.layer_slot if lay.is_hybrid else None,
        rope_long_from=_rope_long_from(loaded),
        warm_up_gemm_rows=(sc.max_num_batched_tokens, sc.max_num_seqs) if config.warm_up_gemm_shapes else None,
        gemm_dispatch_rows=sc.max_num_batched_tokens,
        populate_kv_cache=config.populate_kv_cache,
        kv_offload=offload,
    )
    executor = _start_workers(config, spec, worker, facts, device, backend)
    try:
        _check_pools(executor, bytes_per_block, tp)
        tokenizer = tokenizer_job.result()  # raises the tokenizer's error, if any
        cost_model, facts.calibration = _cost_model(config, executor, kv, facts)
    except BaseException:
        executor.shutdown()
        raise
    spec_cfg = config.speculative_config
    speculator = None
    if spec_cfg is not None:
        speculator = Speculator(spec_cfg, trees=_verifies_trees(config, facts, loaded, device, backend))
    scheduler = Scheduler(sc, kv, cost_model, rope_long_from=spec.rope_long_from, speculator=speculator)
    return LLMEngine(config, facts, scheduler, executor, tokenizer)


def _verifies_trees(
    config: EngineConfig, facts: ModelFacts, loaded: LoadedModel, device: torch.device, backend: str
) -> bool:
    """Whether the runner can verify token trees (kvledger.spec_decode.tree): the CPU attention
    (its native prefill kernel or SDPA take the tree's mask), a cache in the model dtype (one
    tensor, whose rows the runner moves), full attention in every layer, one rank (the rank that
    samples moves the accepted path's K/V)."""
    return (
        device.type == "cpu"
        and backend == "torch"
        and config.tensor_parallel_size == 1
        and config.cache.kv_cache_dtype == "auto"
        and not facts.kv_layout.is_hybrid
        and all(w is None for w in facts.spec.layer_windows)
        and not loaded.config.attn_softcap
    )


def _model_facts(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> ModelFacts:
    """The model's shape and the KV bytes it costs per pool slot; refuses what cannot run."""
    sc, cc, tp = config.scheduler, config.cache, config.tensor_parallel_size
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
    spec = ModelSpec.from_hf_config(loaded.hf_config, name=str(config.model))
    kv_dtype = _plan_kv_dtype(cc.kv_cache_dtype, loaded.dtype)
    mc = loaded.config
    if kv_dtype in QUANTIZED_KV_DTYPES and (mc.layer_types or mc.attn_softcap):
        raise ConfigError(
            f"kv_cache_dtype {cc.kv_cache_dtype} is not supported for {mc.architecture} with "
            "sliding-window or soft-capped attention; use kv_cache_dtype auto"
        )
    if tp > 1:
        from kvledger.distributed.sharding import check_tensor_parallel, tp_mlp_widths

        check_tensor_parallel(spec, tp, *tp_mlp_widths(mc))
        _check_tp_quantization(loaded, tp, config.quantization)
        _check_devices(tp, device, config.distributed_executor_backend or "mp")
    # Per rank under tensor parallelism: each rank's pool holds its own KV heads.
    kv_bytes = kv_bytes_per_token(spec, kv_dtype, tp)
    bytes_per_token = kv_bytes.total  # K/V data + quantisation scales
    # Hybrid models (full + sliding layers): KV cache groups over one pool whose block holds
    # group_size layers, so the sliding groups can free blocks outside their window.
    windows = spec.layer_windows
    if sc.disable_hybrid_kv_cache_manager and spec.uniform_window is None:
        windows = [None] * len(windows)  # every layer allocated as full attention (vLLM's)
    layout = kv_cache_layout(windows)
    if layout.is_hybrid:  # (under TP each rank's pool holds its heads of them)
        bytes_per_token = kv_bytes.total // spec.num_layers * layout.group_size
    return ModelFacts(
        hf_config=loaded.hf_config,
        dtype=loaded.dtype,
        eos_token_ids=tuple(loaded.eos_token_ids),
        vocab_size=mc.vocab_size,
        max_model_len=sc.max_model_len,
        spec=spec,
        kv_layout=layout,
        bytes_per_token=bytes_per_token,
        scale_bytes_per_token=kv_bytes.scale_bytes,
    )


def _draft_bytes_per_token(
    config: EngineConfig, facts: ModelFacts, draft: LoadedModel, target: LoadedModel
) -> int:
    """The draft model's KV bytes per token slot, after refusing a draft that cannot propose
    for this target: another vocabulary (its token ids would mean other tokens), a shorter
    context, sliding windows or LongRoPE (its blocks follow the target's full-attention
    tables)."""
    name = f"speculative_config.model {draft.path}"
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise ConfigError(
            f"{name}: the draft's vocabulary has {dv} tokens, the target's {tv}; a draft model "
            "must share the target's tokenizer"
        )
    mismatch = _tokenizer_mismatch(draft.path, target.path)
    if mismatch:
        raise ConfigError(f"{name}: {mismatch}; a draft model must share the target's tokenizer")
    if draft.max_model_len < facts.max_model_len:
        raise ConfigError(
            f"{name}: the draft's context is {draft.max_model_len} tokens, shorter than "
            f"max_model_len {facts.max_model_len}; lower max_model_len"
        )
    if facts.kv_layout.is_hybrid or any(w is not None for w in facts.spec.layer_windows):
        raise ConfigError(
            "speculative_config method draft_model needs a full-attention target (no sliding windows)"
        )
    dspec = ModelSpec.from_hf_config(draft.hf_config, name=str(draft.path))
    if any(w is not None for w in dspec.layer_windows) or _rope_long_from(draft) is not None:
        raise ConfigError(f"{name}: a draft with sliding windows or LongRoPE is not supported")
    if _rope_long_from(target) is not None:
        raise ConfigError("speculative_config method draft_model does not support a LongRoPE target")
    return kv_bytes_per_token(replace(dspec, dtype=_TORCH_DTYPE_NAMES[draft.dtype]), _plan_kv_dtype("auto", draft.dtype)).total


def _tokenizer_mismatch(draft: Path, target: Path) -> str | None:
    """Why two folders' tokenizer.json vocabularies differ (None: same, or one has none)."""
    import json

    vocabs = []
    for folder in (draft, target):
        f = folder / "tokenizer.json"
        if not f.is_file():
            return None
        tok = json.loads(f.read_text())
        added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
        vocabs.append((tok.get("model", {}).get("vocab"), added))
    (dv, da), (tv, ta) = vocabs
    if dv != tv:
        return "its tokenizer.json vocabulary differs from the target's"
    if da != ta:
        return "its tokenizer.json added tokens differ from the target's"
    return None


def _plan_overlay(config: EngineConfig, facts: ModelFacts) -> tuple[int, int]:
    """Quantised formats keep each running request's sinks and recent window in the model
    dtype (the overlay, max_num_seqs + headroom slots) and a small cache of sinks for prefix
    hits; both come out of the KV budget. Returns (overlay slots, bytes reserved)."""
    cc, sc, tp = config.cache, config.scheduler, config.tensor_parallel_size
    kv_dtype = _plan_kv_dtype(cc.kv_cache_dtype, facts.dtype)
    model_spec = replace(facts.spec, dtype=_TORCH_DTYPE_NAMES[facts.dtype])
    per_request = per_request_overhead_bytes(
        model_spec, kv_dtype, cc.kv_sink_tokens, cc.kv_recent_tokens, tp
    )
    facts.overlay_bytes_per_request = per_request
    if not per_request:
        return 0, 0
    slots = sc.max_num_seqs + max(4, sc.max_num_seqs // 8)
    sinks = per_request_overhead_bytes(model_spec, kv_dtype, cc.kv_sink_tokens, 0, tp)
    return slots, slots * per_request + SINK_CACHE_ENTRIES * sinks


def _kv_budget(
    config: EngineConfig,
    facts: ModelFacts,
    worker: Worker | None,
    device: torch.device,
    free_at_start: int | None,
) -> int:
    """Bytes for the device KV pool: ``kv_cache_memory``, else on CUDA vLLM's
    gpu_memory_utilization share less weights and a profiled step's activations, else on the
    CPU a fifth of the available memory (at most 4 GiB), shared by the tensor-parallel ranks."""
    cc = config.cache
    if cc.kv_cache_memory is not None:
        return cc.kv_cache_memory
    if device.type == "cuda" and worker is not None:
        from kvledger.worker.gpu_memory import kv_cache_budget, profile

        free, _ = torch.cuda.mem_get_info(device)
        facts.memory_profile = profile(
            worker.model, facts, config, device, free_at_start or free
        )
        return kv_cache_budget(facts.memory_profile, cc.gpu_memory_utilization)
    return min(4 * _GiB, int(_mem_available() * 0.2)) // config.tensor_parallel_size


def _num_blocks(config: EngineConfig, facts: ModelFacts, budget: int, bytes_per_block: int) -> int:
    """Blocks the budget holds, never more than max_num_seqs full contexts need."""
    cc, sc = config.cache, config.scheduler
    # A hybrid model's request holds blocks in each KV cache group.
    useful = sc.max_num_seqs * cdiv(facts.max_model_len, cc.block_size) * len(facts.kv_layout.groups)
    num_blocks = min(budget // bytes_per_block, useful)
    if num_blocks < 1:
        raise ConfigError(
            f"KV memory budget of {budget} bytes holds no block of {bytes_per_block} bytes"
        )
    return num_blocks


def _start_workers(
    config: EngineConfig,
    spec: WorkerSpec,
    worker: Worker | None,
    facts: ModelFacts,
    device: torch.device,
    backend: str,
) -> Executor:
    """The in-process worker's pools, or the tensor-parallel ranks (kvledger.distributed):
    each rank loads its shard and builds pools of the same blocks for its own KV heads."""
    sc = config.scheduler
    if worker is not None:
        graphs = (
            not facts.kv_layout.is_hybrid and device.type == "cuda" and backend == "triton"
            and not config.enforce_eager and facts.overlay_bytes_per_request == 0
        )  # fmt: skip
        spec.cuda_graph_max_seqs = sc.max_num_seqs if graphs else 0
        if config.populate_kv_cache and device.type == "cpu":
            t0 = time.perf_counter()
        worker.init_kv_cache(spec)
        if config.populate_kv_cache and device.type == "cpu":
            logger.info(
                "KV pool mapped at start-up: %.2f GiB in %.2f s",
                worker.kv_pool.num_bytes / 2**30, time.perf_counter() - t0,
            )
        if worker.ready.gemm_dispatch:
            logger.info("%s", worker.ready.gemm_dispatch)
        if spec.warm_up_gemm_rows is not None and device.type == "cpu":
            logger.info("oneDNN GEMM shapes created at start-up: %d", worker.ready.gemm_shapes_warmed)
        from kvledger.executor.local import LocalExecutor

        return LocalExecutor(worker)
    from kvledger.executor.tp_executor import TPExecutor

    tp = config.tensor_parallel_size
    spec.max_model_len = facts.max_model_len
    spec.num_threads = config.tp_worker_threads or max(1, _num_cpus() // tp)
    spec.dist_backend = "nccl" if device.type == "cuda" else "gloo"
    spec.collective_timeout_s = config.tp_step_timeout
    ex = TPExecutor(
        spec, tp, config.distributed_executor_backend or "mp", config.tp_driver_address,
        step_timeout_s=config.tp_step_timeout,
    )  # fmt: skip
    if ex.ranks and ex.ranks[0].gemm_dispatch:
        logger.info("rank 0: %s", ex.ranks[0].gemm_dispatch)
    if spec.warm_up_gemm_rows is not None:
        logger.info("oneDNN GEMM shapes created at start-up per rank: %s",
                    [r.gemm_shapes_warmed for r in ex.ranks])
    return ex


def _offload_spec(config: EngineConfig, facts: ModelFacts, bytes_per_block: int) -> OffloadSpec | None:
    """The tiered prefix cache's shape (kvledger.cache.kv_tiers), or None when it is off. The
    fingerprint covers the checkpoint and every fact that changes a block's bytes."""
    cc = config.cache
    if not cc.kv_offload_enabled:
        return None
    sp = facts.spec
    block_facts = {
        "format": 1, "dtype": str(facts.dtype).removeprefix("torch."),
        "kv_cache_dtype": cc.kv_cache_dtype, "block_size": cc.block_size,
        "hash_algo": cc.prefix_caching_hash_algo, "quantization": config.quantization,
        "layers": [sp.num_layers, sp.num_kv_heads, sp.head_dim], "tp_size": config.tensor_parallel_size,
    }  # fmt: skip
    if facts.kv_layout.is_hybrid:  # which layers a block holds depends on the KV cache groups
        block_facts["kv_groups"] = [[list(g.layers), g.sliding_window] for g in facts.kv_layout.groups]
    fingerprint = model_fingerprint(config.model, block_facts)
    directory = None
    if cc.offload_disk_bytes:
        root = os.path.expanduser(cc.kv_offload_dir)
        directory = model_directory(root, fingerprint)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            if not os.path.isdir(root):
                raise ConfigError(f"kv_offload_dir {cc.kv_offload_dir!r} cannot be created: {e}") from None
            # It exists but cannot be written (read-only): every write fails and is reported once.
    # The budgets count every rank's share of a block (bytes_per_block is one rank's).
    tp = config.tensor_parallel_size
    host = cc.offload_host_bytes_for(facts.bytes_per_token * tp)
    cap = tier_capacity(bytes_per_block * tp, cc.block_size, host, cc.offload_disk_bytes)
    return OffloadSpec(
        fingerprint=fingerprint, num_host_blocks=cap["host"]["blocks"],
        num_disk_blocks=cap["disk"]["blocks"], block_bytes=bytes_per_block,
        directory=directory, facts=block_facts, num_ranks=tp,
    )  # fmt: skip


def _check_pools(executor: Executor, bytes_per_block: int, tp: int) -> None:
    """Every rank's real pool must hold exactly what the ledger (`kvledger plan --tp N`)
    says per block."""
    for r in executor.ranks:
        if r.bytes_per_block != bytes_per_block:
            raise AssertionError(
                f"rank {r.rank}'s pool holds {r.bytes_per_block} bytes per block; the ledger "
                f"(kvledger plan --tp {tp}) says {bytes_per_block}"
            )


def _cost_model(
    config: EngineConfig, executor: Executor, kv, facts: ModelFacts
) -> tuple[PreemptionCostModel, dict | None]:
    """The scheduler's swap-vs-recompute model: configured numbers, else measured ones."""
    sc = config.scheduler
    cm = PreemptionCostModel(mode=sc.preemption_mode, recompute_threshold=sc.recompute_threshold)
    if config.swap_bandwidth:
        cm.swap_bandwidth = config.swap_bandwidth
    if config.prefill_cost:
        cm.prefill_coeffs = tuple(config.prefill_cost)
    if not (
        config.calibrate_preemption
        and sc.preemption_mode == "auto"
        and sc.recompute_threshold is None
        and not (config.swap_bandwidth and config.prefill_cost)
    ):
        return cm, None
    cal: Calibration = calibrate(executor, kv, facts.max_model_len)
    if cal.prefill_coeffs is not None:
        cm.prefill_coeffs = cal.prefill_coeffs
    if cal.swap_bandwidth is not None:
        cm.swap_bandwidth, cm.swap_fixed_s = cal.swap_bandwidth, cal.swap_fixed_s
    info = {
        "prefill_lengths": cal.info["prefill_lengths"],
        "prefill_seconds": cal.info["prefill_seconds"],
        "swap_bandwidth_bytes_per_s": cm.swap_bandwidth,
        "swap_fixed_s": cm.swap_fixed_s,
        "crossover_tokens": cm.crossover_tokens(facts.bytes_per_token),
        "seconds": cal.info["seconds"],
    }
    logger.info("preemption cost model calibrated: %s", info)
    return cm, info


def _rope_long_from(loaded: LoadedModel) -> int | None:
    """LongRoPE: the table is chosen by the sequence's length, crossing it recomputes."""
    rope = getattr(loaded.model, "rotary_emb", None)
    return getattr(rope, "long_from", None)


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


def _check_tp_quantization(loaded, tp: int, quantization: str | None) -> None:
    """A checkpoint stored quantised (GGUF, GPTQ, AWQ, compressed-tensors INT8) holds packed
    tensors the sharding does not split yet; FP8 ones are dequantised on load and shard as floats,
    and ``quantization`` on the fly quantises each rank's float shard, whose int4 groups of 32
    must not straddle two ranks (o_proj's and down_proj's rows are split by columns)."""
    from kvledger.hf.config import quantization_method

    method = "gguf" if (loaded.path / "gguf.json").is_file() else quantization_method(loaded.hf_config)
    if method not in (None, "fp8"):
        raise ConfigError(
            f"tensor_parallel_size > 1 with a {method} checkpoint is not supported yet (its packed "
            "tensors are not split by rank); run it with tensor_parallel_size 1, or load the float "
            "checkpoint with --quantization int8 / int4, which quantises each rank's shard"
        )
    if quantization == "int4":
        mc = loaded.config
        for name, k in (("o_proj", mc.num_heads * mc.head_dim), ("down_proj", mc.intermediate_size or 0)):
            if k % 32 == 0 and (k // tp) % 32:
                raise ConfigError(
                    f"quantization int4 with tensor_parallel_size={tp}: {name}'s rows of {k} weights "
                    f"split into {k // tp} per rank, not whole groups of 32; use a tensor_parallel_size "
                    f"that keeps {k // 32} groups whole, or quantization int8"
                )
