"""Engine configuration: plain dataclasses, validated once at the edge with clear messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.cache.block_hash import PREFIX_CACHING_HASH_ALGOS
from kvledger.cache.kv_events import KVEventsConfig
from kvledger.errors import ConfigError
from kvledger.spec_decode.config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "fp8", "int8", "fp8_int8")
PREEMPTION_MODES = ("auto", "swap", "recompute")
VICTIM_POLICIES = ("remaining", "fcfs", "priority")
# vLLM's dtype names: "half" is float16, "float" is float32.
DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance")  # kvledger.structured.backends
# "mp": the engine spawns one worker process per rank; "external": workers started elsewhere
# (torchrun, several machines) connect to tp_driver_address.
EXECUTOR_BACKENDS = ("mp", "external")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"  # auto | swap | recompute
    victim_policy: str = "remaining"  # remaining (with aging) | fcfs (newest first) | priority
    recompute_threshold: int | None = None  # override: recompute below this many tokens
    max_preemptions_before_protect: int = 3  # after this many, a request is evicted last
    watermark_blocks: int = 0  # blocks kept free at admission so decodes rarely preempt
    # vLLM's flag: hybrid (full + sliding) models keep one block table for all layers, so the
    # sliding layers' blocks outside the window are not freed (kvledger.ledger.kv_cache_groups).
    disable_hybrid_kv_cache_manager: bool = False
    # While any request decodes, a step computes at most this many prefill tokens (new
    # prompts and chunks together), so a burst of arrivals cannot stall every stream's next
    # token behind one long step; with no decode running the whole max_num_batched_tokens
    # goes to prefills. None: no separate cap. Chunked prefill only.
    max_prefill_tokens_while_decoding: int | None = None

    def validate(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_prefill_tokens_while_decoding is not None:
            _positive("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("victim_policy", self.victim_policy, VICTIM_POLICIES)
        if self.recompute_threshold is not None and self.recompute_threshold < 0:
            raise ConfigError("recompute_threshold must be >= 0")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size from kv_cache_memory / the ledger
    kv_cache_memory: int | None = None  # bytes for the device KV pool
    # vLLM's meaning, on CUDA: weights + KV may take this fraction of the device memory that
    # was free at start-up (the rest stays for activations). No effect on the CPU.
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # kvledger/cache/block_hash.py (vLLM's names)
    kv_cache_dtype: str = "auto"
    kv_sink_tokens: int = 4
    kv_recent_tokens: int = 0
    # The tiered prefix cache (kvledger/cache/kv_tiers.py): prefix blocks the pool evicts are
    # kept in host memory (kv_offload_host_bytes) and in files under kv_offload_dir
    # (kv_offload_disk_bytes), each tier LRU within its bytes. vLLM's kv_offloading_size (GiB of
    # CPU memory) sets the host budget when kv_offload_host_bytes is not given, and
    # kv_offloading_backend must then be "native" (its CPU offloading connector's role).
    kv_offload_dir: str | None = None
    kv_offload_host_bytes: int | None = None
    kv_offload_disk_bytes: int | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # vLLM's --kv-transfer-config with its OffloadingConnector (kvledger/cache/kv_transfer_config.py):
    # a host tier of num_cpu_blocks blocks or cpu_bytes_to_use bytes, when the flags above are unset.
    kv_transfer_config: dict | str | None = None

    @property
    def offload_host_bytes(self) -> int:
        """The host tier's bytes from the flags (a kv_transfer_config in blocks: see
        ``offload_host_bytes_for``)."""
        if self.kv_offload_host_bytes is not None:
            return self.kv_offload_host_bytes
        if self.kv_offloading_size is not None:
            return int(self.kv_offloading_size * (1 << 30))
        if self.kv_transfer_config is not None:
            return self._transfer().bytes
        return 0

    def offload_host_bytes_for(self, bytes_per_token: int) -> int:
        if self.kv_offload_host_bytes is None and self.kv_offloading_size is None and self.kv_transfer_config:
            return self._transfer().tokens * bytes_per_token or self._transfer().bytes
        return self.offload_host_bytes

    def _transfer(self):
        from kvledger.cache.kv_transfer_config import parse_kv_transfer_config

        return parse_kv_transfer_config(self.kv_transfer_config, self.block_size)

    @property
    def offload_disk_bytes(self) -> int:
        if self.kv_offload_dir is None:
            return 0
        return DEFAULT_OFFLOAD_DISK_BYTES if self.kv_offload_disk_bytes is None else self.kv_offload_disk_bytes

    @property
    def kv_offload_enabled(self) -> bool:
        return self.offload_host_bytes_for(1) > 0 or self.offload_disk_bytes > 0

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if not (isinstance(self.gpu_memory_utilization, int | float) and 0 < self.gpu_memory_utilization <= 1):
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo, PREFIX_CACHING_HASH_ALGOS)
        if self.kv_sink_tokens < 0 or self.kv_recent_tokens < 0:
            raise ConfigError("kv_sink_tokens and kv_recent_tokens must be >= 0")
        self._validate_offload()

    def _validate_offload(self) -> None:
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
            v = getattr(self, name)
            if isinstance(v, str):  # "4GiB", as on the command line
                from kvledger.ledger.accounting import parse_size

                try:
                    v = parse_size(v)
                except ConfigError as e:
                    raise ConfigError(f"{name}: {e}") from None
                setattr(self, name, v)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"{name} must be a whole number of bytes >= 0 (e.g. 4GiB), got {v!r}")
        v = self.kv_offloading_size
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"kv_offloading_size must be GiB >= 0, got {v!r}")
        if self.kv_transfer_config is not None:
            self._transfer()  # a bad config is a clear error here, before anything loads
        if self.kv_offloading_backend not in (None, "native"):
            raise ConfigError(
                f"kv_offloading_backend {self.kv_offloading_backend!r} is not available here: only "
                "'native' (kvledger's own host and disk tiers)"
            )
        if self.kv_offload_disk_bytes and self.kv_offload_dir is None:
            raise ConfigError("kv_offload_disk_bytes needs kv_offload_dir (where the disk tier lives)")
        if self.kv_offload_dir is not None and not str(self.kv_offload_dir).strip():
            raise ConfigError("kv_offload_dir must be a directory path, got an empty string")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ConfigError("kv offloading keeps prefix-cache blocks: it needs prefix caching on")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    tokenizer: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    calibrate_preemption: bool = True  # measure copy bandwidth / prefill rate at start-up
    swap_bandwidth: float | None = None  # bytes/s override for the cost model
    prefill_cost: tuple[float, float, float] | None = None  # (c0, c1, c2) seconds override
    max_logprobs: int = 20  # vLLM's cap on logprobs / prompt_logprobs per position; -1: none
    # "auto": the model folder's generation_config.json sampling defaults apply to requests
    # that leave them unset (as vLLM); "vllm": ignore the file (SamplingParams' defaults).
    generation_config: str = "auto"
    attention_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere) | torch | triton
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (see worker/cuda_graphs.py)
    # CPU: create oneDNN's primitive for every GEMM shape a step can bring at start-up
    # (model/layers.py warm_up_gemm_shapes), so a long-running server's memory is at its plateau
    # from the first request. `kvledger serve` turns it on; offline LLM() skips the ~1 s.
    warm_up_gemm_shapes: bool = False
    # CPU: map every page of the KV pool at start-up (KVCachePool.populate) instead of in the
    # first steps that write each block. `kvledger serve` turns it on; offline LLM() starts
    # ~1 s per GiB sooner without it.
    populate_kv_cache: bool = False
    # vLLM's --kv-events-config: a KVEventsConfig, a dict or its JSON text; None: no events.
    kv_events_config: KVEventsConfig | dict | str | None = None
    data_parallel_rank: int | None = None  # this engine's rank among data-parallel replicas
    # vLLM's StructuredOutputsConfig.backend for requests whose backend the server has not
    # resolved (the offline API): xgrammar | guidance | auto.
    structured_outputs_backend: str = "auto"
    # Tensor parallelism (kvledger/distributed): ranks, how they start, where an external
    # launcher's workers connect (HOST:PORT), torch threads per rank (None: cores / ranks), and
    # how long a step may wait for a rank before the engine fails its requests.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    tp_driver_address: str | None = None
    tp_worker_threads: int | None = None
    tp_step_timeout: float = 60.0
    # vLLM's --quantization, applied on the fly to a float checkpoint: None, "int8" (W8A8,
    # model/quant_int8.py) or "int4" (weight-only, groups of 32, model/quant_group.py).
    # Checkpoints that carry a quantization_config are read as they are.
    quantization: str | None = None
    # vLLM's --runner: "generate" (text), or "pooling" (embeddings: kvledger/pooling); "auto"
    # is "generate" for the decoder models served here. ``pooler_config``: vLLM's
    # --pooler-config keys pooling_type (LAST | MEAN | CLS) and normalize, over the folder's.
    runner: str = "auto"
    pooler_config: dict | None = None
    # vLLM's --hf-overrides: keys laid over the folder's config.json before anything reads it
    # (e.g. Qwen3-Reranker's architectures / classifier_from_token: pooling/README in docs).
    hf_overrides: dict | None = None
    # vLLM's speculative_config: a SpeculativeConfig, a dict or its JSON text; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def validate(self) -> None:
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.dtype not in DTYPE_ALIASES:
            raise ConfigError(
                f"dtype must be one of {', '.join(DTYPE_ALIASES)}; got {self.dtype!r}"
            )
        self.dtype = DTYPE_ALIASES[self.dtype]
        if self.generation_config not in ("auto", "vllm"):
            raise ConfigError(
                f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}"
            )
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ConfigError(f"hf_overrides must be a dict of config.json keys, got {type(self.hf_overrides).__name__}")
        _choice("runner", self.runner, RUNNERS)
        if self.runner == "auto":
            self.runner = "generate"
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ConfigError("speculative_config needs the generate runner: a pooling model never decodes")
        draft_quant = self.speculative_config and self.speculative_config.quantization
        if draft_quant:
            _choice("speculative_config.quantization", draft_quant, QUANTIZATION_METHODS)
        _choice("structured_outputs_backend", self.structured_outputs_backend, STRUCTURED_BACKENDS)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.distributed_executor_backend is not None:
            _choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        if self.tp_worker_threads is not None:
            _positive("tp_worker_threads", self.tp_worker_threads)
        if not (isinstance(self.tp_step_timeout, int | float) and self.tp_step_timeout > 0):
            raise ConfigError(f"tp_step_timeout must be > 0 seconds, got {self.tp_step_timeout!r}")
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        self.scheduler.validate()
        self.cache.validate()


DEFAULT_OFFLOAD_DISK_BYTES = 16 << 30  # the disk tier's budget when only kv_offload_dir is given
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
QUANTIZATION_METHODS = ("int8", "int4")  # on the fly (model/quant_int8.py, model/quant_group.py)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
