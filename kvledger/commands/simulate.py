"""`kvledger simulate`: replay a workload through the engine's scheduler on a virtual clock.

The scheduler and KV cache manager are the engine's own; a step-time model stands in for the
model, so a 70B deployment on GPUs can be studied from a laptop. Prints a table (or --json)
of throughput, latency, preemptions, and paged vs naive KV utilisation; --plot draws the run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvledger.errors import ConfigError
from kvledger.ledger.accounting import KV_DTYPE_BYTES, parse_size

JSON_KEYS = (
    "kv_utilization",
    "naive_kv_utilization",
    "throughput_tokens_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "ttft_p50_s",
    "num_preemptions",
    "peak_running",
    "duration_s",
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a workload through the scheduler with a step-time model",
        description="Trace-driven simulation over kvledger's own Scheduler and KVCacheManager: "
        "requests arrive on a virtual clock, each step is priced by a cost model "
        "(a + b*tokens + c*context + d*attended pairs, + swap bytes / bandwidth). "
        "Workload: --trace FILE.jsonl, or synthetic (--num-requests, --arrival-rate, "
        "--prompt-len, --output-len). Length distributions: N | a-b | lognormal:MEDIAN,SIGMA | "
        "high-variance (90% 16-64 / 10% 256-512).",  # a description is not %-formatted
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace", help="JSONL rows {arrival_time, prompt_len, output_len[, prefix_id, prefix_len]}"
    )
    w.add_argument(
        "--num-requests", type=int, default=256, help="synthetic requests (default: 256)"
    )
    w.add_argument(
        "--arrival-rate",
        type=float,
        help="Poisson arrivals, requests/s (default: all arrive at t = 0)",
    )
    w.add_argument("--prompt-len", default="lognormal:256,1.0", help="default: lognormal:256,1.0")
    w.add_argument("--output-len", default="lognormal:128,1.0", help="default: lognormal:128,1.0")
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of one system prompt prepended to every synthetic prompt (default: 0)",
    )
    w.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default: 0)")
    w.add_argument("--save-trace", help="write the workload as JSONL (to replay with --trace)")

    m = p.add_argument_group("model and memory")
    m.add_argument("--model", default="seed-70b", help="preset or model folder (default: seed-70b)")
    m.add_argument("--kv-dtype", default="auto", choices=["auto", *KV_DTYPE_BYTES])
    m.add_argument(
        "--tp", type=int, help="tensor-parallel ranks (default: smallest of 1/2/4/8 that fits)"
    )
    m.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (overrides the plan)")
    m.add_argument("--device-memory", default="80GiB", help="per device (default: 80GiB)")
    m.add_argument("--memory-fraction", type=float, default=0.9, help="default: 0.9")
    m.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    m.add_argument("--max-model-len", type=int, help="context (default: the model's max positions)")
    m.add_argument("--swap-space", type=float, default=4.0, help="host swap pool, GiB (default: 4)")
    m.add_argument("--no-prefix-caching", action="store_true", help="disable prefix sharing")
    m.add_argument(
        "--kv-offload-host-bytes", default="0",
        help="host-memory tier of the prefix cache, e.g. 64GiB: evicted prefix blocks are kept and "
        "loaded back at the cost model's host bandwidth (default: 0, none)",
    )  # fmt: skip
    m.add_argument(
        "--kv-offload-disk-bytes", default="0",
        help="disk tier of the prefix cache, loaded at the cost model's disk_bandwidth (default: 0)",
    )  # fmt: skip

    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=256, help="default: 256")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="default: 2048")
    s.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    s.add_argument(
        "--victim-policy", default="remaining", choices=["remaining", "fcfs", "priority"]
    )
    s.add_argument("--watermark-blocks", type=int, default=0, help="default: 0")
    s.add_argument(
        "--static-batch",
        type=int,
        help="static batching baseline: admit N at once, nothing new until all N finish",
    )

    c = p.add_argument_group("cost model")
    c.add_argument(
        "--cost-model",
        help="cpu-measured (times the real engine on --model), a100-80gb-70b, h100-80gb-70b, or a "
        "JSON file with a, b, c[, d, swap_bandwidth] (default: cpu-measured for a folder, "
        "h100-80gb-70b for a preset)",
    )
    c.add_argument("--save-cost-model", help="write the cost model's coefficients as JSON")
    c.add_argument(
        "--swap-bandwidth", help="bytes/s per direction, e.g. 25GB (default: the cost model's)"
    )

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the figures as JSON")
    o.add_argument("--naive", action="store_true", help="also report naive contiguous allocation")
    o.add_argument(
        "--naive-max-seq-len", type=int, help="naive reservation (default: max-model-len)"
    )
    o.add_argument("--plot", help="write a PNG of memory, utilisation, queues and preemptions")
    o.add_argument(
        "--html",
        help="write the dashboard's views of the run (block map, totals, requests, time series, "
        "with a time slider) as one self-contained HTML file",
    )


def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise ConfigError(f"{name} must be >= 1, got {v}")


def build_setup(args: argparse.Namespace):
    from kvledger.sim.setup import SimSetup

    for name in ("num_kv_blocks", "tp", "max_model_len", "static_batch", "naive_max_seq_len"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    bw = None
    if args.swap_bandwidth is not None:
        bw = parse_size(args.swap_bandwidth)
        if bw <= 0:
            raise ConfigError("--swap-bandwidth must be > 0 bytes/s")
    return SimSetup(
        model=args.model,
        kv_dtype=args.kv_dtype,
        tp=args.tp,
        num_kv_blocks=args.num_kv_blocks,
        device_memory=parse_size(args.device_memory),
        memory_fraction=args.memory_fraction,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        cost_model=args.cost_model,
        swap_bandwidth=bw,
        scheduler={
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "preemption_mode": args.preemption_mode,
            "victim_policy": args.victim_policy,
            "watermark_blocks": args.watermark_blocks,
        },
        cache={"swap_space": args.swap_space, "enable_prefix_caching": not args.no_prefix_caching},
        static_batch=args.static_batch,
        naive_max_seq_len=args.naive_max_seq_len,
        tier_bytes=(parse_size(args.kv_offload_host_bytes), parse_size(args.kv_offload_disk_bytes)),
    )


def build_trace(args: argparse.Namespace, max_prompt_len: int):
    from kvledger.sim.trace import load_trace, synthetic_trace

    if args.trace:
        return load_trace(args.trace)
    return synthetic_trace(
        args.num_requests,
        args.prompt_len,
        args.output_len,
        arrival_rate=args.arrival_rate,
        seed=args.seed,
        shared_prefix_len=args.shared_prefix_len,
        max_prompt_len=max_prompt_len,
    )


def run(args: argparse.Namespace) -> int:
    from kvledger.sim.trace import write_trace

    if args.html:
        from kvledger.sim.html import check_html_path

        check_html_path(args.html)
    setup = build_setup(args)
    setup.resolve()
    trace = build_trace(args, setup.max_model_len - 1)
    if args.save_trace:
        write_trace(trace, args.save_trace)
    if args.save_cost_model:
        setup.resolved_cost_model.save(args.save_cost_model)
    if args.html:
        result = _run_recorded(setup, trace, args)
    else:
        result = setup.run(trace)
    summary = {**setup.describe(), **result.summary()}
    if args.plot:
        from kvledger.sim.plot import plot_timeline

        label = f"static batch {args.static_batch}" if args.static_batch else "continuous"
        plot_timeline(result, args.plot, f"kvledger simulate: {summary['model']}, {label}")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_table(summary, args.naive)
    return 0


def _run_recorded(setup, trace, args: argparse.Namespace):
    """The run, with the dashboard's frames recorded along the way, written to --html."""
    from kvledger.sim.html import FrameRecorder, write_html

    sim = setup.simulator(trace)
    recorder = FrameRecorder(
        sim,
        kv_cache_dtype=setup.kv_dtype,
        reference_bytes_per_token=_reference_bytes_per_token(setup),
    )
    result = sim.run(recorder)
    summary = {**setup.describe(), **result.summary()}
    end = max((s.time + s.duration for s in result.steps), default=0.0)
    label = f"static batch {args.static_batch}" if args.static_batch else "continuous batching"
    tput = summary["throughput_tokens_per_s"]
    naive = summary["naive_kv_utilization"]
    subtitle = (
        f"{summary['num_finished']}/{summary['num_requests']} requests, {label}, "
        f"{_fmt(tput, ' output tok/s', '.0f')}, KV utilisation paged "
        f"{_fmt(summary['kv_utilization'], '', '.1%')} vs naive {_fmt(naive, '', '.1%')} "
        f"(cost model {summary['cost_model']['name']})"
    )
    title = f"kvledger simulate: {summary['model']} (tp {summary['tp']}, KV {setup.kv_dtype})"
    write_html(recorder.recording(end, title, subtitle, summary), args.html)
    return result


