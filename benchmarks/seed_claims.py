"""The seed articles' claims, each beside kvledger's own figure (ledger, simulator, real engine).

1. naive allocation 25-40% (seed 2: 60-70%) vs paged >= 95% KV utilisation
2. prefix sharing, 1200-token system prompt x 64 requests on the 70B: 24 GB -> 0.4 GB
3. continuous vs static batching, high-variance lengths: 3.4x throughput, p50 ~ same, p99 -40%
4. swap (PCIe 4.0, 25 GB/s) vs recompute: recompute below ~1000 tokens
5. GQA-8 / MQA vs MHA bytes per token; int8 KV on top of GQA-8: 1/16 of MHA fp16
6. paged vs contiguous decode attention: +5-10% (seed 2, section 四), kernels and end to end
7. quantised-KV error accumulating over 1,000+ generated tokens; the full-precision window
8. int8 KV "within 0.1%" (seed 2) / "less than 0.5 points" (seed 1), on two text domains

Simulations use the engine's own Scheduler/KVCacheManager with the datasheet cost model of
the seed's 70B on 2 x H100 (tp 2; 140 GB of fp16 weights do not fit one 80 GB card). The CPU
rows run the real engine on a random-weight Llama (4 layers, hidden 256) built in a temp dir.

    python -m benchmarks.seed_claims                 # everything, writes docs/seed_claims.md
    python -m benchmarks.seed_claims --skip-engine   # ledger + simulation only (~1 min)
    python -m benchmarks.seed_claims --quick         # claims 6-8 in their short form
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, machine_info, percentile, print_header
from kvledger.ledger.accounting import (
    GB,
    GiB,
    kv_bytes_per_token,
    plan_capacity,
    prefix_sharing_savings,
)
from kvledger.ledger.spec import PRESETS
from kvledger.sim.cost_model import FLOP_EFFICIENCY, GPUS, MEM_EFFICIENCY, STEP_OVERHEAD_S
from kvledger.sim.plot import plot_timeline
from kvledger.sim.setup import SimSetup
from kvledger.sim.trace import TraceRequest, synthetic_trace

LOAD_AT_START = os.getloadavg()[0]
DOCS = REPO_ROOT / "docs"
IMG = DOCS / "img"
SPEC = PRESETS["seed-70b"]
ROWS: list[dict[str, str]] = []
DETAILS: dict[str, Any] = {}


def row(claim: str, seed: str, kvledger: str, note: str) -> None:
    ROWS.append({"claim": claim, "seed": seed, "kvledger": kvledger, "note": note})
    print(f"  {claim}: seed {seed} | kvledger {kvledger}")


def gpu_setup(gpu: str = "h100-80gb-70b", **kw: Any) -> SimSetup:
    s = SimSetup(model="seed-70b", cost_model=gpu, **kw)
    s.resolve()
    return s


def pct(x: float) -> str:
    return f"{x:.1%}"


# ----------------------------------------------------------------------- 1. utilisation
def claim_utilisation() -> None:
    print("\n[1] naive vs paged KV utilisation (seed-70b, 2 x H100, simulated)")
    trace = synthetic_trace(
        400, "lognormal:256,1.0", "lognormal:128,1.0", arrival_rate=3.0, seed=0, max_prompt_len=4095
    )
    setup = gpu_setup()
    res = setup.run(trace)
    s = res.summary()
    plot_timeline(
        res, IMG / "seed_utilisation.png", "claim 1: seed-70b on 2 x H100, Poisson 3 req/s"
    )
    mean_len = sum(st.naive_tokens for st in res.steps) / max(
        1, sum(st.num_resident for st in res.steps)
    )
    DETAILS["utilisation"] = {
        k: s[k] for k in ("kv_utilization", "naive_kv_utilization", "kv_usage_mean")
    }
    row(
        "1. KV utilisation, naive",
        "25-40% (seed 2: 60-70%)",
        f"{pct(s['naive_kv_utilization'])} (max_seq_len 4096)",
        f"simulated: 400 requests, prompt lognormal median 256 / output median 128 (sigma 1), "
        f"Poisson 3 req/s; resident requests average {mean_len:.0f} tokens, and naive = "
        "mean length / max_seq_len, so the figure is set by the length mix, not the allocator",
    )
    row(
        "1. KV utilisation, paged",
        ">= 95% (seed 2)",
        f"{pct(s['kv_utilization'])}",
        f"same run, time-averaged tokens stored / slots in used 16-token blocks (< 1 block "
        f"wasted per request); pool usage {pct(s['kv_usage_mean'])}",
    )


# ----------------------------------------------------------------------- 2. prefix sharing
def claim_prefix() -> None:
    print("\n[2] prefix sharing: 1200-token system prompt x 64 requests")
    led = prefix_sharing_savings(SPEC, 1200, 64)
    row(
        "2. prefix KV, 1200 x 64, ledger",
        "24 GB -> 0.4 GB",
        f"{led['gb_without_sharing']:.1f} GB ({led['gib_without_sharing']:.1f} GiB) -> "
        f"{led['gb_with_sharing']:.2f} GB",
        f"prefix_sharing_savings: 64 x 1200 x 327,680 B vs 75 shared blocks; x{led['ratio']:.0f}",
    )
    trace = synthetic_trace(64, "16-64", "64-128", seed=0, shared_prefix_len=1200)
    out = {}
    for caching in (True, False):
        setup = gpu_setup(scheduler={"max_num_seqs": 64}, cache={"enable_prefix_caching": caching})
        res = setup.run(trace)
        out[caching] = (setup, res, res.summary())
    setup, res, on = out[True]
    off = out[False][2]
    plot_timeline(
        res, IMG / "seed_prefix_sharing.png", "claim 2: 64 requests sharing a 1200-token prefix"
    )
    bpb_model = kv_bytes_per_token(SPEC).total * 16  # both ranks together
    shared_gb = on["peak_shared_blocks"] * bpb_model / GB
    holders = on["peak_sharers"]
    copies_gb = holders * on["peak_shared_blocks"] * bpb_model / GB
    DETAILS["prefix"] = {"on": on, "off": off}
    row(
        "2. prefix KV, 1200 x 64, simulated",
        "24 GB -> 0.4 GB",
        f"{on['peak_shared_blocks']} blocks = {shared_gb:.2f} GB (both cards) held by {holders} "
        f"requests at once, in place of {copies_gb:.1f} GB of copies",
        f"64 requests at t=0, 1200 + 16-64 prompt tokens, 64-128 output; the one missing request "
        f"was prefilled in the same step as the first, before its blocks were cached. Hit rate "
        f"{pct(on['prefix_cache_hit_rate'])}; without caching the same pool "
        f"runs {off['peak_running']} at once instead of {on['peak_running']}, "
        f"{off['throughput_tokens_per_s']:.0f} vs {on['throughput_tokens_per_s']:.0f} output tok/s",
    )


# ----------------------------------------------------------------------- 3. batching
def _latency_cdf(runs: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, lat in runs.items():
        xs = sorted(lat)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def claim_batching_sim() -> None:
    print("\n[3] continuous vs static batching (seed-70b, 2 x H100, simulated)")
    trace = synthetic_trace(512, "32-256", "high-variance", seed=0)
    res = {}
    for name, static in (("continuous", None), ("static", 32)):
        setup = gpu_setup(scheduler={"max_num_seqs": 32}, static_batch=static)
        r = setup.run(trace)
        res[name] = (r, r.summary())
        plot_timeline(
            r, IMG / f"seed_{name}.png", f"claim 3: {name} batching, 32 seats, 512 requests"
        )
    c, s = res["continuous"][1], res["static"][1]
    lat = {n: [q.latency for q in r.requests] for n, (r, _) in res.items()}
    # Online: Poisson arrivals at 80% of what static batching sustains offline.
    rate = 0.8 * s["requests_per_s"]
    online_trace = synthetic_trace(512, "32-256", "high-variance", arrival_rate=rate, seed=1)
    on = {
        name: gpu_setup(scheduler={"max_num_seqs": 32}, static_batch=static)
        .run(online_trace)
        .summary()
        for name, static in (("continuous", None), ("static", 32))
    }
    _latency_cdf(
        lat,
        IMG / "seed_batching_latency.png",
        "claim 3: offline, 512 requests, 32 seats (simulated 2 x H100)",
    )
    DETAILS["batching_sim"] = {
        "offline": {"continuous": c, "static": s},
        "online": on,
        "rate": rate,
    }
    row(
        "3. continuous / static throughput (sim)",
        "3.4x",
        f"{c['throughput_tokens_per_s'] / s['throughput_tokens_per_s']:.2f}x",
        f"512 requests at t=0, prompts 32-256, outputs 90% 16-64 / 10% 256-512, 32 seats both; "
        f"{c['throughput_tokens_per_s']:.0f} vs {s['throughput_tokens_per_s']:.0f} output tok/s",
    )
    row(
        "3. latency p50 / p99 (sim, offline)",
        "p50 ~ same, p99 -40%",
        f"p50 {c['latency_p50_s']:.1f} vs {s['latency_p50_s']:.1f} s "
        f"({c['latency_p50_s'] / s['latency_p50_s'] - 1:+.0%}), p99 {c['latency_p99_s']:.1f} vs "
        f"{s['latency_p99_s']:.1f} s ({c['latency_p99_s'] / s['latency_p99_s'] - 1:+.0%})",
        "continuous vs static; with everything queued at t=0 both percentiles are queueing time",
    )
    oc, os_ = on["continuous"], on["static"]
    row(
        f"3. latency p50 / p99 (sim, Poisson {rate:.1f} req/s)",
        "p50 ~ same, p99 -40%",
        f"p50 {oc['latency_p50_s']:.1f} vs {os_['latency_p50_s']:.1f} s "
        f"({oc['latency_p50_s'] / os_['latency_p50_s'] - 1:+.0%}), p99 {oc['latency_p99_s']:.1f} vs "
        f"{os_['latency_p99_s']:.1f} s ({oc['latency_p99_s'] / os_['latency_p99_s'] - 1:+.0%})",
        f"online at 80% of static's offline capacity; throughput equals the arrival rate for both "
        f"({oc['requests_per_s']:.2f} vs {os_['requests_per_s']:.2f} req/s)",
    )


def build_cpu_model(path: Path) -> Path:
    """Random-weight Llama, 4 layers x hidden 256 (GQA 4/2), vocab 1024, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.common import build_trivial_tokenizer

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(str(path), safe_serialization=True)
    build_trivial_tokenizer(path, vocab_size=1024)
    return path


