"""Shared pieces of the peer benchmarks: random-weight models, workloads, measurement helpers.

Only the standard library is imported at module level so that light callers (the
orchestrators, the workload writer) start fast; torch/transformers are imported inside
the functions that need them. ``vllm_runner.py`` does NOT import this module: it runs in
vLLM's own virtualenv and is self-contained.

Tokenizer choice: every engine receives token-id prompts, but the model folders still get
a real (trivial) tokenizer: a ``tokenizers`` WordLevel vocabulary of exactly ``vocab_size``
entries (``<unk>``, ``<s>``, ``</s>``, then ``t3`` ... ``t31999``), saved with
``PreTrainedTokenizerFast.save_pretrained``. That way vLLM, HF and kvledger can all load the
folder offline with their normal code paths (no ``skip_tokenizer_init`` special case), and
detokenization costs are the same cheap lookup for everyone.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvledger.sim.simulator import percentile


def default_vllm_venv() -> Path:
    """Where vLLM's own virtualenv lives: ``VLLM_VENV``, else ``bench_envs/vllm`` under kvledger's
    cache directory (the native kernels' home, ``KVLEDGER_CACHE_DIR``), so the default exists on
    any machine after ``bash benchmarks/setup_vllm_env.sh`` (the script applies the same rule)."""
    if os.environ.get("VLLM_VENV"):
        return Path(os.environ["VLLM_VENV"])
    from kvledger import envs

    return Path(envs.KVLEDGER_CACHE_DIR) / "bench_envs" / "vllm"


REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_OUT = REPO_ROOT / "bench_out"

# Random-weight Llama presets. Parameter counts are with untied embeddings (Llama default).
PRESETS: dict[str, dict[str, Any]] = {
    # 8 x 512, GQA 8/2, head_dim 64: 60.04M params (intermediate 1792 = 7 * 256 is the
    # SwiGLU width that brings a 32000-vocab model to ~60M; 1376 would give 54.9M).
    "bench-60m": dict(
        num_hidden_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1792,
    ),
    # 20 x 1024, GQA 16/4, head_dim 64: ~228M params, the bandwidth-bound size of issue 42's
    # quantised-weight figures (its weights stream from memory at every decode step).
    "bench-230m": dict(
        num_hidden_layers=20,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=1792,
    ),
    # The same depth and width with stories260k's 512-token vocabulary (llama.cpp needs the
    # tokenizer's vocabulary to be the embedding's: benchmarks/vs_llamacpp.py) and a wider MLP,
    # so the layers alone hold ~225M parameters.
    "bench-230m-v512": dict(
        num_hidden_layers=20,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_size=512,
    ),
    # 6 x 384, GQA 6/2, head_dim 64: 31.36M params (issue 3 asks for 20-50M).
    "bench-30m": dict(
        num_hidden_layers=6,
        hidden_size=384,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=640,
    ),
}
VOCAB_SIZE = 32000
MAX_POSITIONS = 2048


# --------------------------------------------------------------------------- models


def build_trivial_tokenizer(path: str | Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Write a WordLevel tokenizer with exactly ``vocab_size`` tokens into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(path))
    # transformers 5 writes "TokenizersBackend"; the 4.x-compatible name loads in both.
    cfg_file = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2))


def build_random_llama(path: str | Path, preset: str = "bench-60m", seed: int = 0) -> Path:
    """Write a random-weight float32 Llama (+ trivial tokenizer) HF folder; reuse if present.

    The folder is keyed by its contents: if ``bench_meta.json`` matches (preset, seed), the
    existing folder is returned untouched.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    meta = {"preset": preset, "seed": seed, **PRESETS[preset]}
    meta_file = path / "bench_meta.json"
    if meta_file.exists() and json.loads(meta_file.read_text()).get("spec") == meta:
        return path

    shape = dict(PRESETS[preset])
    cfg = LlamaConfig(
        vocab_size=shape.pop("vocab_size", VOCAB_SIZE),
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.02,
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(path), safe_serialization=True)
    build_trivial_tokenizer(path, cfg.vocab_size)
    meta_file.write_text(json.dumps({"spec": meta, "num_params": n_params}, indent=2))
    return path


def model_dir(preset: str, seed: int = 0) -> Path:
    """Default on-disk location of a preset model (under the git-ignored ``bench_out/``)."""
    return BENCH_OUT / "models" / f"{preset}-seed{seed}"


def ensure_model(preset: str, seed: int = 0, path: str | Path | None = None) -> Path:
    """Build (or reuse) the preset model and return its folder."""
    return build_random_llama(path or model_dir(preset, seed), preset, seed)


def kv_bytes_per_token(path: str | Path, dtype_bytes: int = 4) -> int:
    """K+V bytes one token occupies across all layers (float32 by default)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def model_num_params(path: str | Path) -> int | None:
    """Parameter count recorded at build time, if known."""
    meta = Path(path) / "bench_meta.json"
    return json.loads(meta.read_text()).get("num_params") if meta.exists() else None


# --------------------------------------------------------------------------- workload


def make_workload(
    n: int = 64,
    seed: int = 0,
    prompt_len: tuple[int, int] = (32, 256),
    short_out: tuple[int, int] = (16, 64),
    long_out: tuple[int, int] = (256, 512),
    long_frac: float = 0.10,
    vocab_size: int = VOCAB_SIZE,
) -> list[dict[str, Any]]:
    """Deterministic token-id workload: ``[{"prompt_token_ids": [...], "max_tokens": m}]``.

    Exactly ``round(long_frac * n)`` requests (6 of 64) get a long output, at seeded random
    positions; the rest get a short one. Bounds are inclusive. Prompt ids avoid the special
    ids 0-2 so no engine treats them specially.
    """
    rng = random.Random(seed)
    n_long = round(long_frac * n)
    long_idx = set(rng.sample(range(n), n_long))
    out = []
    for i in range(n):
        plen = rng.randint(*prompt_len)
        prompt = [rng.randrange(3, vocab_size) for _ in range(plen)]
        m = rng.randint(*(long_out if i in long_idx else short_out))
        out.append({"prompt_token_ids": prompt, "max_tokens": m})
    return out


def workload_summary(workload: list[dict[str, Any]]) -> str:
    """One line describing a workload."""
    p = [len(r["prompt_token_ids"]) for r in workload]
    m = [r["max_tokens"] for r in workload]
    return (
        f"{len(workload)} requests, prompt tokens {min(p)}-{max(p)} (sum {sum(p)}), "
        f"output tokens {min(m)}-{max(m)} (sum {sum(m)}, {sum(x >= 256 for x in m)} long)"
    )


_LOCKS: list[Any] = []  # open lock files, held for the life of the process


def claim_out_dir(out_dir: str | Path) -> Path:
    """Take an exclusive lock on a results folder, or exit if another run holds it.

    Two runs writing the same folder clobber each other's workload/result/log files (and
    their timings collide on the CPU), so the second one stops at once.
    """
    import fcntl

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".lock", "a+")  # kept open: the lock lives as long as the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise SystemExit(
            f"{out} is in use by another benchmark run (pid {f.read().strip() or '?'}); "
            "wait for it or pass --out-dir"
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    _LOCKS.append(f)
    return out


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks clean up child engines."""
    import signal

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def save_json(obj: Any, path: str | Path) -> None:
    """Write JSON, creating parent folders."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1))


# --------------------------------------------------------------------------- measuring


def peak_rss_mib_self() -> float:
    """Peak resident set size of this process in MiB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib_children() -> float:
    """Largest peak RSS among waited-for child processes (and their waited children)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


class ProcTreeRSSPoller:
    """Polls /proc for the summed RSS and PSS of a process tree; keeps the peaks.

    ``ru_maxrss`` of RUSAGE_CHILDREN is the max over single processes, so for an engine that
    forks workers (vLLM's engine core) the tree sum seen by polling is the honest figure;
    PSS splits shared pages (libraries mapped by every process) instead of counting them
    once per process.
    """

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid, self.interval = pid, interval
        self.peak_kib = self.peak_pss_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcTreeRSSPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mib(self) -> float:
        return self.peak_kib / 1024

    @property
    def peak_pss_mib(self) -> float:
        return self.peak_pss_kib / 1024

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d))
        todo, seen = [self.pid], []
        while todo:
            p = todo.pop()
            seen.append(p)
            todo.extend(children.get(p, []))
        return seen

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = pss = 0
            for p in self._tree():
                try:
                    for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                        if line.startswith("Rss:"):
                            rss += int(line.split()[1])
                        elif line.startswith("Pss:"):
                            pss += int(line.split()[1])
                except OSError:
                    pass
            self.peak_kib = max(self.peak_kib, rss)
            self.peak_pss_kib = max(self.peak_pss_kib, pss)
            self._stop.wait(self.interval)


def _system_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat, all cores)."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class ContentionProbe:
    """``with ContentionProbe() as c: run()`` -> ``c.foreign_cpu_s``: CPU seconds that
    processes OTHER than this one burned meanwhile (machine busy time minus our own).

    A quiet 2-core machine gives ~0; other jobs stealing cores make the figure large,
    which flags a throughput number as contended.
    """

    def __enter__(self) -> ContentionProbe:
        self._b0, self._o0, self._t0 = _system_busy_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _system_busy_s() - self._b0
        self.own_cpu_s = _own_cpu_s() - self._o0
        self.wall_s = time.perf_counter() - self._t0
        self.foreign_cpu_s = max(0.0, busy - self.own_cpu_s)

    def as_dict(self) -> dict[str, float]:
        return {
            "own_cpu_s": self.own_cpu_s,
            "foreign_cpu_s": self.foreign_cpu_s,
            "foreign_cores_avg": self.foreign_cpu_s / self.wall_s,
        }


def ttft_stats(ttfts: list[float] | None) -> dict[str, float | None]:
    """p50/p99/mean of a TTFT list (seconds)."""
    if not ttfts:
        return {"ttft_p50_s": None, "ttft_p99_s": None, "ttft_mean_s": None}
    return {
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
    }


class Timer:
    """``with Timer() as t: ...; t.s`` — wall seconds with perf_counter."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


# --------------------------------------------------------------------------- reporting


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, Python and (if importable) torch version / threads."""
    info: dict[str, Any] = {
        "cpu_model": platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    if "torch" in sys.modules:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def command_line() -> str:
    """The command that started this process, shell-quoted (``-m module`` kept as typed)."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return " ".join(shlex.quote(a) for a in argv)


def print_header(title: str) -> None:
    """Print the benchmark title, command and machine."""
    m = machine_info()
    print(f"== {title}")
    print(f"command : {command_line()}")
    print(
        f"machine : {m['cpu_model']}, {m['cores']} cores, {m.get('mem_gib', '?')} GiB, "
        f"Python {m['python']}"
        + (f", torch {m['torch']} ({m['torch_threads']} threads)" if "torch" in m else "")
    )


def interleaved_ms(calls: dict[str, Any], reps: int, warmup: int = 3) -> dict[str, float]:
    """Median milliseconds per call of each ``fn(i)`` in ``calls``, the calls taking turns (after
    each has run ``warmup`` times), so that a slower spell of a shared host falls on all of them;
    a median, because a mean is dominated by the calls that lost their core to another process."""
    import statistics
    import time

    for fn in calls.values():
        for i in range(warmup):
            fn(i)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(reps):
        for k, fn in calls.items():
            t = time.perf_counter()
            fn(i)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def fmt(x: float | None, spec: str = ".2f") -> str:
    """Format a number or show 'n/a'."""
    return "n/a" if x is None else format(x, spec)


def print_result_table(results: list[dict[str, Any]]) -> None:
    """Print one row per engine result dict (keys as produced by the runners)."""
    hdr = (
        f"{'engine':<22}{'tok/s':>9}{'wall s':>9}{'startup s':>11}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'peak RSS MiB':>14}{'CPU ms/tok':>12}{'foreign CPU':>13}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(
            f"{r['engine']:<22}{fmt(r.get('tok_per_s'), '.1f'):>9}{fmt(r.get('wall_s')):>9}"
            f"{fmt(r.get('startup_s')):>11}{fmt(r.get('ttft_p50_s')):>10}"
            f"{fmt(r.get('ttft_p99_s')):>10}{fmt(r.get('peak_rss_mib'), '.0f'):>14}"
            f"{fmt(cpu_ms_per_token(r), '.1f'):>12}"
            f"{fmt((r.get('contention') or {}).get('foreign_cores_avg'), '.2f'):>10} cores"
        )
    print(
        "(CPU ms/tok = the engine's own CPU time per generated token, steadier than tok/s on a"
        " busy machine; vLLM's includes OpenMP spin-waiting. foreign CPU = average cores used"
        " by OTHER processes during the timed generate: ~0 means an uncontended measurement)"
    )


def cpu_ms_per_token(r: dict[str, Any]) -> float | None:
    """Engine CPU milliseconds per generated (useful) token, if the run recorded them."""
    own = (r.get("contention") or {}).get("own_cpu_s")
    toks = r.get("generated_tokens") or r.get("useful_tokens")
    return 1000 * own / toks if own is not None and toks else None


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, exited, not_ready, interval: float = 0.2) -> float:
    """Poll ``url``/health until it answers 200 and return the seconds that took; raise
    RuntimeError(exited()) if ``proc`` ends first, RuntimeError(not_ready()) after ``timeout``."""
    import httpx

    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(exited())
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(not_ready())


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a child started with ``start_new_session=True`` and everything in its group.

    vLLM's EngineCore and worker processes outlive a killed runner otherwise.
    """
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_engine_subprocess(module: str, args: list[str], result_json: Path) -> dict[str, Any]:
    """Run ``python -m module args`` from the repo root (fresh process, clean RSS); load JSON."""
    cmd = [sys.executable, "-m", module, *args, "--result-json", str(result_json)]
    print(f"\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True)
    try:
        with ProcTreeRSSPoller(proc.pid) as poll:
            rc = proc.wait()
    finally:
        kill_group(proc)
    if rc != 0:
        raise RuntimeError(f"{module} exited with {rc}")
    res = json.loads(Path(result_json).read_text())
    res.setdefault("peak_rss_tree_mib", poll.peak_mib)
    res.setdefault("peak_pss_tree_mib", poll.peak_pss_mib)
    return res


# --------------------------------------------------------------------------- exactness


def pick_check_indices(workload: list[dict[str, Any]], n: int = 8) -> list[int]:
    """Deterministic subset for the exactness check: up to 2 long requests + first short ones."""
    longs = [i for i, r in enumerate(workload) if r["max_tokens"] >= 256][: min(2, n)]
    shorts = [i for i, r in enumerate(workload) if r["max_tokens"] < 256][: n - len(longs)]
    return sorted(longs + shorts)


def hf_references(
    model_path: str | Path, workload: list[dict[str, Any]], indices: list[int], dtype: str = "float32"
) -> dict[int, tuple[list[int], list[float]]]:
    """HF greedy tokens (+ top-1/top-2 logit gaps) in `dtype` (float32: the oracle), one
    request at a time, no padding."""
    from benchmarks.hf_static import hf_greedy_with_margins, load_hf_model

    model = load_hf_model(model_path, dtype=dtype)
    r = workload
    return {
        i: hf_greedy_with_margins(model, r[i]["prompt_token_ids"], r[i]["max_tokens"])
        for i in indices
    }


def compare_tokens(ref: list[int], margins: list[float] | None, got: list[int]) -> dict[str, Any]:
    """Exact comparison; on mismatch, the first differing position and the reference's gap there."""
    n = min(len(ref), len(got))
    diff = next((k for k in range(n) if ref[k] != got[k]), None)
    if diff is None and len(ref) != len(got):
        diff = n
    return {
        "match": diff is None,
        "first_diff": diff,
        "len_ref": len(ref),
        "len_got": len(got),
        "ref_gap_at_diff": margins[diff]
        if (diff is not None and margins and diff < len(margins))
        else None,
    }


