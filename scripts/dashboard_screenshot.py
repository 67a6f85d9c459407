"""Regenerate docs/img/dashboard.png: the live dashboard, photographed mid-load.

    python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png]

Starts `kvledger serve` on ../shared/models/stories260k with a small int8 KV pool (so prefix
sharing, swapping, preemption and quantisation savings all show), drives it with concurrent completions through the
`openai` client (half of them share a long system prompt), and takes the screenshot in
headless Chromium (Debian's `chromium` package, driven by playwright) once the pool is busy.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from kvledger import envs

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260k"
CHROMIUM = envs.KVLEDGER_CHROMIUM
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SYSTEM = (
    "Once upon a time there was a little girl named Lily. She lived in a small house with her "
    "mom and dad and her dog. Every day she went to the park to play."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(url: str, stop: threading.Event, worker: int) -> None:
    """Completions back to back until ``stop``: long and short, some sharing a prefix."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    i = 0
    while not stop.is_set():
        prompt = (SYSTEM + " " if worker % 2 == 0 else "") + f"Tom had {worker + i} red balls."
        try:
            client.completions.create(
                model="stories260k", prompt=prompt, max_tokens=120 + 40 * (i % 4), temperature=0.8
            )
        except openai.APIError:
            if stop.is_set():
                return  # the server is going down
            raise
        i += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--workers", type=int, default=10)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvledger", "serve", str(STORIES), "--port", str(port),
           "--torch-threads", "1", "--num-kv-blocks", "80", "--max-num-seqs", "8",
           "--swap-space", "0.002", "--preemption-mode", "swap",
           "--served-model-name", "stories260k", "--kv-cache-dtype", "int8"]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    threads = []
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit("the server did not start")
        threads = [
            threading.Thread(target=load, args=(url, stop, w), daemon=True)
            for w in range(args.workers)
        ]
        for t in threads:
            t.start()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/dashboard")
            time.sleep(20)  # let the charts fill with some history
            busy = "f.ledger.used_blocks > 40 && f.ledger.num_requests.running > 2"
            for want in (busy + " && f.ledger.swapped_blocks > 0", busy):
                for _ in range(200):  # 40 s; the page's CSP forbids wait_for_function's eval
                    if page.evaluate(
                        f"(() => {{ const f = window.__kvl.frame; return f && {want}; }})()"
                    ):
                        break
                    time.sleep(0.2)
                else:
                    continue
                break
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        print(f"wrote {out}")
    finally:
        stop.set()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
