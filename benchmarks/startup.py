"""Start-up time: `kvledger serve` to its first /health 200, and `LLM()` on the embedded model.

Compares checkouts of kvledger run by run, alternated (the order flipped every round), so that a
drifting machine weighs on all of them alike: each tree runs with ``PYTHONPATH`` set to it.

    python -m benchmarks.startup                            # this checkout
    python -m benchmarks.startup --tree ../before --tree .  # two checkouts, alternated
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import print_header

LLM_CODE = "import time; t = time.monotonic(); from kvledger import LLM; LLM(); print(time.monotonic() - t)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_seconds(tree: Path, timeout_s: float = 300.0) -> float:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.monotonic()
    p = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "serve", "--port", str(port), "--no-dashboard"],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        while time.monotonic() - t0 < timeout_s:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(0.05)
            if p.poll() is not None:
                raise SystemExit(f"{tree}: kvledger serve exited with {p.returncode}")
        raise SystemExit(f"{tree}: not healthy within {timeout_s:.0f} s")
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait()


def llm_seconds(tree: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", LLM_CODE], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", type=Path, help="a kvledger checkout (repeat to compare)")
    ap.add_argument("--runs", type=int, default=6, help="rounds (each tree once per round)")
    ap.add_argument("--what", choices=("serve", "llm", "both"), default="both")
    a = ap.parse_args()
    trees = [t.resolve() for t in (a.tree or [Path(__file__).resolve().parents[1]])]
    print_header("kvledger start-up")
    kinds = ("serve", "llm") if a.what == "both" else (a.what,)
    for kind in kinds:
        fn = serve_seconds if kind == "serve" else llm_seconds
        res: dict[Path, list[float]] = {t: [] for t in trees}
        for i in range(a.runs):
            for t in trees if i % 2 == 0 else trees[::-1]:
                res[t].append(fn(t))
                time.sleep(1.0)
        what = "kvledger serve -> /health 200" if kind == "serve" else "LLM() (embedded model)"
        for t, v in res.items():
            runs = " ".join(f"{x:.2f}" for x in v)
            print(f"{what:32s} {t}: median {statistics.median(v):.2f} s (runs {runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
