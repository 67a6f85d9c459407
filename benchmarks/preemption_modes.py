"""Issue 4: throughput and p99 latency under memory pressure, swap-only vs recompute-only vs auto.

One run, one fixed mixed workload, every model and every mode::

    python -m benchmarks.preemption_modes                  # defaults below, ~3-4 min when quiet
    python -m benchmarks.preemption_modes --threads 2 --repeats 3 --pool-frac 0.25

Models: ``../shared/models/stories260k`` (real, tiny: 5 x 64, 512-token context) and the
random-weight float32 ``bench-30m`` Llama of ``benchmarks/common.py`` (31.4M params, 6 x 384,
GQA 6/2; built once under ``bench_out/models/``, then reused).

Workload (``--n 48``, seed 0): prompts 16-400 tokens, outputs 16-64 tokens for 80% of the
requests and 200-400 for 20%, greedy, ``ignore_eos``, all submitted in one ``generate`` call.
Token ids are drawn from 3..511 so that the same prompts are valid for both vocabularies, and
a long request's prompt is clipped to ``512 - max_tokens`` tokens so that every request fits
stories260k's 512-token context (otherwise it would stop at the context, not at max_tokens).

KV pool: ``--pool-frac`` (default 0.30) of the blocks the workload holds at its peak when memory
is unlimited. That peak is measured by replaying the engine's own ``Scheduler`` and
``KVCacheManager`` on the workload without tensors (``kvledger.sim.apply_step_update``, as the
simulator does); the replay also predicts the preemptions for a range of pool sizes, printed
before the real runs (scheduling is deterministic, so the prediction for swap and recompute
must equal what the real runs report).

Each (model, mode) runs ``--repeats`` times, round-robin over the modes so that a burst of load
from other processes hits every mode alike, each time in a fresh ``LLM`` (a fresh pool: no
prefix-cache hits carried over from the previous repeat; for ``auto`` a fresh start-up
calibration); the fastest repeat of each mode is kept.

Figures per mode: generated tokens/s and wall time of the ``generate`` call, this process's CPU
seconds meanwhile (with 1 thread, a figure other processes barely move), scheduler steps and
tokens computed (recompute shows up here), request latency p50/p99 (``finished_time -
arrival_time``), TTFT p50/p99 (``first_token_time - arrival_time``), preemptions by mode from
the ledger, requests preempted at least once, swapped bytes each way and the runner's seconds
copying them, and the CPU other processes burned meanwhile (a contended run is flagged, not
hidden). Checks: all modes (and repeats) produce token-identical outputs (preemption must never
change greedy tokens), every request generates exactly ``max_tokens`` tokens, and the ledger ends
with ``used_blocks == 0`` and no swapped blocks.

Threads: ``--threads`` (default 1) goes to ``torch.set_num_threads``. The machine this was
written on is a shared 2-core VM; with 2 OpenMP threads a single busy neighbour makes the spin-
waiting threads stall each other and timings swing by tens of percent, while 1 thread is slower
but steady. Results go to ``bench_out/preemption_modes/result.json``.
"""

from __future__ import annotations

import argparse
import math
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_OUT,
    REPO_ROOT,
    ContentionProbe,
    Timer,
    ensure_model,
    make_workload,
    model_num_params,
    percentile,
    print_header,
    save_json,
    workload_summary,
)

MODES = ("swap", "recompute", "auto")
STORIES = REPO_ROOT.parent / "shared" / "models" / "stories260k"
CONTEXT = 512  # stories260k's max_position_embeddings: every request must fit it
VOCAB = 512  # ids 3..511 are valid for both models' vocabularies
SWEEP_FRACS = (0.10, 0.15, 0.20, 0.25, 0.30, 0.35)


# --------------------------------------------------------------------------- workload


def build_workload(n: int, seed: int) -> list[dict[str, Any]]:
    """The issue's mixed workload, clipped so that prompt + output fits a 512-token context."""
    wl = make_workload(
        n=n,
        seed=seed,
        prompt_len=(16, 400),
        short_out=(16, 64),
        long_out=(200, 400),
        long_frac=0.2,
        vocab_size=VOCAB,
    )
    for r in wl:
        r["prompt_token_ids"] = r["prompt_token_ids"][: CONTEXT - r["max_tokens"]]
    return wl


def full_blocks(r: dict[str, Any], block_size: int) -> int:
    return math.ceil((len(r["prompt_token_ids"]) + r["max_tokens"]) / block_size)