def exactness_report(
    refs: dict[int, tuple[list[int], list[float]]],
    outputs_by_engine: dict[str, list[list[int]]],
    ref_name: str = "HF float32",
) -> dict[str, Any]:
    """Compare each engine's outputs with the HF references; print and return the verdicts.

    A divergence where the reference's top-1/top-2 logit gap is tiny (random-weight models
    have gaps of ~1e-3) points at float32 summation order; a large gap points at a bug.
    """
    report: dict[str, Any] = {}
    for name, outs in outputs_by_engine.items():
        rows = {i: compare_tokens(ref, gaps, outs[i]) for i, (ref, gaps) in refs.items()}
        ok = sum(r["match"] for r in rows.values())
        same = sum(min(r["len_ref"], r["len_got"]) if r["match"] else r["first_diff"] for r in rows.values())
        total = sum(r["len_ref"] for r in rows.values())
        print(
            f"exactness {name} vs {ref_name} one-at-a-time: {ok}/{len(rows)} requests identical, "
            f"{same}/{total} tokens before the first difference"
        )
        for i, r in rows.items():
            if not r["match"]:
                print(
                    f"  request {i}: first diff at token {r['first_diff']} "
                    f"(len ref {r['len_ref']}, got {r['len_got']}; "
                    f"HF top1-top2 logit gap there {fmt(r['ref_gap_at_diff'], '.2e')})"
                )
        report[name] = {"identical": ok, "checked": len(rows), "tokens_agreeing": same, "tokens": total, "rows": rows}
    return report