def cpu_workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    from kvledger.sim.trace import LengthDist

    rng = random.Random(seed)
    plen, olen = LengthDist.parse("16-64"), LengthDist.parse("high-variance")
    lens = [(plen.sample(rng), olen.sample(rng)) for _ in range(n)]
    prompts = [[rng.randrange(3, 1024) for _ in range(p)] for p, _ in lens]
    return prompts, [o for _, o in lens]


def claim_batching_engine(model: Path, n: int, seats: int) -> None:
    print(
        f"\n[3] continuous vs static batching on the real engine (CPU, {n} requests, {seats} seats)"
    )
    from kvledger import LLM, SamplingParams
    from kvledger.sim.cost_model import calibrate_cpu

    llm = LLM(
        str(model),
        max_num_seqs=seats,
        enable_prefix_caching=False,
        preemption_mode="recompute",
        calibrate_preemption=False,
    )
    eng = llm.engine
    prompts, outs = cpu_workload(n, seed=0)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    llm.generate(prompts[:seats], params[:seats], use_tqdm=False)  # warm-up

    def measure(static: bool) -> dict[str, Any]:
        t0 = time.monotonic()
        results = []
        if static:
            for i in range(0, n, seats):
                results += llm.generate(
                    prompts[i : i + seats], params[i : i + seats], use_tqdm=False
                )
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - t0
        lat = [r.metrics.finished_time - t0 for r in results]
        ttft = [r.metrics.first_token_time - t0 for r in results]
        toks = sum(len(r.outputs[0].token_ids) for r in results)
        return {
            "wall_s": wall,
            "throughput_tokens_per_s": toks / wall,
            "latency_p50_s": percentile(lat, 50),
            "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50),
            "latencies": lat,
        }

    real = {"static": measure(True), "continuous": measure(False)}
    print("  calibrating the cpu-measured cost model on the same model ...")
    cm = calibrate_cpu(str(model), max_prompt=256)
    trace = [TraceRequest(0.0, len(p), o) for p, o in zip(prompts, outs)]
    sim = {}
    for name, static in (("static", seats), ("continuous", None)):
        setup = SimSetup(
            model=str(model),
            cost_model=cm,
            num_kv_blocks=eng.kv.pool.num_blocks,
            max_model_len=eng.max_model_len,
            scheduler={"max_num_seqs": seats, "preemption_mode": "recompute"},
            cache={"enable_prefix_caching": False},
            static_batch=static,
        )
        sim[name] = setup.run(trace).summary()
    rc, rs = real["continuous"], real["static"]
    DETAILS["batching_engine"] = {
        "real": {k: {kk: vv for kk, vv in v.items() if kk != "latencies"} for k, v in real.items()},
        "sim_cpu_measured": sim,
        "cost_model": cm.to_dict(),
    }
    _latency_cdf(
        {f"{k} (real engine)": v["latencies"] for k, v in real.items()},
        IMG / "seed_batching_latency_cpu.png",
        f"claim 3 on the real engine: {n} requests, {seats} seats, CPU",
    )
    ratio = rc["throughput_tokens_per_s"] / rs["throughput_tokens_per_s"]
    sim_ratio = (
        sim["continuous"]["throughput_tokens_per_s"] / sim["static"]["throughput_tokens_per_s"]
    )
    row(
        "3. continuous / static throughput (real engine, CPU)",
        "3.4x",
        f"{ratio:.2f}x ({rc['throughput_tokens_per_s']:.0f} vs {rs['throughput_tokens_per_s']:.0f} tok/s)",
        f"{n} requests, prompts 16-64, outputs 90% 16-64 / 10% 256-512, {seats} seats; "
        f"simulator with the cpu-measured model (fit error {cm.fit['median_abs_rel_error']:.0%}) "
        f"predicts {sim_ratio:.2f}x",
    )
    row(
        "3. latency p50 / p99 (real engine, CPU)",
        "p50 ~ same, p99 -40%",
        f"p50 {rc['latency_p50_s']:.1f} vs {rs['latency_p50_s']:.1f} s "
        f"({rc['latency_p50_s'] / rs['latency_p50_s'] - 1:+.0%}), p99 {rc['latency_p99_s']:.1f} vs "
        f"{rs['latency_p99_s']:.1f} s ({rc['latency_p99_s'] / rs['latency_p99_s'] - 1:+.0%})",
        f"all submitted at t=0; simulator predicts p50 {sim['continuous']['latency_p50_s']:.1f} vs "
        f"{sim['static']['latency_p50_s']:.1f} s, p99 {sim['continuous']['latency_p99_s']:.1f} vs "
        f"{sim['static']['latency_p99_s']:.1f} s",
    )


