"""Two kvledger servers as data-parallel replicas behind a router, on loopback: sglang-router
(a production router from PyPI) streaming through them, kvledger's own cache-aware router
following a 1,000-token prefix to the replica that caches it, and a replica killed mid-stream."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from test_server import ServerProcess

from kvledger.model.tiny import default_model_path

pytest.importorskip("sglang_router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    model = str(default_model_path())
    srvs = []
    for i in range(2):
        cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/ev{i}", "replay_endpoint": f"ipc://{d}/rp{i}"}
        srvs.append(ServerProcess(model, "--torch-threads", "1", "--num-kv-blocks", "512",
                                  "--kv-events-config", json.dumps(cfg), log_path=d / f"w{i}.log"))
    try:
        for s in srvs:
            s.wait_ready()
        yield model, srvs, [f"ipc://{d}/ev{i}" for i in range(2)], [f"ipc://{d}/rp{i}" for i in range(2)]
    finally:
        for s in srvs:
            s.stop()
            assert "Traceback" not in s.log(), s.log()


def test_sglang_router_streams_through_kvledger_workers(replicas, tmp_path):
    model, srvs, _, _ = replicas
    info = httpx.get(f"{srvs[0].url}/server_info").json()
    assert info["served_model_name"] == model and (info["dp_size"], info["tp_size"]) == (1, 1)
    load = httpx.get(f"{srvs[0].url}/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.get(f"{srvs[0].url}/get_model_info").json()["is_generation"] is True

    port = _free_port()
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--policy", "cache_aware", "--worker-urls", srvs[0].url, srvs[1].url, "--log-level", "warn",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        deadline = time.monotonic() + 60
        while True:  # the router registers its workers in the background
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                if {m["id"] for m in models.get("data", [])} == {model}:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.3)
        messages = [{"role": "user", "content": "Count the blocks in the ledger."}]
        direct = srvs[1].client().chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        for _ in range(2):  # cache_aware sends a repeat to the same worker; both are checked
            pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=model, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices]
            assert "".join(pieces) == direct.choices[0].message.content and len(pieces) > 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        log.close()


class _RouterThread:
    """kvledger's router (the `kvledger router` app) served by uvicorn in a thread."""

    def __init__(self, args: list[str]) -> None:
        import uvicorn

        from kvledger.cli import build_parser
        from kvledger.commands.router import config_from_args
        from kvledger.router.server import build_router_app

        self.port = _free_port()
        ns = build_parser(["router"]).parse_args(["router", *args])
        self.app = build_router_app(config_from_args(ns))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def state(self) -> list[dict]:
        return httpx.get(f"{self.url}/router/state").json()["replicas"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def _complete(url: str, model: str, prompt: list[int], **kw) -> tuple[int, dict]:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.headers["x-kvledger-replica"]), r.json()


def test_cache_aware_router_follows_the_prefix_and_survives_a_dead_replica(replicas):
    model, srvs, events, replays = replicas
    rng = random.Random(18)
    prefix = [rng.randrange(3, 500) for _ in range(1000)]
    router = _RouterThread(["--worker-urls", *(s.url for s in srvs), "--kv-events-endpoints", *events,
                            "--kv-events-replay-endpoints", *replays, "--tokenizer", model])
    try:
        holder, _ = _complete(router.url, model, prefix + [7, 8, 9])
        deadline = time.monotonic() + 20
        while router.state()[holder]["cached_blocks"] < 62:  # 1,003 tokens: 62 full blocks
            assert time.monotonic() < deadline, router.state()
            time.sleep(0.05)
        assert router.state()[1 - holder]["cached_blocks"] == 0
        # Another tenant's prompt goes to the idle replica; every request sharing the prefix
        # goes to the holder and hits its cache.
        other, _ = _complete(router.url, model, [rng.randrange(3, 500) for _ in range(300)])
        assert other == 1 - holder
        for q in range(4):
            rank, body = _complete(router.url, model, prefix + [20 + q] * 5)
            assert rank == holder
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 62 * 16
        # Kill the holder while it streams: that request fails naming the replica; the others serve.
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model=model, prompt=prefix + [99], max_tokens=1000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        srvs[holder].proc.send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError, match=f"data-parallel replica {holder} .* failed"):
            for _ in stream:
                pass
        for q in range(3):
            rank, body = _complete(router.url, model, prefix + [40 + q])
            assert rank == 1 - holder and body["choices"][0]["text"] is not None
        st = router.state()
        assert not st[holder]["alive"] and st[1 - holder]["alive"]
        assert st[holder]["num_requests"] == 0
        metrics = httpx.get(f"{router.url}/metrics").text
        assert f'kvledger_router_replica_alive{{replica="{holder}"}} 0' in metrics
        assert httpx.get(f"{router.url}/health").json()["replicas_alive"] == 1
    finally:
        router.stop()
