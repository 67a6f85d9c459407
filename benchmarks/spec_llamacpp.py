"""llama.cpp's n-gram speculation on the same model and prompts as benchmarks/spec_decode.py.

Called by ``python -m benchmarks.spec_decode --llamacpp`` (same run, after kvledger's rows), or
alone: ``python -m benchmarks.spec_llamacpp --workload copy``. Needs the tools of
``bash benchmarks/setup_llamacpp.sh`` (llama.cpp built from the vendored copy in
llama-cpp-python's sdist, Release, GGML_NATIVE). The HF folder is converted once with
llama.cpp's own ``convert_hf_to_gguf.py`` (float32, as kvledger runs it) into
``<cache dir>/models/gguf/``.

Two ``llama-server`` processes, speculation off (``--spec-type none``) and on (``--spec-type
ngram-simple``: llama.cpp's prompt lookup, drafting the ``--spec-ngram-simple-size-m`` tokens
that followed the last ``size-n`` tokens' latest earlier match), each prompt sent as token ids
to ``/completion`` greedy (top_k 1), off and on taking turns, the fastest of ``repeats`` kept.
Tokens/s is generated tokens over the server's own prompt + decode time (``timings.prompt_ms +
predicted_ms``: prefill included, as kvledger's generate timing), and, beside it, over the HTTP
request's wall time (on a loaded 2-core machine llama-server's HTTP threads added 60-200 ms a
request, several times the work itself).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import wait_healthy


def llamacpp_dir() -> Path:
    out = subprocess.run(
        ["bash", str(Path(__file__).with_name("setup_llamacpp.sh")), "--print-dir"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


def to_gguf(model: str) -> Path:
    """The HF folder as float32 GGUF, converted once by llama.cpp's own script."""
    from kvledger import envs

    src = Path(model).resolve()
    out = Path(envs.KVLEDGER_CACHE_DIR) / "models" / "gguf" / f"{src.name}-f32.gguf"
    if not out.is_file() or out.stat().st_mtime < (src / "model.safetensors").stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        script = llamacpp_dir() / "src" / "convert_hf_to_gguf.py"
        subprocess.run(
            [sys.executable, str(script), str(src), "--outfile", str(out), "--outtype", "f32"],
            check=True, capture_output=True,
        )  # fmt: skip
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, gguf: Path, threads: int, spec_args: list[str]) -> None:
        self.port = _free_port()
        binary = llamacpp_dir() / "bin" / "llama-server"
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", "1024", "-np", "1", "--no-webui",
               *spec_args]  # fmt: skip
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait()

    def _wait(self) -> None:
        wait_healthy(self.url, self.proc, 120.0, lambda: f"llama-server exited: {self.proc.stderr.read()[-2000:]}",
                     lambda: "llama-server did not become ready in 120 s")  # fmt: skip

    def complete(self, ids: list[int], max_tokens: int) -> tuple[float, list[int], dict]:
        import httpx

        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]}  # fmt: skip
        t0 = time.perf_counter()
        r = httpx.post(f"{self.url}/completion", json=body, timeout=300)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        j = r.json()
        return dt, j["tokens"], j.get("timings", {})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def compare(
    model: str, prompts: list[list[int]], max_tokens: int, k: int, threads: int,
    repeats: int = 3, size_n: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """llama.cpp off vs ngram-simple on the prompts (token ids), single stream, greedy."""
    gguf = to_gguf(model)
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(size_n),
            "--spec-ngram-simple-size-m", str(k)]  # fmt: skip
    off = Server(gguf, threads, ["--spec-type", "none"])
    try:
        on = Server(gguf, threads, spec)
    except BaseException:
        off.stop()
        raise
    try:
        t = {"off": 0.0, "on": 0.0, "wall_off": 0.0, "wall_on": 0.0}
        tokens = drafts = accepted = 0
        identical = True
        for ids in prompts:
            best = dict.fromkeys(t, float("inf"))
            for _ in range(repeats):
                for name, srv in (("off", off), ("on", on)):
                    wall, toks, tim = srv.complete(ids, max_tokens)
                    best[name] = min(best[name], (tim["prompt_ms"] + tim["predicted_ms"]) / 1e3)
                    best["wall_" + name] = min(best["wall_" + name], wall)
                    if name == "off":
                        a = toks
                    else:
                        identical &= toks == a
                        last_on = tim
            for key in t:
                t[key] += best[key]
            tokens += len(a)
            drafts += last_on.get("draft_n", 0)
            accepted += last_on.get("draft_n_accepted", 0)
        return {
            "gguf": str(gguf), "server_args_on": spec, "prompts": len(prompts), "tokens": tokens,
            "identical": identical, "off_tok_s": tokens / t["off"], "on_tok_s": tokens / t["on"],
            "ratio": t["off"] / t["on"], "wall_off_tok_s": tokens / t["wall_off"],
            "wall_on_tok_s": tokens / t["wall_on"], "wall_ratio": t["wall_off"] / t["wall_on"],
            "draft_tokens": drafts, "accepted": accepted,
        }  # fmt: skip
    finally:
        off.stop()
        on.stop()


def describe(name: str, r: dict[str, Any]) -> str:
    return (
        f"llama.cpp {name:9s}: {r['prompts']} prompts, {r['tokens']} tokens: off {r['off_tok_s']:.0f} "
        f"tok/s, on {r['on_tok_s']:.0f} tok/s, x{r['ratio']:.2f} (server's prompt + decode time; "
        f"HTTP wall: off {r['wall_off_tok_s']:.0f}, on {r['wall_on_tok_s']:.0f}, x{r['wall_ratio']:.2f}); "
        f"{r['accepted']}/{r['draft_tokens']} accepted/drafted tokens (last repeat); identical off/on: {r['identical']}"
    )


def main() -> None:
    from benchmarks import spec_decode

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="stories", choices=["stories", "copy"])
    ap.add_argument("--k", type=int, default=8, help="drafted tokens (--spec-ngram-simple-size-m)")
    ap.add_argument("--n", type=int, default=3, help="lookup n-gram (--spec-ngram-simple-size-n)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.workload == "copy":
        from benchmarks import copy_model

        model = str(copy_model.ensure())
        sets = [(n, [p for p, _ in copy_model.copy_prompts(5, s)]) for n, s in (("tuned", 1234), ("held-out", 4321))]
        max_tokens = 64
    else:
        from tokenizers import Tokenizer

        model = str(Path(spec_decode.STORIES).resolve())
        tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        enc = [tok.encode(p).ids for p in spec_decode.TUNED], [tok.encode(p).ids for p in spec_decode.HELD_OUT]
        sets = [("tuned", enc[0]), ("held-out", enc[1])]
        max_tokens = 256
    out = {}
    for name, prompts in sets:
        r = out[name] = compare(model, prompts, max_tokens, a.k, a.threads, a.repeats, a.n)
        print(describe(name, r), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