# ----------------------------------------------------------------------- 4. swap vs recompute
def roofline_crossover(gpu: str, batch: int = 64, ctx: int = 1000, swap_bw: float = 25e9) -> dict:
    """Recompute of n tokens riding in a decode step of ``batch`` requests x ``ctx`` tokens, with
    step time = max(bytes / bandwidth, FLOPs / peak): prefill tokens are free while the step is
    memory-bound. Returns where recompute stops being free and where swap becomes cheaper."""
    g, tp = GPUS[gpu], 2
    kv = kv_bytes_per_token(SPEC, "auto", tp).total
    w, p = SPEC.num_params * 2 / tp, SPEC.num_params / tp
    pair = 4 * SPEC.num_layers * SPEC.num_attention_heads / tp * SPEC.head_dim
    mem, fl = MEM_EFFICIENCY * g.hbm_bytes_per_s, FLOP_EFFICIENCY * g.bf16_flops

    def times(n: int) -> tuple[float, float]:
        byt = w + kv * (batch * ctx + n)
        flops = 2 * p * (batch + n) + pair * (batch * ctx + n * (n + 1) / 2)
        return byt / mem, flops / fl

    def step(n: int) -> float:
        return max(times(n)) + STEP_OVERHEAD_S

    def swap(n: int) -> float:
        return 1e-4 + 2 * n * kv / swap_bw

    free = next(n for n in range(1, 100_000) if times(n)[1] > times(n)[0]) - 1  # memory-bound
    cross = next(n for n in range(1, 100_000) if swap(n) < step(n) - step(0))
    # the effective swap bandwidth at which 1000 tokens would be the crossover
    marginal = step(1000) - step(0)
    bw_1000 = 2 * 1000 * kv / (marginal - 1e-4)
    return {"free_until": free, "crossover": cross, "swap_bw_for_1000": bw_1000}


