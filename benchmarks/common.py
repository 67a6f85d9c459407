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

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.02,
        **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(path), safe_serialization=True)
    build_trivial_tokenizer(path)
    meta_file.write_text(json.dumps({"spec": meta, "num_params": n_params}, indent=2))
    return path


def model_dir(preset: str, seed: int = 0) -> Path:
    """Default on-disk location of a preset model (under the git-ignored ``bench_out/``)."""
    return BENCH_OUT / "models" / f"{preset}-seed{seed}"


def ensure_model(preset: str, seed: int = 0, path: str | Path | None = None) -> Path:
    """Build (or reuse) the preset model and return its folder."""
    return build_random_llama(path or model_dir(preset, seed), preset, seed)


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
    """Polls /proc for the summed RSS of a process and all its descendants; keeps the peak.

    ``ru_maxrss`` of RUSAGE_CHILDREN is the max over single processes, so for an engine that
    forks workers (vLLM's engine core) the tree sum seen by polling is the honest figure.
    """

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid, self.interval, self.peak_kib = pid, interval, 0
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
            total = 0
            for p in self._tree():
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
                            break
                except OSError:
                    pass
            self.peak_kib = max(self.peak_kib, total)
            self._stop.wait(self.interval)


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0-100); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


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
    """The command that started this process, shell-quoted."""
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


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


def fmt(x: float | None, spec: str = ".2f") -> str:
    """Format a number or show 'n/a'."""
    return "n/a" if x is None else format(x, spec)


def print_result_table(results: list[dict[str, Any]]) -> None:
    """Print one row per engine result dict (keys as produced by the runners)."""
    hdr = f"{'engine':<22}{'tok/s':>9}{'wall s':>9}{'startup s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'peak RSS MiB':>14}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(
            f"{r['engine']:<22}{fmt(r.get('tok_per_s'), '.1f'):>9}{fmt(r.get('wall_s')):>9}"
            f"{fmt(r.get('startup_s')):>11}{fmt(r.get('ttft_p50_s')):>10}"
            f"{fmt(r.get('ttft_p99_s')):>10}{fmt(r.get('peak_rss_mib'), '.0f'):>14}"
        )


def run_engine_subprocess(module: str, args: list[str], result_json: Path) -> dict[str, Any]:
    """Run ``python -m module args`` from the repo root (fresh process, clean RSS); load JSON."""
    cmd = [sys.executable, "-m", module, *args, "--result-json", str(result_json)]
    print(f"\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    with ProcTreeRSSPoller(proc.pid) as poll:
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"{module} exited with {rc}")
    res = json.loads(Path(result_json).read_text())
    res.setdefault("peak_rss_tree_mib", poll.peak_mib)
    return res