def replay(
    wl: list[dict[str, Any]], num_blocks: int, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The engine's scheduler on the workload, without tensors: peak blocks and preemptions.

    Placeholder output tokens (the simulator's) only matter for prefix-cache hashing, and these
    prompts share no prefix, so the decisions are those of the real engine. ``auto`` is not
    replayed: its choices depend on the start-up calibration.
    """
    from kvledger.config import CacheConfig, SchedulerConfig
    from kvledger.core.preemption import PreemptionCostModel
    from kvledger.core.request import Request
    from kvledger.sampling_params import SamplingParams
    from kvledger.sim import apply_step_update, build_scheduler
    from kvledger.sim.simulator import placeholder_token

    sc = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=CONTEXT,
        preemption_mode=mode,
    )
    cc = CacheConfig(block_size=args.block_size, swap_space=args.swap_space)
    sched = build_scheduler(sc, cc, num_blocks, 1024, PreemptionCostModel(mode=mode))
    reqs = []
    for i, r in enumerate(wl):
        req = Request(
            request_id=str(i),
            prompt_token_ids=list(r["prompt_token_ids"]),
            sampling_params=SamplingParams(
                max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0
            ),
            arrival_time=float(i),
            max_total_tokens=CONTEXT,
        )
        sched.add_request(req)
        reqs.append(req)
    peak = steps = 0
    while sched.has_unfinished() and steps < 100_000:
        so = sched.schedule()
        steps += 1
        peak = max(peak, sched.kv.num_used_blocks)
        apply_step_update(
            sched, so, lambda q: placeholder_token(int(q.request_id), q.num_tokens), float(steps)
        )
    return {
        "num_blocks": num_blocks,
        "mode": mode,
        "peak_used_blocks": peak,
        "steps": steps,
        "preemptions": dict(sched.num_preemptions),
        "requests_preempted": sum(r.num_preemptions > 0 for r in reqs),
        "unfinished": sched.num_unfinished,
    }


# --------------------------------------------------------------------------- one run


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_once(
    model: str, workload: list[dict[str, Any]], mode: str, engine_kw: dict[str, Any]
) -> dict[str, Any]:
    """Fresh LLM, one warm-up request, then the whole workload in one ``generate`` call."""
    from kvledger import LLM, SamplingParams

    with Timer() as t_start:
        llm = LLM(model=model, dtype="float32", preemption_mode=mode, **engine_kw)
        llm.generate(
            [[5] * 8],
            [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)],
            use_tqdm=False,
        )
    before = llm.ledger()

    # Count steps and scheduled tokens (a recompute re-schedules its whole context).
    sched = llm.engine.scheduler
    counts = {"steps": 0, "tokens": 0}
    schedule = sched.schedule

    def counting_schedule():
        so = schedule()
        counts["steps"] += 1
        counts["tokens"] += so.total_num_scheduled_tokens
        return so

    sched.schedule = counting_schedule
    # Each victim's computed tokens when evicted (the cost model's input; see victim_costs).
    victims: list[int] = []
    preempt = sched._preempt

    def recording_preempt(victim, out):
        victims.append(victim.num_computed_tokens)
        return preempt(victim, out)

    sched._preempt = recording_preempt
    prompts = [r["prompt_token_ids"] for r in workload]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in workload
    ]
    with ContentionProbe() as probe:
        c0, t0 = _cpu_s(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    sched.schedule, sched._preempt = schedule, preempt
    led = llm.ledger()

    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lat = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    per_req = [o.metrics.num_preemptions for o in outs]
    n_gen = sum(len(t) for t in tokens)
    # Without preemption each request computes its prompt and all but its last output token.
    needed = sum(len(r["prompt_token_ids"]) + r["max_tokens"] - 1 for r in workload)
    cal = llm.engine.calibration
    return {
        "mode": mode,
        "wall_s": wall,
        "cpu_s": cpu,
        "tok_per_s": n_gen / wall,
        "generated_tokens": n_gen,
        "startup_s": t_start.s,
        "steps": counts["steps"],
        "computed_tokens": counts["tokens"],
        "computed_over_needed": counts["tokens"] / needed,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "preemptions": {
            k: led.preemptions[k] - before.preemptions.get(k, 0) for k in ("swap", "recompute")
        },
        "requests_preempted": sum(p > 0 for p in per_req),
        "max_preemptions_per_request": max(per_req),
        "swap_out_bytes": led.swap_out_bytes - before.swap_out_bytes,
        "swap_in_bytes": led.swap_in_bytes - before.swap_in_bytes,
        "swap_out_s": led.swap_out_seconds - before.swap_out_seconds,
        "swap_in_s": led.swap_in_seconds - before.swap_in_seconds,
        "used_blocks_after": led.used_blocks,
        "swapped_blocks_after": led.swapped_blocks,
        "length_errors": [
            i for i, (t, r) in enumerate(zip(tokens, workload)) if len(t) != r["max_tokens"]
        ],
        "calibration": dict(cal) if cal else None,
        "cost_model": llm.engine.cost_model.to_dict(),
        "victim_computed_tokens": victims,
        "bytes_per_token": llm.engine.bytes_per_token,
        "contention": probe.as_dict(),
        "outputs": tokens,
    }


# --------------------------------------------------------------------------- reporting


def victim_costs(run: dict[str, Any], cost_model: dict[str, Any], block_size: int) -> dict:
    """What a cost model says evicting ``run``'s victims costs, all swapped vs all recomputed.

    Swap bytes are the victim's whole blocks (these prompts share no prefix, so every block is
    private); recompute is the marginal prefill of its computed tokens (no surviving cache).
    """
    from kvledger.core.preemption import PreemptionCostModel

    cm = PreemptionCostModel(
        swap_bandwidth=cost_model["swap_bandwidth_bytes_per_s"],
        swap_fixed_s=cost_model.get("swap_fixed_s", 1e-4),
        prefill_coeffs=tuple(cost_model["prefill_coeffs"]),
    )
    bpb = run["bytes_per_token"] * block_size
    ns = run["victim_computed_tokens"]
    return {
        "victims": len(ns),
        "computed_tokens": ns,
        "swap_s": sum(cm.swap_cost(math.ceil(n / block_size) * bpb) for n in ns),
        "recompute_s": sum(cm.recompute_cost(n) for n in ns),
    }


def print_tables(rows: list[dict[str, Any]]) -> None:
    hdr = (
        f"{'mode':<10}{'tok/s':>8}{'wall s':>8}{'CPU s':>7}{'lat p50':>9}{'lat p99':>9}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'foreign':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['mode']:<10}{r['tok_per_s']:>8.1f}{r['wall_s']:>8.2f}{r['cpu_s']:>7.2f}"
            f"{r['latency_p50_s']:>9.2f}{r['latency_p99_s']:>9.2f}"
            f"{r['ttft_p50_s']:>10.2f}{r['ttft_p99_s']:>10.2f}"
            f"{r['contention']['foreign_cores_avg']:>9.2f}"
        )
    hdr = (
        f"{'mode':<10}{'swap/rec':>10}{'req hit':>9}{'steps':>7}{'computed tok':>14}"
        f"{'MB out':>8}{'MB in':>8}{'swap ms':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        p = r["preemptions"]
        sr = f"{p['swap']}/{p['recompute']}"
        comp = f"{r['computed_tokens']} ({r['computed_over_needed']:.2f}x)"
        print(
            f"{r['mode']:<10}{sr:>10}{r['requests_preempted']:>9}{r['steps']:>7}{comp:>14}"
            f"{r['swap_out_bytes'] / 1e6:>8.1f}{r['swap_in_bytes'] / 1e6:>8.1f}"
            f"{(r['swap_out_s'] + r['swap_in_s']) * 1e3:>9.1f}"
        )
    print(
        "(seconds; lat = finished - arrival, TTFT = first token - arrival; CPU s = this "
        "process's CPU time during generate; foreign = average cores other processes used "
        "meanwhile; swap/rec = preemptions by mode; req hit = requests preempted at least "
        "once; computed tok = tokens the model ran, x = over the no-preemption need; swap ms "
        "= runner time copying blocks out + in)"
    )


def ratios(by_mode: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """auto against the better of swap and recompute, metric by metric."""
    if not all(m in by_mode for m in MODES):
        return {}
    a, s, r = by_mode["auto"], by_mode["swap"], by_mode["recompute"]
    out: dict[str, Any] = {}
    for k, higher in (
        ("tok_per_s", True),
        ("cpu_s", False),
        ("latency_p50_s", False),
        ("latency_p99_s", False),
        ("ttft_p50_s", False),
        ("ttft_p99_s", False),
    ):
        pick = max if higher else min
        best_mode = pick(("swap", "recompute"), key=lambda m, k=k: by_mode[m][k])
        out[k] = {
            "auto": a[k],
            "best": by_mode[best_mode][k],
            "best_mode": best_mode,
            "ratio": a[k] / by_mode[best_mode][k],
            "higher_is_better": higher,
        }
    out["swap_over_recompute_tok_per_s"] = s["tok_per_s"] / r["tok_per_s"]
    return out


def print_ratios(rat: dict[str, Any]) -> None:
    if not rat:
        return
    print("auto / best-of(swap, recompute):")
    for k, v in rat.items():
        if not isinstance(v, dict):
            continue
        print(
            f"  {k:<14} auto {v['auto']:9.3f}  best {v['best_mode']:<9} {v['best']:9.3f}"
            f"  ratio {v['ratio']:.3f} ({'higher' if v['higher_is_better'] else 'lower'}"
            " is better)"
        )
    print(f"  (swap / recompute tok/s = {rat['swap_over_recompute_tok_per_s']:.3f})")


def source_state() -> str:
    """The commit and whether kvledger/ had uncommitted edits when the run started."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "kvledger"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"{head}" + (f" + uncommitted edits in {len(dirty)} kvledger file(s)" if dirty else "")


# --------------------------------------------------------------------------- main


def resolve_model(name: str) -> tuple[str, str]:
    """(label, folder) for 'stories260k', a common.PRESETS name, or a folder path."""
    if name == "stories260k":
        return name, str(STORIES)
    if Path(name).is_dir():
        return Path(name).name, name
    return name, str(ensure_model(name))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="stories260k,bench-30m", help="comma list (or folders)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--n", type=int, default=48, help="requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pool-frac", type=float, default=0.30, help="KV pool / the unlimited-memory peak"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap pool")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see docstring)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode; the fastest is kept")
    ap.add_argument(
        "--result-json", type=Path, default=BENCH_OUT / "preemption_modes" / "result.json"
    )
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    t_total = time.perf_counter()
    print_header("kvledger preemption modes under memory pressure (issue 4)")
    print(
        f"threads : torch.set_num_threads({args.threads}); on a shared 2-core VM OpenMP threads "
        "spin badly while a neighbour is busy, so 1 thread is the steady default"
    )
    src = source_state()
    print(f"source  : kvledger at {src}")
    modes = [m for m in args.modes.split(",") if m]
    wl = build_workload(args.n, args.seed)
    bs = args.block_size
    sum_full = sum(full_blocks(r, bs) for r in wl)
    longest = max(full_blocks(r, bs) for r in wl)
    unlimited = replay(wl, sum_full, "recompute", args)
    peak = unlimited["peak_used_blocks"]
    num_blocks = max(round(args.pool_frac * peak), longest + 1)
    print(f"workload: {workload_summary(wl)}; greedy, ignore_eos, all submitted at once")
    print(
        f"KV pool : {num_blocks} blocks of {bs} tokens = {num_blocks / peak:.0%} of the "
        f"{peak}-block peak with unlimited memory (scheduler replay; {sum_full} blocks if every "
        f"request were resident at full length; largest request {longest} blocks); "
        f"swap space {args.swap_space} GiB, max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching on (default)"
    )
    print(
        f"runs    : {args.repeats} fresh-engine repeat(s) per mode, round-robin over "
        f"{', '.join(modes)}; the fastest of each mode is kept"
    )
    print("scheduler replay (no tensors): pool fraction -> preemptions, requests preempted")
    sweep = []
    for frac in sorted({*SWEEP_FRACS, args.pool_frac}):
        nb = max(round(frac * peak), longest + 1)
        row = {m: replay(wl, nb, m, args) for m in ("swap", "recompute")}
        sweep.append({"frac": frac, **row})
        print(
            f"  {frac:4.0%} = {nb:4d} blocks: "
            + "; ".join(
                f"{m} {row[m]['preemptions'][m]} preemptions, {row[m]['requests_preempted']}"
                f"/{len(wl)} requests, {row[m]['steps']} steps"
                for m in ("swap", "recompute")
            )
            + (" <- this run" if nb == num_blocks else "")
        )
    engine_kw = dict(
        num_kv_blocks=num_blocks,
        block_size=bs,
        swap_space=args.swap_space,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )

    report: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "source": src,
        "workload": {
            "summary": workload_summary(wl),
            "peak_blocks_unlimited": peak,
            "blocks_all_resident": sum_full,
        },
        "num_kv_blocks": num_blocks,
        "replay_sweep": sweep,
        "models": {},
    }
    all_ok = True
    for name in args.models.split(","):
        label, folder = resolve_model(name)
        n_params = model_num_params(folder)
        print(
            f"\n== model {label} ({folder}"
            + (f", {n_params / 1e6:.1f}M params" if n_params else "")
            + ")",
            flush=True,
        )
        best: dict[str, dict[str, Any]] = {}
        tries: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for mode in modes:
                r = run_once(folder, wl, mode, engine_kw)
                tries[mode].append(r)
                line = (
                    f"  {mode:<9} repeat {rep + 1}: {r['tok_per_s']:7.1f} tok/s, wall "
                    f"{r['wall_s']:6.2f} s, CPU {r['cpu_s']:6.2f} s, preemptions "
                    f"{r['preemptions']}, {r['requests_preempted']}/{len(wl)} requests "
                    f"preempted (max {r['max_preemptions_per_request']} each), foreign CPU "
                    f"{r['contention']['foreign_cores_avg']:.2f} cores"
                )
                cal = r["calibration"]
                if cal:
                    c = r["cost_model"]["prefill_coeffs"]
                    line += (
                        f"\n            calibration ({cal['seconds']:.2f} s): crossover "
                        f"{cal['crossover_tokens']} tokens; copy "
                        f"{cal['swap_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s + "
                        f"{cal['swap_fixed_s'] * 1e6:.0f} us per swap pair; prefill "
                        f"{c[0] * 1e3:.2f} ms + {c[1] * 1e6:.2f} us/token + "
                        f"{c[2] * 1e9:.3f} ns/token^2"
                    )
                print(line, flush=True)
                if mode not in best or r["wall_s"] < best[mode]["wall_s"]:
                    best[mode] = r
        rows = [best[m] for m in modes]
        report_vc = None
        print()
        print_tables(rows)
        if "auto" in best and best["auto"]["calibration"]:
            a = best["auto"]
            cal = a["calibration"]
            bpt = a["bytes_per_token"]
            print(
                f"auto (kept repeat): calibrated crossover_tokens = {cal['crossover_tokens']} "
                f"(swap a victim with at least this many computed tokens; {bpt} KV bytes/token); "
                f"chose swap {a['preemptions']['swap']} x, recompute "
                f"{a['preemptions']['recompute']} x; calibration prefills "
                + ", ".join(
                    f"{n}: {s * 1e3:.2f} ms"
                    for n, s in zip(cal["prefill_lengths"], cal["prefill_seconds"])
                )
            )
            vc = victim_costs(a, a["cost_model"], bs)
            report_vc = vc
            print(
                f"victims' computed tokens at eviction: {sorted(vc['computed_tokens'])}; by "
                f"auto's calibrated model, swapping them all costs {vc['swap_s'] * 1e3:.1f} ms, "
                f"recomputing them all {vc['recompute_s'] * 1e3:.1f} ms "
                f"({vc['recompute_s'] / max(vc['swap_s'], 1e-12):.0f}x)"
            )
            for m, want in (("swap", "swap"), ("recompute", "recompute")):
                if m in modes:
                    pred = next(s[m] for s in sweep if s[m]["num_blocks"] == num_blocks)
                    print(
                        f"replay predicted {m}: {pred['preemptions'][want]} preemptions, "
                        f"{pred['steps']} steps; measured {best[m]['preemptions'][want]}, "
                        f"{best[m]['steps']} steps"
                    )
        rat = ratios(best)
        print_ratios(rat)

        # Checks: identical tokens across modes and repeats, exact lengths, empty pool.
        ref_mode = modes[0]
        ref = best[ref_mode]["outputs"]
        checks: dict[str, Any] = {"reference_mode": ref_mode, "modes": {}}
        for mode, runs in tries.items():
            diff = sorted(
                {i for r in runs for i, (a, b) in enumerate(zip(r["outputs"], ref)) if a != b}
            )
            lerr = sorted({i for r in runs for i in r["length_errors"]})
            used = [r["used_blocks_after"] for r in runs]
            swapped = [r["swapped_blocks_after"] for r in runs]
            ok = not diff and not lerr and not any(used) and not any(swapped)
            all_ok &= ok
            checks["modes"][mode] = {
                "differing_requests": diff,
                "length_errors": lerr,
                "used_blocks_after": used,
                "swapped_blocks_after": swapped,
                "ok": ok,
            }
            print(
                f"check {mode:<9}: {len(ref) - len(diff)}/{len(ref)} requests token-identical "
                f"to {ref_mode} in all {len(runs)} repeat(s)"
                + (f" (differ: {diff[:10]})" if diff else "")
                + f"; length errors {lerr or 'none'}; used_blocks at the end {used}, "
                f"swapped {swapped} -> {'OK' if ok else 'FAIL'}"
            )
        report["models"][label] = {
            "folder": folder,
            "num_params": n_params,
            "best": {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in best.items()},
            "repeats": {
                m: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
                for m, runs in tries.items()
            },
            "ratios_auto_over_best": rat,
            "victim_costs_by_auto_model": report_vc,
            "checks": checks,
        }

    total = time.perf_counter() - t_total
    report["total_s"] = total
    report["all_checks_passed"] = all_ok
    save_json(report, args.result_json)
    print(f"\nall checks passed: {all_ok}; total {total:.0f} s; wrote {args.result_json}")
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