def claim_crossover(model: Path | None) -> None:
    print("\n[4] swap vs recompute crossover")
    bpt = kv_bytes_per_token(SPEC, "auto", 2).total
    out: dict[str, Any] = {}
    for gpu in ("h100-80gb-70b", "a100-80gb-70b"):
        cm = gpu_setup(gpu).resolved_cost_model
        pcm = cm.preemption_cost_model()
        lin = pcm.crossover_tokens(bpt)
        roof = roofline_crossover(gpu.removesuffix("-70b"))
        per_tok_swap = 2 * bpt / cm.swap_bandwidth
        per_tok_rec = pcm.prefill_coeffs[1]
        out[gpu] = {
            "linear": lin,
            "roofline": roof,
            "swap_s_per_token": per_tok_swap,
            "recompute_s_per_token": per_tok_rec,
        }
        row(
            f"4. crossover, 70B on {gpu.split('-')[0].upper()} tp 2 (sim)",
            "recompute < ~1000 tokens",
            f"linear model: swap cheaper from {lin} token(s); roofline: recompute < "
            f"{roof['crossover']} tokens",
            f"swap out+in {per_tok_swap * 1e6:.0f} us/token at 25 GB/s vs recompute "
            f"{per_tok_rec * 1e6:.0f} us/token; in a 64 x 1000-token decode step recompute is free "
            f"up to {roof['free_until']} tokens (memory-bound). A 1000-token crossover needs swap "
            f"at ~{roof['swap_bw_for_1000'] / 1e9:.1f} GB/s effective",
        )
    # throughput with forced modes under memory pressure
    sims = {}
    for length in (128,):
        trace = synthetic_trace(64, str(length), "64-256", seed=0)
        r = {}
        for mode in ("swap", "recompute"):
            setup = gpu_setup(
                num_kv_blocks=max(400, (length + 300) // 16 * 4),
                scheduler={"max_num_seqs": 64, "preemption_mode": mode},
                cache={"swap_space": 64},
            )
            r[mode] = setup.run(trace).summary()
        sims[length] = r
        row(
            f"4. forced swap vs recompute, prompt {length} (sim, H100)",
            "recompute better when short (< 1000)",
            f"{r['swap']['throughput_tokens_per_s']:.0f} vs {r['recompute']['throughput_tokens_per_s']:.0f} tok/s",
            f"64 requests, pool squeezed to force {r['swap']['num_preemptions']['total']} / "
            f"{r['recompute']['num_preemptions']['total']} preemptions (all-swap vs all-recompute); "
            "the linear step model charges recompute b per token, so swap wins",
        )
    out["forced"] = {
        k: {
            m: {"tok_s": v["throughput_tokens_per_s"], "pre": v["num_preemptions"]}
            for m, v in r.items()
        }
        for k, r in sims.items()
    }
    if model is not None:
        from kvledger import LLM

        eng = LLM(str(model), swap_space=0.5).engine  # preemption_mode auto -> start-up calibration
        cm = eng.cost_model
        x = cm.crossover_tokens(eng.bytes_per_token)
        calibrated = getattr(eng, "calibration", None) is not None
        out["cpu"] = {
            "cost_model": cm.to_dict(),
            "crossover": x,
            "bytes_per_token": eng.bytes_per_token,
            "calibration": getattr(eng, "calibration", None),
        }
        row(
            "4. crossover, this CPU (engine start-up calibration)",
            "recompute < ~1000 tokens",
            "swap always cheaper"
            if x == 1
            else ("recompute always cheaper" if x is None else f"swap cheaper from {x} tokens"),
            f"{'calibrated' if calibrated else 'UNCALIBRATED defaults'}: memcpy {cm.swap_bandwidth / 1e9:.1f} GB/s + "
            f"{cm.swap_fixed_s * 1e6:.0f} us/swap vs prefill {cm.prefill_coeffs[1] * 1e6:.1f} us/token "
            f"(+{cm.prefill_coeffs[2] * 1e9:.2f} ns/token^2); {eng.bytes_per_token:,} B/token",
        )
    DETAILS["crossover"] = out


# ----------------------------------------------------------------------- 5. bytes per token
def claim_bytes() -> None:
    print("\n[5] KV bytes per token (seed-70b variants)")
    mha = kv_bytes_per_token(PRESETS["seed-70b-mha"]).total
    gqa = kv_bytes_per_token(SPEC).total
    mqa = kv_bytes_per_token(PRESETS["seed-70b-mqa"]).total
    q8 = kv_bytes_per_token(SPEC, "int8")
    row(
        "5. MHA fp16",
        "2560 KB",
        f"{mha:,} B = {mha / 1024:.0f} KiB",
        "2 x 80 layers x 64 heads x 128 x 2 B",
    )
    row(
        "5. GQA-8 fp16",
        "320 KB (1/8)",
        f"{gqa:,} B = {gqa / 1024:.0f} KiB (1/{mha / gqa:.0f})",
        "the seed's 70B",
    )
    row("5. MQA fp16", "40 KB", f"{mqa:,} B = {mqa / 1024:.0f} KiB (1/{mha / mqa:.0f})", "")
    row(
        "5. GQA-8 + int8",
        "1/16 of MHA fp16",
        f"{q8.total:,} B = 1/{mha / q8.total:.2f}",
        f"{q8.data_bytes:,} B of int8 data + {q8.scale_bytes:,} B of fp16 per-head scales (K and V), "
        "so slightly more than 1/16",
    )
    one = 4096 * gqa
    plan = plan_capacity(SPEC, 80 * GiB, 0.9, tp=2, context_len=4096)
    row(
        "0. one 4096-token request / concurrency",
        "1.28 GB; 3-4 concurrent",
        f"{one / GB:.2f} GB ({one / GiB:.2f} GiB); {plan.max_concurrency} concurrent",
        f"2 x 80 GiB at 0.9, tp 2: {plan.kv_budget_bytes / GB:.1f} GB of KV per card, and each "
        "card holds only its 4 KV heads (half of every token), so 2x the seed's count per pair",
    )


# ----------------------------------------------------------------------- 6-8. seed 2, section 四
def claim_paging(quick: bool) -> None:
    print("\n[6] the price of indirection: paged vs contiguous decode attention")
    from benchmarks import seed_paging

    res = seed_paging.run(quick)
    seed_paging.plot(res["kernel"], IMG / "seed_paging.png")
    DETAILS["paging"] = res
    for r in seed_paging.claim_rows(res):
        row(*r)


def claim_drift(quick: bool) -> None:
    print("\n[7] quantised-KV error over long generations (teacher forcing)")
    from benchmarks import seed_drift

    res = seed_drift.run(quick)
    seed_drift.plot(res["results"], IMG / "seed_drift.png")
    DETAILS["drift"] = res
    for r in seed_drift.claim_rows(res):
        row(*r)


def claim_int8_phrasing() -> None:
    print("\n[8] int8 KV: within 0.1% / under 0.5 points, two text domains")
    from benchmarks import seed_int8_quality

    res = seed_int8_quality.run()
    DETAILS["int8_phrasing"] = res
    for r in seed_int8_quality.claim_rows(res):
        row(*r)


# ----------------------------------------------------------------------- report
def write_markdown(path: Path, elapsed: float, skip_engine: bool) -> None:
    m = machine_info()
    lines = [
        "# The seeds' claims, measured",
        "",
        "Generated by `benchmarks/seed_claims.py`; every figure below comes from kvledger's ledger, "
        "its simulator (the engine's own Scheduler and KVCacheManager on a virtual clock) or "
        "the real engine.",
        "",
        "- command: `" + " ".join(["python -m benchmarks.seed_claims", *sys.argv[1:]]) + "`",
        f"- machine: {m['cpu_model']}, {m['cores']} cores, {m.get('mem_gib', '?')} GiB, "
        f"Python {m['python']}"
        + (f", torch {m['torch']} ({m['torch_threads']} threads)" if "torch" in m else ""),
        f"- load average at start: {LOAD_AT_START:.1f} (the machine is shared; real-engine rows "
        "run with 1 torch thread, see --threads)",
        f"- run time: {elapsed:.0f} s" + (" (real-engine rows skipped)" if skip_engine else ""),
        "- GPU rows are simulated: seed-70b (80 layers, GQA-8, fp16, 140 GB) on 2 x H100-80GB, tp 2, "
        "2,788 blocks of 16 tokens per card (`kvledger plan`), cost model from datasheet "
        "bandwidth/FLOPs (`kvledger/sim/cost_model.py`, `gpu_cost_model`).",
        "",
        "| claim | seed | kvledger | note |",
        "|---|---|---|---|",
    ]
    for r in ROWS:
        lines.append(f"| {r['claim']} | {r['seed']} | {r['kvledger']} | {r['note']} |")
    lines += [
        "",
        "## Plots",
        "",
        "![utilisation](img/seed_utilisation.png)",
        "",
        "![prefix sharing](img/seed_prefix_sharing.png)",
        "",
        "![continuous](img/seed_continuous.png)",
        "",
        "![static](img/seed_static.png)",
        "",
        "![latency](img/seed_batching_latency.png)",
        "",
    ]
    if not skip_engine:
        lines += ["![latency cpu](img/seed_batching_latency_cpu.png)", ""]
    if "paging" in DETAILS:
        lines += ["![paged / contiguous](img/seed_paging.png)", ""]
    if "drift" in DETAILS:
        lines += ["![drift](img/seed_drift.png)", ""]
    lines += ["## Reproduce single runs with the CLI", "", "```", *CLI_COMMANDS, "```", ""]
    lines += ["## Where kvledger differs from the seed, and why", "", *differences(), ""]
    lines += section4()
    path.write_text("\n".join(lines), encoding="utf-8")


CLI_COMMANDS = [
    "# claim 1: utilisation over time (default model seed-70b on 2 x H100, tp 2)",
    "kvledger simulate --num-requests 400 --arrival-rate 3 --naive --plot util.png",
    "# claim 2: 64 requests sharing a 1200-token system prompt (add --no-prefix-caching)",
    "kvledger simulate --num-requests 64 --shared-prefix-len 1200 --prompt-len 16-64 \\",
    "    --output-len 64-128 --max-num-seqs 64 --plot prefix.png",
    "# claim 3: continuous vs static batching, 32 seats (drop --static-batch for continuous)",
    "kvledger simulate --num-requests 512 --prompt-len 32-256 --output-len high-variance \\",
    "    --max-num-seqs 32 --static-batch 32 --json",
    "# the same on this CPU, with step costs measured on a model folder",
    "kvledger simulate --model PATH --cost-model cpu-measured --save-cost-model cm.json ...",
    "# claims 6-8 one at a time (--quick for the short form; --json / --plot to keep results)",
    "python -m benchmarks.seed_paging --plot paging.png",
    "python -m benchmarks.seed_drift --plot drift.png",
    "python -m benchmarks.seed_int8_quality",
]

DIFFERENCES = [
    "- **Naive utilisation is a property of the length mix.** Reserving max_seq_len per request "
    "stores mean-resident-length / max_seq_len; with a chat-like mix (median 256 + 128 tokens) and "
    "a 4096 context that is ~10-20%, below the seed's 25-40% and far below seed 2's 60-70% "
    "(which would need requests averaging ~2/3 of the context). The paged figure (>= 95%) is "
    "robust: waste is under one block per request.",
    "- **Prefix sharing matches to rounding.** 64 x 1200 x 320 KiB = 25.2 GB (23.4 GiB, the "
    'seed\'s "24 GB") vs 75 blocks = 0.39 GB. In the simulated run the second request admitted '
    "in the first step computes its own copy of the prefix (blocks are published only after the "
    "step that fills them), so one duplicate exists briefly; every later request hits the cache.",
    "- **Continuous batching: the ratio depends on what a step costs.** On the simulated H100s "
    "the 70B's step is dominated by streaming 70 GB of weights per card (a = 28 ms vs b = "
    "0.14 ms per token), so a step with 3 requests left costs almost what a full one does and "
    "the occupancy gap of static batching shows up whole: 3.38x, the seed's 3.4x. On this CPU "
    "a step costs mostly per token (fitted a = {cpu_a:.0f} ms, b = {cpu_b:.2f} ms per token), so "
    "half-empty batches waste less and the real engine gains {cpu_ratio:.2f}x; the simulator, "
    "given the CPU's measured coefficients, predicts {cpu_sim_ratio:.2f}x. Static batching here is the fair, "
    "unpadded kind (finished rows leave the batch, nothing new joins); padded static batching "
    "(HF `generate`) is slower still. With everything queued at t = 0, continuous batching "
    "improves p50 as well as p99 because queueing dominates; the seed's \"p50 about the "
    "same\" is an online statement, and even online (Poisson at 80% of static's capacity) "
    "static batching makes a short request wait for the batch in flight.",
    "- **Swap vs recompute: with GQA-8 and 25 GB/s, swap wins almost everywhere.** A token of the "
    "70B's KV is 160 KiB per card, 13 us out and back over PCIe 4.0, while recomputing it costs "
    "~140 us of GEMMs on an H100 (450 us on an A100). Recompute is cheaper only while it rides "
    "free in a memory-bound decode step (up to ~150 tokens on H100, ~40 on A100, by the roofline "
    "rows). The seed's ~1000-token rule corresponds to an effective swap bandwidth of ~3 GB/s "
    "on H100 (~1 GB/s on A100), "
    "which is what block-by-block copies (16 tokens x 1 layer = 32 KB each) achieve when each "
    "copy pays a launch; kvledger's runner batches the copies, and its scheduler picks the mode "
    "per victim from measured numbers rather than a fixed length.",
    "- **int8 KV is 1/15.75, not 1/16, of MHA fp16:** kvledger's int8 format stores one fp16 scale "
    "per token per KV head for K and for V (2,560 B per token on the 70B).",
    "- **Concurrency of 4096-token requests is 10, not 3-4**, on 2 x 80 GB at 0.9 with tp 2: "
    "each card keeps half of every token's KV heads, so the KV budget per token halves too.",
]


def differences() -> list[str]:
    """DIFFERENCES with this run's CPU figures filled in (or the CPU sentence dropped)."""
    e = DETAILS.get("batching_engine")
    out = []
    for text in DIFFERENCES:
        if "{cpu_a" in text:
            if e is None:
                text = (
                    text.split(" On this CPU")[0]
                    + " Static batching here"
                    + text.split("Static batching here", 1)[1]
                )
            else:
                real, sim = e["real"], e["sim_cpu_measured"]
                text = text.format(
                    cpu_a=e["cost_model"]["a"] * 1e3,
                    cpu_b=e["cost_model"]["b"] * 1e3,
                    cpu_ratio=real["continuous"]["throughput_tokens_per_s"]
                    / real["static"]["throughput_tokens_per_s"],
                    cpu_sim_ratio=sim["continuous"]["throughput_tokens_per_s"]
                    / sim["static"]["throughput_tokens_per_s"],
                )
        out.append(text)
    return out


def section4() -> list[str]:
    """Explanations of claims 6-8, from this run's DETAILS (empty where they were skipped)."""
    from benchmarks.seed_claims_text import section4_text

    return section4_text(DETAILS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-engine", action="store_true", help="ledger + simulation rows only")
    ap.add_argument(
        "--num-requests", type=int, default=96, help="real-engine requests (default 96)"
    )
    ap.add_argument("--seats", type=int, default=16, help="batch size / max_num_seqs on CPU")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the real engine (default 1: on a shared machine, more threads "
        "than free cores makes OpenMP spin and steps 5-10x slower)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="claims 6-8 in short form (fewer contexts, sequences and rounds)",
    )
    ap.add_argument("--out", type=Path, default=DOCS / "seed_claims.md")
    ap.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: rewrite --out from a bench_out/seed_claims.json of an earlier run",
    )
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        DETAILS.update(saved["details"])
        # claims 6-8's rows are rebuilt from their details with this checkout's wording
        ROWS[:] = [r for r in saved["rows"] if not r["claim"].startswith(("6.", "7.", "8."))]
        for key, module in (
            ("paging", "seed_paging"),
            ("drift", "seed_drift"),
            ("int8_phrasing", "seed_int8_quality"),
        ):
            if key in DETAILS:
                mod = importlib.import_module(f"benchmarks.{module}")
                for r in mod.claim_rows(DETAILS[key]):
                    row(*r)
        if "paging" in DETAILS:  # their plots too (the JSON keeps what they draw)
            importlib.import_module("benchmarks.seed_paging").plot(
                DETAILS["paging"]["kernel"], IMG / "seed_paging.png"
            )
        if "drift" in DETAILS:
            importlib.import_module("benchmarks.seed_drift").plot(
                DETAILS["drift"]["results"], IMG / "seed_drift.png"
            )
        run = saved["run"]
        global LOAD_AT_START
        LOAD_AT_START = run["load_at_start"]
        sys.argv[1:] = run["argv"]
        import torch

        torch.set_num_threads(args.threads)  # the header reports the run's thread count
        write_markdown(args.out, run["elapsed"], run["skip_engine"])
        print(f"wrote {args.out} from {args.render}")
        return 0
    t0 = time.time()
    IMG.mkdir(parents=True, exist_ok=True)
    print_header("seed claims vs kvledger")
    claim_bytes()
    claim_utilisation()
    claim_prefix()
    claim_batching_sim()
    model = None
    if not args.skip_engine:
        import torch

        torch.set_num_threads(args.threads)
        tmp = tempfile.TemporaryDirectory(prefix="kvledger-seed-")
        model = build_cpu_model(Path(tmp.name) / "llama-4x256")
        claim_batching_engine(model, args.num_requests, args.seats)
    claim_crossover(model)
    if not args.skip_engine:
        claim_paging(args.quick)
        claim_drift(args.quick)
        claim_int8_phrasing()
    elapsed = time.time() - t0
    print(f"\n{'claim':<48} | {'seed':<26} | kvledger")
    for r in ROWS:
        print(f"{r['claim']:<48} | {r['seed']:<26} | {r['kvledger']}")
    write_markdown(args.out, elapsed, args.skip_engine)
    (REPO_ROOT / "bench_out").mkdir(exist_ok=True)
    (REPO_ROOT / "bench_out" / "seed_claims.json").write_text(
        json.dumps(
            {
                "rows": ROWS,
                "details": DETAILS,
                "run": {
                    "elapsed": elapsed,
                    "skip_engine": args.skip_engine,
                    "load_at_start": LOAD_AT_START,
                    "argv": sys.argv[1:],
                },
            },
            default=str,
        )
    )
    print(f"\nwrote {args.out} and bench_out/seed_claims.json in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