def print_ratio(num: dict[str, Any], den: dict[str, Any], target: float | None = None) -> float:
    """Print ``num/den`` generated-tokens/s ratio (and target verdict); return it."""
    ratio = num["tok_per_s"] / den["tok_per_s"]
    line = f"throughput ratio {num['engine']} / {den['engine']} = {ratio:.2f}x"
    if target:
        line += f" (target >= {target:g}x: {'PASS' if ratio >= target else 'FAIL'})"
    print(line)
    return ratio


def workload_sha(workload: list[dict[str, Any]]) -> str:
    """Short content hash of a workload (to reuse a peer's result only for the same input)."""
    import hashlib

    return hashlib.sha256(json.dumps(workload, sort_keys=True).encode()).hexdigest()[:16]


def run_kvledger(base_args: list[str], a: Any, result_json: Path) -> dict[str, Any]:
    """kvledger_runner in a fresh process with the engine flags both comparisons share."""
    args = list(base_args)
    for flag, v in (
        ("--block-size", a.block_size),
        ("--num-kv-blocks", a.num_kv_blocks),
        ("--max-num-batched-tokens", a.max_num_batched_tokens),
        ("--dtype", getattr(a, "dtype", None)),
        ("--kv-cache-dtype", getattr(a, "kv_cache_dtype", None)),
    ):
        if v is not None:
            args += [flag, str(v)]
    return run_engine_subprocess("benchmarks.kvledger_runner", args, result_json)


def layer_subset_copy(src: Path, dst: Path, keep: list[int]) -> Path:
    """An HF folder of ``src`` with only the decoder layers ``keep`` (renumbered), everything
    else (tokenizer, embeddings, head) as is: a draft model that agrees with its target often,
    as a layer-skipping self-draft does."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if ".layers." in name:
                i = int(name.split(".layers.")[1].split(".")[0])
                if i not in keep:
                    continue
                name = name.replace(f".layers.{i}.", f".layers.{keep.index(i)}.")
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = len(keep)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