def _fmt(x: float | None, unit: str = "", spec: str = ".3g") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def _print_table(f: dict[str, Any], naive: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvledger simulate: {f['model']} (tp {f['tp']})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    cm = f["cost_model"]
    pre = f["num_preemptions"]
    rows = [
        (
            "KV pool",
            f"{f['num_kv_blocks']:,} blocks x {f['block_size']} tokens, "
            f"{f['bytes_per_token']:,} B/token per rank ({f['capacity']})",
        ),
        (
            "cost model",
            f"{cm['name']}: a={cm['a'] * 1e3:.3g} ms, b={cm['b'] * 1e6:.3g} us/token, "
            f"c={cm['c'] * 1e9:.3g} ns/ctx token, d={cm['d'] * 1e9:.3g} ns/pair, "
            f"swap {cm['swap_bandwidth'] / 1e9:.3g} GB/s",
        ),
        (
            "requests",
            f"{f['num_finished']}/{f['num_requests']} finished in {f['num_steps']:,} steps"
            + (f", static batches of {f['static_batch']}" if f["static_batch"] else ""),
        ),
        ("duration", _fmt(f["duration_s"], " s")),
        (
            "throughput",
            f"{_fmt(f['throughput_tokens_per_s'], ' output tok/s', '.1f')}, "
            f"{_fmt(f['total_tokens_per_s'], ' total tok/s', '.1f')}",
        ),
        (
            "latency p50 / p99",
            f"{_fmt(f['latency_p50_s'], ' s')} / {_fmt(f['latency_p99_s'], ' s')}",
        ),
        ("TTFT p50 / p99", f"{_fmt(f['ttft_p50_s'], ' s')} / {_fmt(f['ttft_p99_s'], ' s')}"),
        ("peak running", str(f["peak_running"])),
        ("preemptions", f"{pre['total']} (swap {pre['swap']}, recompute {pre['recompute']})"),
        (
            "KV utilisation (paged)",
            f"{f['kv_utilization']:.1%} of slots in used blocks hold tokens",
        ),
        ("pool usage (mean)", _fmt(f["kv_usage_mean"], "", ".1%")),
        ("prefix cache hit rate", f"{f['prefix_cache_hit_rate']:.1%}"),
    ]
    if naive:
        rows.append(
            (
                "KV utilisation (naive)",
                f"{f['naive_kv_utilization']:.1%}: tokens / (resident requests x "
                f"{f['naive_max_seq_len']}), contiguous max-length reservation",
            )
        )
        per = f["naive_max_seq_len"] * f["bytes_per_token"]
        rows.append(
            (
                "naive concurrency",
                f"{f['kv_pool_bytes'] // per} requests fit the same pool at max_seq_len "
                f"(paged peak: {f['peak_running']})",
            )
        )
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def _reference_bytes_per_token(setup) -> int:
    """KV bytes per pool slot in the model dtype (a KV cache group's layers for hybrid models)."""
    from kvledger.ledger.accounting import kv_bytes_per_token
    from kvledger.ledger.kv_cache_groups import kv_cache_layout

    total = kv_bytes_per_token(setup.spec, "auto", setup.tp).total
    layout = kv_cache_layout(setup.spec.layer_windows)
    if not layout.is_hybrid:
        return total
    return total // setup.spec.num_layers * layout.group_size
