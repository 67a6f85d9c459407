"""Run one token-id workload through vLLM's CPU build and write figures + outputs as JSON.

Runs INSIDE vLLM's own virtualenv (see ``setup_vllm_env.sh``), as a separate process:

    $VLLM_VENV/bin/python benchmarks/vllm_runner.py MODEL_DIR WORKLOAD.json OUT.json \
        [--threads 2] [--kv-space-gib 1] [--block-size 32]

Self-contained on purpose (standard library + vllm): it imports nothing from kvledger or
``benchmarks.common``. Measures:

- ``startup_s``: ``LLM(...)`` constructor start to return (weights, engine-core process,
  torch.compile warm-up, KV allocation; the engine is ready to serve when it returns);
- one ``llm.generate`` call over the whole workload, greedy
  (``SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)`` per request), prompts
  passed as ``TokensPrompt(prompt_token_ids=...)``: wall time, generated tokens/s;
- TTFT per request from ``RequestOutput.metrics`` (a ``RequestStateStats``). It is only
  filled when the engine keeps stats, and ``LLM`` defaults to ``disable_log_stats=True``,
  so the runner passes ``disable_log_stats=False`` (``--no-stats`` turns that off, and then
  TTFT is reported as unavailable). ``ttft_s`` = vLLM's ``first_token_latency`` (frontend
  wall time of the first token minus the request's ``arrival_time``);
  ``ttft_from_call_s`` = the same instant measured from the start of the ``generate`` call;
- peak RSS: ``ru_maxrss`` of this process and of its reaped children, plus the peak summed
  RSS of the whole process tree (vLLM runs its engine core in a child process) by /proc
  polling (``peak_rss_mib``: summed RSS, ``peak_pss_mib``: summed PSS, shared pages split);
- each request's output token ids.

Environment set here unless already set: ``VLLM_CPU_KVCACHE_SPACE`` (GiB, from
``--kv-space-gib``), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (both cores to the worker: measured
213 vs 152 tok/s), ``VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}``, offline HF flags.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


def _tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _tree_cpu_s(root: int) -> float:
    """utime+stime seconds of the live process tree (vLLM's engine core and worker)."""
    total = 0
    for p in _tree_pids(root):
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def _system_busy_s() -> float:
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _tree_mem_kib(root: int) -> tuple[int, int]:
    """Summed (RSS, PSS) in KiB of ``root`` and all its descendants.

    RSS summed over processes counts shared pages (torch's libraries, mapped by each of
    vLLM's processes) once per process; PSS splits them, so its sum is the real footprint.
    """
    rss = pss = 0
    for p in _tree_pids(root):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    return rss, pss


class _TreePeak(threading.Thread):
    """Background /proc poller keeping the peak tree RSS and PSS of this process."""

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval, self.stop = interval, threading.Event()
        self.peak_rss_kib = self.peak_pss_kib = 0

    def run(self) -> None:
        while not self.stop.is_set():
            rss, pss = _tree_mem_kib(os.getpid())
            self.peak_rss_kib = max(self.peak_rss_kib, rss)
            self.peak_pss_kib = max(self.peak_pss_kib, pss)
            self.stop.wait(self.interval)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description="vLLM CPU runner for kvledger's peer benchmarks")
    ap.add_argument("model_dir")
    ap.add_argument("workload_json", help='list of {"prompt_token_ids": [...], "max_tokens": m}')
    ap.add_argument("output_json")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kv-space-gib", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=32, help="vLLM CPU attention needs 32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-stats", action="store_true", help="disable_log_stats=True (no TTFT)")
    a = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kv_space_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        os.environ.setdefault(k, "1")

    workload = json.loads(Path(a.workload_json).read_text())
    poller = _TreePeak()
    poller.start()

    t_import = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t_import

    t0 = time.perf_counter()
    llm = LLM(
        model=a.model_dir,
        dtype=a.dtype,
        block_size=a.block_size,
        max_model_len=a.max_model_len,
        seed=0,
        enforce_eager=a.enforce_eager,
        disable_log_stats=a.no_stats,
    )
    startup_s = time.perf_counter() - t0

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
        for r in workload
    ]
    busy0, own0 = _system_busy_s(), _tree_cpu_s(os.getpid())
    call_wall = time.time()
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t1
    own_cpu = _tree_cpu_s(os.getpid()) - own0
    foreign_cpu = max(0.0, _system_busy_s() - busy0 - own_cpu)

    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    n_gen = sum(len(t) for t in token_ids)
    ttft, ttft_call, ttft_note = [], [], None
    for o in outs:
        m = getattr(o, "metrics", None)
        lat = getattr(m, "first_token_latency", None) if m is not None else None
        if lat is None or lat <= 0:
            ttft_note = "unavailable: RequestOutput.metrics is None/empty " + (
                "(run with --no-stats)" if a.no_stats else f"(metrics={m!r})"
            )
            ttft, ttft_call = [], []
            break
        ttft.append(lat)
        ttft_call.append(m.arrival_time + lat - call_wall)

    poller.stop.set()
    poller.join()
    res = {
        "engine": f"vllm-cpu-{vllm.__version__}",
        "vllm_version": vllm.__version__,
        # what vLLM made of the checkpoint's quantization_config (None: full precision)
        "quantization": getattr(getattr(llm.llm_engine, "model_config", None), "quantization", None),
        "tok_per_s": n_gen / wall,
        "wall_s": wall,
        "startup_s": startup_s,
        "import_s": import_s,
        "generated_tokens": n_gen,
        "requested_tokens": sum(r["max_tokens"] for r in workload),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_s": ttft or None,
        "ttft_from_call_s": ttft_call or None,
        "ttft_method": ttft_note
        or "vLLM RequestOutput.metrics.first_token_latency (first token wall - arrival_time)",
        "peak_rss_mib": poller.peak_rss_kib / 1024,
        "peak_pss_mib": poller.peak_pss_kib / 1024,
        "peak_rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "contention": {
            "own_cpu_s": own_cpu,
            "foreign_cpu_s": foreign_cpu,
            "foreign_cores_avg": foreign_cpu / wall,
        },
        "settings": {
            "threads": a.threads,
            "dtype": a.dtype,
            "kv_space_gib": a.kv_space_gib,
            "block_size": a.block_size,
            "max_model_len": a.max_model_len,
            "enforce_eager": a.enforce_eager,
            "log_stats": not a.no_stats,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
        },
        "python": sys.version.split()[0],
        "outputs": token_ids,
    }
    Path(a.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output_json).write_text(json.dumps(res, indent=1))
    print(
        f"[vllm_runner] {res['engine']}: {res['tok_per_s']:.1f} tok/s, wall {wall:.2f} s, "
        f"startup {startup_s:.1f} s, peak tree RSS {res['peak_rss_mib']:.0f} MiB "
        f"(PSS {res['peak_pss_mib']:.0f} MiB), other processes used "
        f"{res['contention']['foreign_cores_avg']:.2f} cores meanwhile",
        flush=True,
    )
    del llm
    # vLLM's engine-core child can linger at interpreter exit; the JSON is already written.
    os._exit(0)


if __name__ == "__main__":
    main()
