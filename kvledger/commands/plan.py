"""`kvledger plan`: how many KV blocks, tokens and concurrent requests a model gets on a device.

Everything comes from kvledger.ledger (the model's spec, read from config.json by kvledger.hf.config
as the loader reads it, and the accounting), the same arithmetic the engine sizes its pool with;
this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvledger.errors import ConfigError
from kvledger.hf.gguf_file import find_gguf, gguf_folder
from kvledger.ledger.accounting import (
    KV_DTYPE_BYTES,
    CapacityPlan,
    DoesNotFitError,
    format_bytes,
    kv_bytes_per_token,
    naive_vs_paged,
    parse_size,
    plan_capacity,
    tier_capacity,
)
from kvledger.ledger.spec import DTYPE_BYTES, ModelSpec, load_model_spec
from kvledger.ledger.weights import gguf_weight_bytes, quantized_weight_bytes
from kvledger.model.default import DEFAULT_MODEL_NAME, resolve_named_model

AUTO_TP_CANDIDATES = (1, 2, 4, 8)
SAMPLE_SIZE, SAMPLE_MEDIAN, SAMPLE_SIGMA, SAMPLE_SEED = 256, 300, 1.0, 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan KV-cache capacity for a model on a device",
        description="Plan KV-cache capacity: bytes per token and block, blocks and tokens in the "
        "pool, concurrent requests at a context length, naive vs paged utilisation, and the "
        "MHA/GQA/MQA trade-off. Sizes take GiB/MiB (binary) or GB/MB (decimal) or plain bytes.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL_NAME,
        help="preset name (e.g. seed-70b, the 70B GQA-8 fp16 example of the field), model folder "
        f"or config.json (default: {DEFAULT_MODEL_NAME}, the embedded model kvledger generate runs)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", *KV_DTYPE_BYTES],
        help="KV storage format; fp8/int8/fp8_int8 add one fp16 scale per token per "
        "KV head for K and V (default: auto = model dtype)",
    )
    p.add_argument("--device-memory", default="80GiB", help="memory per device (default: 80GiB)")
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of device memory kvledger may use, 0 < f <= 1 (default: 0.9)",
    )
    p.add_argument(
        "--weight-bytes",
        help="total weight size, overriding the model's parameter "
        "count or checkpoint (split across --tp ranks)",
    )
    p.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        help="weights stored quantised (kvledger serve --quantization): int8 = W8A8, one byte per "
        "layer weight plus 8 per output row; int4 = half a byte plus a scale per 32 (fp16 for "
        "bf16/fp16 models, float32 for float32 ones); shows the tokens and requests gained over "
        "the model dtype",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="the dtype the model runs in (kvledger serve --dtype; default: auto = the checkpoint's)",
    )
    p.add_argument(
        "--activation-reserve",
        default="0",
        help="per-device memory kept for activations (default: 0)",
    )
    p.add_argument(
        "--tp",
        default="auto",
        help="tensor-parallel ranks, or 'auto': the smallest of 1/2/4/8 that fits (default: auto)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument(
        "--context-len",
        type=int,
        help="request length for concurrency (default: the model's max positions)",
    )
    p.add_argument(
        "--kv-sink-tokens",
        type=int,
        default=4,
        help="tokens kept in model dtype per request with a quantised KV (default: 4)",
    )
    p.add_argument(
        "--kv-recent-tokens",
        type=int,
        default=0,
        help="recent-window tokens kept in model dtype with a quantised KV (default: 0)",
    )
    p.add_argument(
        "--lengths",
        help="request lengths for naive vs paged utilisation: '300,1200,57' or @FILE "
        f"(numbers separated by commas or whitespace). Default: a fixed sample of "
        f"{SAMPLE_SIZE} log-normal lengths (median {SAMPLE_MEDIAN}, sigma "
        f"{SAMPLE_SIGMA}, seed {SAMPLE_SEED}) clipped to 1..context length",
    )
    p.add_argument(
        "--kv-offload-host-bytes", default="0",
        help="host-memory tier of the prefix cache (kvledger serve's flag): shows the blocks and "
        "tokens it holds (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--kv-offload-disk-bytes", default="0",
        help="disk tier of the prefix cache: the blocks and tokens its files hold (default: 0)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def sample_lengths(context_len: int) -> list[int]:
    """A deterministic chat-like mix: most requests short, a long tail up to the context."""
    rng = random.Random(SAMPLE_SEED)
    return [
        min(context_len, max(1, round(rng.lognormvariate(0, SAMPLE_SIGMA) * SAMPLE_MEDIAN)))
        for _ in range(SAMPLE_SIZE)
    ]


def parse_lengths(text: str) -> list[int]:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read lengths file {text[1:]!r}: {e}") from None
    items = text.replace(",", " ").split()
    try:
        lengths = [int(x) for x in items]
    except ValueError:
        raise ConfigError(
            f"--lengths must be integers separated by commas, got {text[:60]!r}"
        ) from None
    if not lengths:
        raise ConfigError("--lengths is empty")
    return lengths


def _plan(spec: ModelSpec, args: argparse.Namespace, tp: int, **kw: Any) -> CapacityPlan:
    return plan_capacity(
        spec,
        kw["device"],
        args.memory_fraction,
        weight_bytes=kw["weights"],
        tp=tp,
        block_size=args.block_size,
        context_len=args.context_len,
        kv_dtype=args.kv_dtype,
        activation_reserve_bytes=kw["reserve"],
        kv_sink_tokens=args.kv_sink_tokens,
        kv_recent_tokens=args.kv_recent_tokens,
    )


def _auto_tp(spec: ModelSpec, args: argparse.Namespace, **kw: Any) -> CapacityPlan:
    """The smallest TP degree that holds one context-length request; the last error otherwise."""
    error: DoesNotFitError | None = None
    for tp in AUTO_TP_CANDIDATES:
        if spec.num_attention_heads % tp == 0:
            try:
                return _plan(spec, args, tp, **kw)
            except DoesNotFitError as e:
                error = e
    raise ConfigError(f"{error} [tried tp = {', '.join(map(str, AUTO_TP_CANDIDATES))}]")


def heads_comparison(
    spec: ModelSpec, args: argparse.Namespace, tp: int, **kw: Any
) -> list[dict[str, Any]]:
    """The same model with MHA, GQA and MQA KV heads: the cheapest cut is fewer KV heads.

    ``model_bytes_per_token`` is the whole model's figure (the one papers quote: 2,560 / 320 /
    40 KiB for a 70B in FP16); ``bytes_per_token`` is one rank's under this tp."""
    heads = spec.num_attention_heads
    counts = {heads, spec.num_kv_heads, 1} | ({8} if heads % 8 == 0 and heads > 8 else set())
    rows = []
    for kv in sorted(counts, reverse=True):
        variant = replace(spec, num_kv_heads=kv)
        try:
            concurrency = _plan(variant, args, tp, **kw).max_concurrency
        except ConfigError:
            concurrency = 0
        rows.append(
            {
                "scheme": "MHA" if kv == heads else "MQA" if kv == 1 else "GQA",
                "num_kv_heads": kv,
                "this_model": kv == spec.num_kv_heads,
                "model_bytes_per_token": kv_bytes_per_token(variant, args.kv_dtype, 1).total,
                "bytes_per_token": kv_bytes_per_token(variant, args.kv_dtype, tp).total,
                "max_concurrency": concurrency,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    model = resolve_named_model(args.model) if args.model == DEFAULT_MODEL_NAME else args.model
    gguf_file = find_gguf(model) if Path(model).exists() else None
    if gguf_file is not None:  # a llama.cpp file: its config from the metadata (hf/gguf_file.py)
        model = str(gguf_folder(gguf_file, tokenizer="unused"))
    spec = load_model_spec(model)
    if getattr(args, "dtype", "auto") not in ("auto", spec.dtype):
        # The checkpoint's bytes were counted in its dtype: every tensor is converted on load.
        held = None if spec.weight_bytes is None else spec.weight_bytes // spec.dtype_bytes * DTYPE_BYTES[args.dtype]
        spec = replace(spec, dtype=args.dtype, weight_bytes=held)
    kw = {
        "device": parse_size(args.device_memory),
        "reserve": parse_size(args.activation_reserve),
        "weights": None if args.weight_bytes is None else parse_size(args.weight_bytes),
    }
    for flag, value in [("--block-size", args.block_size), ("--context-len", args.context_len)]:
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    base_kw = dict(kw)
    if gguf_file is not None:
        if args.quantization:
            raise ConfigError("--quantization applies to float checkpoints; a GGUF file is quantised already")
        if kw["weights"] is None:
            kw["weights"] = gguf_weight_bytes(str(gguf_file), spec.dtype_bytes)
    if args.quantization:
        total, source = _model_weight_bytes(spec, kw["weights"])
        kw["weights"] = quantized_weight_bytes(spec, args.quantization, total)
    if args.tp == "auto":
        plan = _auto_tp(spec, args, **kw)
    else:
        try:
            tp = int(args.tp)
        except ValueError:
            raise ConfigError(
                f"--tp must be a positive integer or 'auto', got {args.tp!r}"
            ) from None
        plan = _plan(spec, args, tp, **kw)
    given = args.lengths is not None
    lengths = parse_lengths(args.lengths) if given else sample_lengths(plan.context_len)
    util = naive_vs_paged(lengths, plan.context_len, plan.block_size, plan.bytes_per_token)
    figures = {
        **plan.to_dict(),
        **util,
        "request_cost_bytes": plan.request_cost_bytes(plan.context_len),
        "lengths_source": "given" if given else "sample",
        "heads_comparison": heads_comparison(spec, args, plan.tp, **kw),
    }
    host, disk = parse_size(args.kv_offload_host_bytes), parse_size(args.kv_offload_disk_bytes)
    if host or disk:  # the tiers hold the whole model's blocks (every rank's heads)
        figures["tiers"] = tier_capacity(plan.model_bytes_per_token * plan.block_size, plan.block_size, host, disk)
    if args.quantization:
        label = {"int8": "int8 (W8A8)", "int4": "int4 (groups of 32)"}[args.quantization]
        plan = replace(plan, weight_source=f"{source}, {label}")
        figures.update(weight_source=plan.weight_source, quantization=_quantization_gain(spec, args, plan, **base_kw))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        _print_table(spec, plan, figures)
    return 0


def _model_weight_bytes(spec: ModelSpec, given: int | None) -> tuple[int, str]:
    """The whole model's weight bytes in its dtype (given, the checkpoint's, or parameters x
    dtype), and which of those it is (plan_capacity's weight_source)."""
    if given is not None:
        return given, "override"
    if spec.weight_bytes is not None:
        return spec.weight_bytes, "checkpoint"
    if spec.num_params is None:
        raise ConfigError(f"{spec.name}: parameter count unknown; pass --weight-bytes")
    return spec.num_params * spec.dtype_bytes, "num_params"


def _quantization_gain(spec: ModelSpec, args: argparse.Namespace, plan: CapacityPlan, **kw: Any) -> dict:
    """The same plan with the weights in the model dtype: what quantising them gains."""
    try:
        base = _plan(spec, args, plan.tp, **kw)
    except DoesNotFitError:
        base = None
    return {
        "method": args.quantization,
        "weight_bytes_per_rank": plan.weight_bytes,
        "unquantized_weight_bytes_per_rank": None if base is None else base.weight_bytes,
        "extra_tokens": plan.max_tokens - (0 if base is None else base.max_tokens),
        "extra_requests": plan.max_concurrency - (0 if base is None else base.max_concurrency),
        "unquantized_fits": base is not None,
    }


def _over_budget(plan: CapacityPlan, f: dict) -> str:
    """Say so where holding every sample request at once exceeds the KV budget (per rank, as
    the figures are): those requests could not all be resident; paging makes them fit or not."""
    over = [k for k in ("naive", "paged") if f[f"{k}_reserved_bytes"] > plan.kv_budget_bytes]
    if not over:
        return ""
    who = " and ".join(over)
    return (
        f" — {who} exceed{'s' * (len(over) == 1)} the {format_bytes(plan.kv_budget_bytes)} KV budget: "
        "these requests would not all fit at once"
    )


def _kib(n: int) -> str:
    """Bytes per token in KiB, as the field quotes them (320 KB for a 70B GQA-8 in FP16)."""
    return f"{n / 1024:,.0f} KiB" if n % 1024 == 0 else f"{n / 1024:,.2f} KiB"


def _quantization_rows(spec: ModelSpec, plan: CapacityPlan, f: dict[str, Any]) -> list[tuple[str, str]]:
    q = f.get("quantization")
    if not q:
        return []
    if not q["unquantized_fits"]:
        return [(f"{q['method']} vs {spec.dtype}", f"in {spec.dtype} one {plan.context_len:,}-token request does not fit")]
    return [(
        f"{q['method']} vs {spec.dtype} weights",
        f"{format_bytes(q['weight_bytes_per_rank'])} vs {format_bytes(q['unquantized_weight_bytes_per_rank'])}: "
        f"+{q['extra_tokens']:,} tokens, +{q['extra_requests']:,} requests @ {plan.context_len:,}",
    )]


def _window_rows(plan: CapacityPlan) -> list[tuple[str, str]]:
    """Sliding-window models: full layers charge every token, sliding ones their window."""
    if not plan.num_sliding_layers:
        return []
    n = plan.context_len
    freeing = "freed" if plan.window_freeing else "kept"
    groups = plan.num_full_groups + plan.num_sliding_groups
    return [
        (
            "layer types",
            f"{plan.num_full_layers} full + {plan.num_sliding_layers} sliding "
            f"(window {plan.sliding_window:,}; blocks outside it {freeing})",
        ),
        (
            "KV bytes / token, per type",
            f"{plan.asymptotic_bytes_per_token:,} B asymptotic (full layers), "
            f"{plan.bytes_per_token_at_context:,.0f} B at {n:,} tokens",
        ),
        (
            f"one {n:,}-token request, window freed / not",
            f"{format_bytes(plan.request_bytes_with_window_freeing)} / "
            f"{format_bytes(plan.request_bytes_without_window_freeing)}",
        ),
        (
            "kvledger's pool",
            f"{groups} KV cache group(s) of {plan.group_size} layers ({plan.num_full_groups} full, "
            f"{plan.num_sliding_groups} sliding); one request holds {plan.blocks_per_request:,} "
            f"blocks = {format_bytes(plan.request_cost_bytes(n))}",
        ),
        (
            f"concurrency @ {n:,}, window freed / not",
            f"{plan.max_concurrency_with_window_freeing:,} / "
            f"{plan.max_concurrency_without_window_freeing:,} requests",
        ),
    ]


def _print_table(spec: ModelSpec, plan: CapacityPlan, f: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"kvledger plan: {spec.name} on {format_bytes(plan.device_memory_bytes)} x {plan.tp}",
        show_header=False,
        caption=f"reserved: KV memory per rank to hold all {f['num_requests']} sample requests at once -- "
        f"naive reserves the full {plan.context_len:,}-token context for each, paged only the blocks each fills",
    )
    t.add_column(style="bold")
    t.add_column()
    n = plan.context_len
    rows = [
        (
            "model",
            f"{spec.num_layers} layers, {spec.num_attention_heads}q/{spec.num_kv_heads}kv "
            f"heads x {spec.head_dim}, {spec.dtype}",
        ),
        (
            "kv dtype / tp",
            f"{plan.kv_dtype}, tp={plan.tp} ({plan.kv_heads_per_rank} kv heads per rank)",
        ),
        (
            "KV bytes / token, model",
            f"{plan.model_bytes_per_token:,} B = {_kib(plan.model_bytes_per_token)}",
        ),
        (
            "KV bytes / token" + (f", per rank (tp={plan.tp})" if plan.tp > 1 else ""),
            f"{plan.bytes_per_token:,} B = data {plan.data_bytes_per_token:,} "
            f"+ scales {plan.scale_bytes_per_token:,}",
        ),
        (
            f"KV bytes / block ({plan.block_size} tok)",
            f"{plan.bytes_per_block:,} B = {format_bytes(plan.bytes_per_block)}",
        ),
        ("weights per rank", f"{format_bytes(plan.weight_bytes)} \\[{plan.weight_source}]"),  # "\\[": a literal bracket, not rich markup
        *_quantization_rows(spec, plan, f),
        (
            "usable memory",
            f"{format_bytes(plan.device_memory_bytes * plan.memory_fraction)} "
            f"({plan.memory_fraction:g} of device)",
        ),
        ("KV budget", format_bytes(plan.kv_budget_bytes)),
        ("blocks / tokens", f"{plan.num_blocks:,} blocks = {plan.max_tokens:,} tokens"),
        (
            f"one {n:,}-token request",
            f"{format_bytes(f['request_cost_bytes'])} "
            f"({plan.blocks_per_request:,} blocks)"
            + (
                f" + {format_bytes(plan.per_request_overhead_bytes)} sink/recent copy"
                if plan.per_request_overhead_bytes
                else ""
            ),
        ),
        (
            f"max concurrency @ {n:,}",
            f"{plan.max_concurrency:,} request" + "s" * (plan.max_concurrency != 1),
        ),
        *_window_rows(plan),
        (
            "utilisation, naive / paged",
            f"{f['naive_utilization']:.1%} / "
            f"{f['paged_utilization']:.1%} ({f['num_requests']} {f['lengths_source']} lengths)",
        ),
        (
            f"reserved for all {f['num_requests']} at once, naive / paged",
            f"{format_bytes(f['naive_reserved_bytes'])} / "
            f"{format_bytes(f['paged_reserved_bytes'])}" + _over_budget(plan, f),
        ),
        *[
            (f"prefix-cache {name} tier", f"{format_bytes(r['bytes'])}: {r['blocks']:,} blocks = {r['tokens']:,} tokens")
            for name, r in f.get("tiers", {}).items() if r["bytes"]
        ],
    ]
    for row in rows:
        t.add_row(*row)
    h = Table(title="KV heads: the same model with MHA / GQA / MQA")
    cols = ["scheme", "kv heads", "KV / token, model"]
    if plan.tp > 1:
        cols.append(f"per rank (tp={plan.tp})")
    for col in [*cols, f"concurrency @ {n:,}"]:
        h.add_column(col, justify="left" if col == "scheme" else "right")
    for r in f["heads_comparison"]:
        per_rank = [_kib(r["bytes_per_token"])] if plan.tp > 1 else []
        h.add_row(
            r["scheme"] + (" (this model)" if r["this_model"] else ""),
            str(r["num_kv_heads"]),
            _kib(r["model_bytes_per_token"]),
            *per_rank,
            f"{r['max_concurrency']:,}",
        )
    console = Console()
    console.print(t)
    console.print(h)
