"""Engine options shared by every command that builds an engine (generate, serve, bench)."""

from __future__ import annotations

import argparse
from typing import Any

from kvledger.cache.block_hash import PREFIX_CACHING_HASH_ALGOS
from kvledger.json_config import json_object


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument(
        "--kv-cache-memory", default=None, help="KV pool size in bytes (e.g. 2GiB); default: sized from free memory"
    )
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8", "fp8_int8"])
    g.add_argument(
        "--quantization", "-q", default=None, choices=["int8", "int4"],
        help="quantise a float checkpoint's layer weights at load: int8 = W8A8 (per-channel int8 "
        "weights, dynamic per-token int8 activations; vLLM's name), int4 = weight-only, groups of 32",
    )  # fmt: skip
    g.add_argument(
        "--runner", default="auto", choices=["auto", "generate", "pooling"],
        help="pooling: embed, classify or score prompts (/v1/embeddings, /classify, /score, /rerank) instead of "
        "generating text (vLLM's --runner); auto pools *ForSequenceClassification and bare *Model folders",
    )  # fmt: skip
    g.add_argument(
        "--task", default=None, choices=["embed", "classify", "score", "generate"],
        help="deprecated: use --runner (embed, classify, score = pooling)",
    )  # fmt: skip
    g.add_argument(
        "--pooler-config", default=None,
        help='pooling over the folder\'s: JSON with pooling_type (LAST | MEAN | CLS) and normalize, e.g. \'{"pooling_type": "MEAN"}\'',
    )  # fmt: skip
    g.add_argument(
        "--hf-overrides", default=None,
        help="JSON laid over the folder's config.json (vLLM's), e.g. Qwen3-Reranker's "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}\'',
    )  # fmt: skip
    g.add_argument("--kv-sink-tokens", type=int, default=4)
    g.add_argument("--kv-recent-tokens", type=int, default=0)
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped blocks")
    g.add_argument(
        "--kv-offload-dir", default=None,
        help="directory of the disk tier of the prefix cache: evicted prefix blocks are kept in "
        "files there (checked against the model fingerprint and a checksum) and survive restarts",
    )  # fmt: skip
    g.add_argument(
        "--kv-offload-host-bytes", default=None,
        help="host-memory tier of the prefix cache, e.g. 4GiB (default 0: none; on a CPU server "
        "a cheap-to-evict budget beside the pool and the disk tier's staging area)",
    )  # fmt: skip
    g.add_argument(
        "--kv-offload-disk-bytes", default=None,
        help="disk tier budget, e.g. 64GiB, least recently used files deleted beyond it "
        "(default 16GiB when --kv-offload-dir is given)",
    )  # fmt: skip
    g.add_argument(
        "--kv-offloading-size", type=float, default=None,
        help="vLLM's name: GiB of CPU memory for offloaded KV blocks (the host tier; "
        "--kv-offload-host-bytes wins when both are given)",
    )  # fmt: skip
    g.add_argument(
        "--kv-offloading-backend", default=None, choices=["native", "lmcache"],
        help="vLLM's name: native (kvledger's host and disk tiers); lmcache is refused",
    )  # fmt: skip
    g.add_argument(
        "--kv-transfer-config", default=None,
        help="vLLM's KV connector JSON; only its OffloadingConnector maps here (the host tier), e.g. "
        '\'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"num_cpu_blocks": 4096}}\'',
    )  # fmt: skip
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    g.add_argument("--victim-policy", default="remaining", choices=["remaining", "fcfs", "priority"])
    g.add_argument("--recompute-threshold", type=int, default=None, help="recompute victims shorter than this")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="while any request decodes, prefill at most this many tokens per step, so a burst "
        "of new prompts does not stall every stream (default and 0: no cap beyond "
        "--max-num-batched-tokens, as vLLM)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--prefix-caching-hash-algo",
        choices=PREFIX_CACHING_HASH_ALGOS,
        default="sha256",
        help="block hash: sha256 (default) and sha256_cbor are the same in every process, so a "
        "router can recompute them; builtin is Python's hash(), faster but salted per process",
    )
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="full + sliding-window models: one block table for every layer (window blocks are not freed)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--tokenizer",
        default=None,
        help="a folder (or hub id) whose tokenizer to use instead of the model's own (vLLM's "
        "--tokenizer; e.g. beside a GGUF file)",
    )
    g.add_argument(
        "--revision", default=None, help="hub model revision: branch, tag or commit (default: main)"
    )
    g.add_argument(
        "--download-dir",
        default=None,
        help="Hugging Face cache folder for hub models (default: $HF_HUB_CACHE or ~/.cache/huggingface)",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: triton on CUDA, torch (native kernels) on CPU; triton on CPU needs TRITON_INTERPRET=1",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: fraction of GPU memory for weights + activations + KV cache (from a profiling run)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="tensor-parallel ranks (one worker process each; torch.distributed: gloo on CPU, NCCL on CUDA)",
    )
    g.add_argument(
        "--distributed-executor-backend", default=None, choices=["mp", "external"],
        help="mp: the engine spawns its workers (default); external: workers started by torchrun "
        "(python -m kvledger.worker) connect to --tp-driver-address",
    )
    g.add_argument("--tp-driver-address", default=None, help="HOST:PORT external workers connect to")
    g.add_argument("--tp-worker-threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    g.add_argument(
        "--tp-step-timeout", type=float, default=60.0,
        help="seconds a step may wait for a rank before the engine fails its requests",
    )
    g.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV-events JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help="vLLM's speculative decoding JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 5, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 3}'",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options for ``LLM(...)`` / ``build_engine_config`` from parsed flags."""
    from kvledger.ledger.accounting import parse_size

    kw: dict[str, Any] = {
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "kv_sink_tokens": args.kv_sink_tokens,
        "kv_recent_tokens": args.kv_recent_tokens,
        "swap_space": args.swap_space,
        "preemption_mode": args.preemption_mode,
        "victim_policy": args.victim_policy,
        "recompute_threshold": args.recompute_threshold,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": not args.no_prefix_caching,
        "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
        "enable_chunked_prefill": not args.no_chunked_prefill,
        "disable_hybrid_kv_cache_manager": args.disable_hybrid_kv_cache_manager,
        "seed": args.seed,
        "attention_backend": args.attention_backend,
        "runner": args.runner,
    }
    if args.task is not None:
        kw["task"] = args.task
    if args.pooler_config is not None:
        kw["pooler_config"] = json_object("--pooler-config", args.pooler_config)
    if args.tokenizer is not None:
        kw["tokenizer"] = args.tokenizer
    if args.hf_overrides is not None:
        kw["hf_overrides"] = json_object("--hf-overrides", args.hf_overrides)
    if args.revision is not None:
        kw["revision"] = args.revision
    if args.download_dir is not None:
        kw["download_dir"] = args.download_dir
    if str(args.device).startswith("cuda"):
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if args.tensor_parallel_size != 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
        kw["tp_step_timeout"] = args.tp_step_timeout
        for name in ("distributed_executor_backend", "tp_driver_address", "tp_worker_threads"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
    if getattr(args, "kv_events_config", None) is not None:
        kw["kv_events_config"] = args.kv_events_config  # JSON text, parsed by EngineConfig
    if getattr(args, "speculative_config", None) is not None:
        from kvledger.spec_decode.config import SpeculativeConfig

        # Parsed here, so that a bad config is a one-line error before anything loads.
        kw["speculative_config"] = SpeculativeConfig.parse(args.speculative_config)
    if args.kv_cache_memory is not None:
        kw["kv_cache_memory"] = parse_size(args.kv_cache_memory)
    for name in ("kv_offload_dir", "kv_offloading_size", "kv_offloading_backend", "kv_transfer_config"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
        if getattr(args, name, None) is not None:
            kw[name] = parse_size(getattr(args, name))
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_prefill_tokens_while_decoding is not None:
        kw["max_prefill_tokens_while_decoding"] = args.max_prefill_tokens_while_decoding
    return kw
