"""`kvledger serve` as a user runs it: a real server process on a loopback port, driven with the
official `openai` client (and raw httpx where the client would refuse to send the request).

Two servers, side by side: KEYED (API key, served name, a chat template for stories260k, which
has none; shared with tests/test_json_whitespace.py through conftest's shared_stories_server)
and PLAIN (no key, no template, a 64 KiB body limit). The last test stops PLAIN with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260k"
KEY = "sk-test-kvledger"
NAME = "stories"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
# The README's known-good greedy continuation of "Once upon a time" (float32).
ONCE = ", there was a little girl named Lily. She loved to play outside in the park."
# Longer than one 16-token block, and used by no other test (so its first run is uncached).
LONG_PROMPT = (
    "Tom and his dog Max went to the big green park. They ran and jumped and played with a "
    "red ball all day long. Then"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kvledger serve ...` in a subprocess, logging to a file (a pipe could fill)."""

    def __init__(self, *args: str, log_path: Path, new_session: bool = False) -> None:
        """new_session: its own process group, for a test that signals the whole group."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "kvledger", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            start_new_session=new_session,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def client(self, api_key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw
        )

    def metrics(self) -> dict[str, float]:
        """Every sample as 'name{label=value,...}' -> value (labels sorted, model_name dropped)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def ledger(self, api_key: str | None = KEY) -> dict:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(f"{self.url}/v1/ledger", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The ledger once no request holds a block (aborts land between steps)."""
        deadline = time.monotonic() + timeout
        while True:
            led = self.ledger()
            if led["used_blocks"] == 0 and not led["requests"] or time.monotonic() > deadline:
                return led
            time.sleep(0.1)


@contextmanager
def running_server(tmp_path_factory, model: str, *args: str) -> Iterator[ServerProcess]:
    """`kvledger serve MODEL` (one torch thread) with ``args``, for a module's tests."""
    srv = ServerProcess(model, *args, "--torch-threads", "1",
                        log_path=tmp_path_factory.mktemp("srv") / "server.log")  # fmt: skip
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def running_stories(tmp_path_factory, *args: str):
    """``running_server`` of stories260k; the test is skipped without the model."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    return running_server(tmp_path_factory, str(STORIES), *args)


# KEYED's flags: conftest's shared_stories_server starts it once for the session, for this module
# and tests/test_json_whitespace.py (which needs exactly this chat template).
KEYED_ARGS = ("--api-key", KEY, "--served-model-name", NAME, "--chat-template", TEMPLATE)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, shared_stories_server):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    keyed = shared_stories_server(*KEYED_ARGS, wait=False)  # both start side by side
    plain = ServerProcess(str(STORIES), "--torch-threads", "1", "--max-body-bytes", "64KiB",
                          "--disable-uvicorn-access-log", log_path=tmp_path_factory.mktemp("serve") / "plain.log")
    try:
        keyed.wait_ready()
        plain.wait_ready()
        yield keyed, plain
    finally:
        plain.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def plain(servers) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def greedy(client: openai.OpenAI, prompt: str, **kw):
    return client.completions.create(model=NAME, prompt=prompt, temperature=0, **kw)


def stream_texts(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Chunks reassembled per choice index: (texts, finish reasons, usage chunks)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = []
    for chunk in stream:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                assert ch.index not in reasons or reasons[ch.index] is None, (
                    "finish_reason sent twice"
                )
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, usage


# -- basics -----------------------------------------------------------------------------------


def test_health_and_metrics_are_open_but_v1_needs_the_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-wrong").models.list()


def test_access_log_by_default_and_off_with_vllms_flag(server, plain):
    """uvicorn's access log at the default --uvicorn-log-level info, as in vLLM; none with
    --disable-uvicorn-access-log (long-running servers otherwise write a line per request)."""
    for s in (server, plain):
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while '"GET /health HTTP/1.1" 200' not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert '"GET /health HTTP/1.1" 200' in server.log()
    assert "HTTP/1.1\" " not in plain.log(), plain.log()[-2000:]


def test_the_api_key_never_reaches_the_access_log(server):
    """A key in a URL (the dashboard's ?key=, or any credential-like query name on any route) is
    written to the access log as ***; the dashboard trades ?key= for a cookie by a redirect."""
    with httpx.Client(base_url=server.url, follow_redirects=True) as c:
        page = c.get("/dashboard", params={"key": KEY})
        assert page.status_code == 200 and "key=" not in str(page.url)  # redirected, cookie set
        assert c.get("/dashboard/data").status_code == 200
    # ?api_key= is not how the dashboard takes a key (401), but it is redacted all the same
    assert httpx.get(f"{server.url}/dashboard", params={"api_key": KEY, "x": "1"}).status_code == 401
    # any credential-like name, on any route (the API answers 401: a key goes in the header)
    assert httpx.get(f"{server.url}/v1/models", params={"x-api-key": KEY, "client_secret": KEY}).status_code == 401
    want = "/v1/models?x-api-key=***&client_secret=*** HTTP/1.1"
    deadline = time.monotonic() + 10
    while want not in (log := server.log()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert want in log, log
    assert "GET /dashboard?key=*** HTTP/1.1" in log and "/dashboard?api_key=***&x=1" in log, log
    assert KEY not in log, log


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_is_the_known_greedy_story(client):
    r = greedy(client, "Once upon a time", max_tokens=40)
    c = r.choices[0]
    assert c.text.startswith(ONCE) and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 40)
    assert r.usage.total_tokens == 45 and r.model == NAME and r.object == "text_completion"


def test_streamed_chunks_reassemble_to_the_same_text(client):
    full = greedy(client, "Once upon a time", max_tokens=60).choices[0]
    stream = greedy(
        client,
        "Once upon a time",
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, usage = stream_texts(stream)
    assert texts == {0: full.text} and reasons == {0: full.finish_reason}
    assert len(usage) == 1 and usage[0].completion_tokens == 60 and usage[0].prompt_tokens == 5


def test_return_token_ids_streamed_add_up_to_the_non_streamed_ids(client):
    """vLLM's return_token_ids: the benchmark against vLLM's server compares greedy tokens."""
    prompt = "Once upon a time"
    extra = {"return_token_ids": True}
    full = greedy(client, prompt, max_tokens=20, extra_body=extra).choices[0]
    assert len(full.model_extra["token_ids"]) == 20 and full.model_extra["prompt_token_ids"]
    ids, prompt_ids = [], []
    for chunk in greedy(client, prompt, max_tokens=20, stream=True, extra_body=extra):
        for c in chunk.choices:
            ids += c.model_extra["token_ids"] or []
            prompt_ids.append(c.model_extra["prompt_token_ids"])
    assert ids == full.model_extra["token_ids"]
    assert prompt_ids[0] == full.model_extra["prompt_token_ids"]
    assert all(p is None for p in prompt_ids[1:])


def test_n2_and_seed_stream_matches_non_stream(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=7, n=2)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    texts, reasons, _ = stream_texts(client.completions.create(**kw, stream=True))
    assert texts == {c.index: c.text for c in r.choices}
    assert reasons == {c.index: c.finish_reason for c in r.choices}
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens >= 2


def test_seed_reproducible_and_seeds_differ(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=NAME, prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1) == sample(1)
    assert len({sample(s) for s in (1, 2, 3, 4)}) >= 2


def test_stop_strings_cut_the_text_streamed_or_not(client):
    r = greedy(client, "Once upon a time", max_tokens=40, stop=["Lily", "zzz"])
    c = r.choices[0]
    assert c.text == ", there was a little girl named " and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == "Lily"
    # A stop string spanning several tokens: nothing of it may leak into the stream.
    for stop in (["girl named"], ["Lily"]):
        full = greedy(client, "Once upon a time", max_tokens=40, stop=stop).choices[0].text
        texts, reasons, _ = stream_texts(
            greedy(client, "Once upon a time", max_tokens=40, stop=stop, stream=True)
        )
        assert texts == {0: full} and reasons == {0: "stop"}
        assert stop[0] not in full


def test_repeated_prompt_reports_cached_tokens(server, client):
    before = server.metrics()
    first = greedy(client, LONG_PROMPT, max_tokens=4)
    second = greedy(client, LONG_PROMPT, max_tokens=4)
    n = first.usage.prompt_tokens
    assert n > 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < n and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    after = server.metrics()
    hits = after["kvledger:prefix_cache_hits_total"] - before["kvledger:prefix_cache_hits_total"]
    assert hits == cached


def test_completion_logprobs(client):
    r = greedy(client, "Once upon a time", max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for _tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(val)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_with_template_streamed_and_not(client):
    msgs = [{"role": "user", "content": "Lily had a red ball"}]
    r = client.chat.completions.create(
        model=NAME,
        messages=msgs,
        temperature=0,
        max_completion_tokens=20,
        logprobs=True,
        top_logprobs=2,
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason == "length"
    assert r.object == "chat.completion" and r.usage.completion_tokens == 20
    assert len(c.logprobs.content) == 20 and all(
        len(t.top_logprobs) == 2 for t in c.logprobs.content
    )
    stream = client.chat.completions.create(
        model=NAME, messages=msgs, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []


def test_chat_without_a_template_is_a_clear_400(plain):
    c = plain.client(api_key="unused")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=str(STORIES), messages=[{"role": "user", "content": "hi"}])
    assert "--chat-template" in e.value.body["message"]


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--chat-template", "no-such-template-file"], "neither a file nor a Jinja template"),
        (["--chat-template", "{% for %}"], "does not parse"),
        (["--max-body-bytes", "1G"], "GiB"),
        (["--port", "70000"], "--port"),
        (["--torch-threads", "0"], "--torch-threads"),
    ],
)
def test_bad_serve_flags_are_one_line_errors_before_loading(args, words):
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert r.stderr.startswith("kvledger: error:") and "Traceback" not in r.stderr


def post(
    server: ServerProcess, path: str, body, key: str | None = KEY, timeout: float = 60
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if not isinstance(body, bytes | str):
        body = json.dumps(body)
    headers["Content-Type"] = "application/json"
    return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=timeout)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    for w in words:
        assert w in err["message"], err["message"]
    return err


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "hi", "temperature": -1}, ["temperature"]),
        ({"prompt": "hi", "top_p": 2}, ["top_p"]),
        ({"prompt": "hi", "n": 0}, ["n must"]),
        ({"prompt": "hi", "max_tokens": 0}, ["max_tokens"]),
        ({"prompt": "hi", "max_tokens": "many"}, ["max_tokens"]),
        ({"prompt": "hi", "logprobs": 99}, ["logprobs"]),
        ({"prompt": "hi", "presence_penalty": 2.5}, ["presence_penalty must be in [-2, 2]"]),
        ({"prompt": "hi", "logit_bias": {"999": 5}}, ["logit_bias has token id 999"]),
        ({"prompt": "hi", "use_beam_search": True}, ["use_beam_search"]),  # refused by name
        ({"prompt": [99999]}, ["vocabulary"]),
        ({"prompt": "hi", "max_tokens": 10_000}, ["context length"]),
        ({"prompt": "word " * 600}, ["context"]),
        ({"prompt": []}, ["empty"]),
        ({}, ["prompt"]),
    ],
)
def test_bad_completion_requests_are_400(server, body, words):
    assert_error(post(server, "/v1/completions", body), 400, *words)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"messages": []}, ["messages"]),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, ["top_logprobs"]),
        ({"messages": [{"content": "hi"}]}, ["role"]),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["image_url"]),
    ],
)
def test_bad_chat_requests_are_400(server, body, words):
    assert_error(post(server, "/v1/chat/completions", body), 400, *words)


def test_malformed_json_is_400_and_unknown_routes_404(server):
    assert_error(post(server, "/v1/completions", b"{bad json"), 400, "JSON")
    r = httpx.get(f"{server.url}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(r, 404)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_wrong_or_missing_key_is_401(server):
    assert_error(post(server, "/v1/completions", {"prompt": "hi"}, key=None), 401, "API key")
    assert_error(post(server, "/v1/completions", {"prompt": "hi"}, key="nope"), 401, "API key")


def test_oversized_bodies_are_413(server, plain):
    big = {"prompt": "x" * (1 << 20)}  # just over the default 1 MiB
    assert_error(post(server, "/v1/completions", big), 413, "limit")
    assert_error(post(plain, "/v1/completions", {"prompt": "y" * 70_000}, key=None), 413)

    def chunked():  # no Content-Length: the limit must hold while reading
        for _ in range(20):
            yield b" " * 8192

    r = httpx.post(f"{plain.url}/v1/completions", content=chunked(), timeout=30)
    assert_error(r, 413)


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    expected = greedy(client, "Once upon a time", max_tokens=80).choices[0].text
    result = {}

    def run():
        texts, _, _ = stream_texts(greedy(client, "Once upon a time", max_tokens=80, stream=True))
        result["text"] = texts[0]

    t = threading.Thread(target=run)
    t.start()
    for body in (
        {"prompt": "hi", "temperature": -1},
        {"prompt": "word " * 600},
        {"prompt": [99999]},
    ):
        assert post(server, "/v1/completions", body).status_code == 400
    assert post(server, "/v1/completions", {"prompt": "x" * (2 << 20)}).status_code == 413
    t.join(120)
    assert result["text"] == expected


def test_non_streaming_client_that_times_out_is_aborted(server):
    before = server.metrics().get("kvledger:request_success_total{finished_reason=abort}", 0)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.5)
    led = server.wait_idle()
    assert led["used_blocks"] == 0 and led["requests"] == {}
    after = server.metrics()["kvledger:request_success_total{finished_reason=abort}"]
    assert after == before + 1


# -- the ledger and metrics -------------------------------------------------------------------


def test_ledger_shape_and_live_request_then_abort_frees_blocks(server, client):
    led = server.wait_idle()
    for key in ("total_blocks", "used_blocks", "free_blocks", "cached_blocks", "block_size",
                "bytes_per_token", "bytes_per_block", "total_bytes", "used_bytes", "utilization",
                "usage", "shared_blocks", "swapped_blocks", "requests", "preemptions"):  # fmt: skip
        assert key in led, key
    assert led["bytes_per_token"] == 1280  # 5 layers x 4 KV heads x 8 dims x (K, V) x fp32
    assert led["used_blocks"] == 0 and led["requests"] == {}
    assert led["num_requests"] == {"running": 0, "waiting": 0, "swapped": 0}
    assert led["total_blocks"] == led["free_blocks"] + led["cached_blocks"]
    aborts = server.metrics().get("kvledger:request_success_total{finished_reason=abort}", 0)

    stream = greedy(
        client, "Once upon a time", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    live = server.ledger()
    ((rid, blocks),) = live["requests"].items()
    assert rid.startswith("cmpl-") and blocks["blocks"] >= 1 and live["used_blocks"] >= 1
    assert blocks["private_blocks"] + blocks["shared_blocks"] == blocks["blocks"]
    assert live["num_requests"]["running"] == 1
    stream.close()  # the client goes away mid-stream: the server must abort it
    led = server.wait_idle()
    assert led["used_blocks"] == 0 and led["requests"] == {}
    m = server.metrics()
    assert m["kvledger:request_success_total{finished_reason=abort}"] == aborts + 1


def test_metrics_parse_with_vllm_names(server, client):
    greedy(client, "Once upon a time", max_tokens=8)
    server.wait_idle()
    m = server.metrics()
    for name in (
        "kvledger:kv_cache_usage_perc", "kvledger:num_requests_running",
        "kvledger:num_requests_waiting", "kvledger:num_requests_swapped",
        "kvledger:kv_blocks_used", "kvledger:kv_blocks_free", "kvledger:kv_blocks_cached",
        "kvledger:prefix_cache_queries_total", "kvledger:prefix_cache_hits_total",
        "kvledger:num_preemptions_total{mode=swap}", "kvledger:num_preemptions_total{mode=recompute}",
        "kvledger:swapped_bytes_total{direction=out}", "kvledger:swapped_bytes_total{direction=in}",
        "kvledger:generation_tokens_total", "kvledger:prompt_tokens_total",
        "kvledger:time_to_first_token_seconds_count", "kvledger:inter_token_latency_seconds_count",
        "kvledger:request_success_total{finished_reason=length}",
    ):  # fmt: skip
        assert name in m, name
    assert m["kvledger:kv_blocks_used"] == 0 and m["kvledger:kv_cache_usage_perc"] == 0
    assert m["kvledger:num_requests_running"] == 0
    assert m["kvledger:generation_tokens_total"] >= 8 and m["kvledger:prompt_tokens_total"] >= 5
    assert m["kvledger:time_to_first_token_seconds_count"] >= 1
    assert m["kvledger:inter_token_latency_seconds_count"] >= 7
    led = server.ledger()
    assert m["kvledger:kv_blocks_free"] == led["free_blocks"]
    assert m["kvledger:kv_blocks_cached"] == led["cached_blocks"]
    assert not any(k.endswith("_created") for k in m)


# -- AsyncEngine in-process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_llm():
    import torch

    from kvledger import LLM

    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on 2 busy cores: more threads only contend
    try:
        yield LLM(str(STORIES), calibrate_preemption=False, num_kv_blocks=64)
    finally:
        torch.set_num_threads(threads)


def test_async_engine_matches_offline_and_cancelling_a_consumer_aborts(small_llm):
    from kvledger import SamplingParams
    from kvledger.engine.async_engine import AsyncEngine

    prompts = ["Once upon a time", "Lily and Tom", "The big red ball"]
    params = SamplingParams(temperature=0, max_tokens=24)
    offline = [o.outputs[0].text for o in small_llm.generate(prompts, params, use_tqdm=False)]
    engine = small_llm.engine

    async def main():
        aengine = AsyncEngine(engine)

        async def final(i: int, p: str) -> str:
            async for out in aengine.generate(p, params, f"r{i}"):
                last = out
            assert last.finished
            return last.outputs[0].text

        texts = await asyncio.gather(*(final(i, p) for i, p in enumerate(prompts)))
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

        async def forever() -> None:
            async for _ in aengine.generate("Once upon a time", long, "long"):
                pass

        task = asyncio.create_task(forever())
        while not engine.kv.num_used_blocks:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        led = await aengine.ledger()  # the abort was queued before this read
        aengine.shutdown()
        return texts, led

    texts, led = asyncio.run(main())
    assert texts == offline
    assert led["used_blocks"] == 0 and led["requests"] == {}


def test_async_engine_step_failure_fails_streams_not_the_process(small_llm, monkeypatch):
    from kvledger import SamplingParams
    from kvledger.engine.async_engine import AsyncEngine, EngineDeadError

    engine = small_llm.engine

    def broken_step():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine, "step", broken_step)

    async def main():
        aengine = AsyncEngine(engine)
        with pytest.raises(EngineDeadError):
            async for _ in aengine.generate("Once upon a time", SamplingParams(max_tokens=4), "x"):
                pass
        assert not aengine.is_running
        with pytest.raises(EngineDeadError):
            await aengine.add_request("hi", SamplingParams(), "y")
        aengine.shutdown()  # aborts what the dead engine still held

    asyncio.run(main())
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0


# -- shutdown (stops PLAIN: keep last) -----------------------------------------------------------


def test_sigterm_mid_stream_shuts_down_cleanly(plain):
    c = plain.client(api_key="unused")
    stream = c.completions.create(
        model=str(STORIES), prompt="Once upon a time", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    it = iter(stream)
    next(it)
    t0 = time.monotonic()
    plain.proc.send_signal(signal.SIGTERM)
    try:
        for _ in it:  # the stream ends: finished, or cut when the grace period runs out
            pass
    except (openai.APIError, httpx.HTTPError):
        pass
    plain.proc.wait(30)
    assert time.monotonic() - t0 < 30
    assert plain.proc.returncode in (0, -signal.SIGTERM), plain.log()
    log = plain.log()
    assert "engine stopped" in log and "Traceback" not in log, log


def test_penalties_and_logit_bias_reach_the_engine(client, small_llm):
    from kvledger import SamplingParams

    prompt = "Once upon a time"
    r = greedy(client, prompt, max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5,
               logit_bias={"13": -100}, extra_body={"repetition_penalty": 1.2})  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5,
                        logit_bias={13: -100.0}, repetition_penalty=1.2)  # fmt: skip
    offline = small_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text
    plain = greedy(client, prompt, max_tokens=40).choices[0].text
    assert r.choices[0].text == offline != plain


def test_omp_wait_defaults_spin_briefly_and_keep_the_users_choice():
    """`kvledger serve` makes OpenMP workers spin 10,000 rounds then sleep, unless the user set
    either variable (an ACTIVE policy must not be cut short by our spin count)."""
    from kvledger.commands.serve import OMP_SPIN_COUNT, set_omp_wait_defaults

    env: dict[str, str] = {}
    set_omp_wait_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": OMP_SPIN_COUNT}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(mine)
        set_omp_wait_defaults(env)
        assert env == mine
