"""Hostile input against a live `kvledger serve`, and vLLM's operational surface.

One server (stories260k, two API keys, a CORS origin, a root path, request logging off) takes
a volley of malformed, out-of-range and unsupported bodies concurrently with valid requests:
no body may get a 5xx, every refusal is OpenAI's error JSON, a valid greedy request answers
the same before and after, and the ledger ends with zero used blocks. The same server checks
/tokenize, /detokenize, /version, /ping, vLLM's metric names, the field policy (forwarded or
refused, never dropped), multi-part chat content and echo with logprobs.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import ROOT, STORIES, ServerProcess

KEYS = ("sk-one", "sk-two")
ORIGIN = "http://dash.example"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
VOCAB = 512


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    d = tmp_path_factory.mktemp("hostile")
    s = ServerProcess(
        str(STORIES), "--torch-threads", "1", "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--allowed-origins", json.dumps([ORIGIN]), "--root-path", "/api",
        "--chat-template", TEMPLATE, "--disable-log-requests", "--uvicorn-log-level", "warning",
        "--num-kv-blocks", "256", "--max-num-seqs", "16",
        log_path=d / "server.log",
    )  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def auth(key: str = KEYS[1]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def greedy_text(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    r = client.completions.create(
        model=str(STORIES), prompt="Once upon a time", max_tokens=24, temperature=0
    )
    return r.choices[0].text


def _bodies() -> list[tuple[str, str | bytes]]:
    """(path, raw body): each must be refused with a 4xx."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]

    def comp(**kw) -> str:
        return json.dumps({"prompt": "Once", "max_tokens": 4, **kw})

    def chat(**kw) -> str:
        return json.dumps({"messages": msg, "max_tokens": 4, **kw})

    raw = [
        (c, b"{"), (c, b""), (c, b"null"), (c, b"[]"), (c, b"42"), (c, b'"text"'),
        (c, b"{'prompt': 'x'}"), (c, b'{"prompt": "x",}'), (c, b"\xff\xfe\x00"),
        (c, b"[" * 50_000 + b"]" * 50_000), (c, b'{"prompt": "x", "temperature": NaN}'),
        (c, b'{"prompt": "x", "temperature": 1e400}'),
        (c, b'{"prompt": "\\ud800"}'), (c, b'{"prompt": "a", "guided_regex": "a\\u0000b"}'),
        (c, b'{"prompt": "x", "stop": ["\\udfff"]}'), (ch, b'{"messages": [{"role": "user", '
                                                      b'"content": "\\ud83d"}]}'),
        (c, b'{"prompt": "x", "structured_outputs": {"regex": "\\u0000"}}'),
    ]  # fmt: skip
    typed = [
        comp(prompt=5), comp(prompt={"a": 1}), comp(prompt=[1.5]), comp(prompt=[[1, "a"]]),
        comp(max_tokens="ten"), comp(max_tokens=1.5), comp(n="two"), comp(temperature="hot"),
        comp(stop=5), comp(stop=[1]), comp(seed="x"), comp(seed=1.5), comp(stream="maybe"),
        # booleans are not numbers (pydantic would read true as 1), nor NaN a bias, nor "" a stop
        comp(prompt=[True, False]), comp(max_tokens=True), comp(n=True), comp(seed=False),
        comp(logprobs=True), comp(top_k=True), comp(temperature=True), comp(stop_token_ids=[True]),
        comp(logit_bias={"5": float("nan")}), comp(logit_bias={"5": float("inf")}),
        comp(logit_bias={"5": True}), comp(stop=""), chat(max_completion_tokens=True),
        chat(top_logprobs=True, logprobs=True), chat(store="yes"), chat(metadata=["a"]),
        comp(stop=[""]), comp(prompt=[[1, True]]), comp(allowed_token_ids=[True]),
        comp(presence_penalty=float("nan")), comp(frequency_penalty=float("inf")),
        comp(repetition_penalty=float("nan")), comp(min_p=float("nan")), comp(top_p=float("nan")),
        comp(prompt_logprobs=True), comp(min_tokens=True), comp(priority=True),
        chat(service_tier=5), chat(verbosity=1), chat(store=1), chat(metadata="a"),
    ]  # fmt: skip
    ranges = [
        comp(seed=2**70), comp(seed=-(2**70)), comp(n=10**6), comp(n=0), comp(n=-1),
        comp(logprobs=10**9), comp(logprobs=-5), comp(max_tokens=10**12), comp(max_tokens=0),
        comp(max_tokens=-1), comp(top_k=2**70), comp(temperature=-1), comp(top_p=0),
        comp(top_p=2), comp(min_p=5), comp(priority=2**80), comp(stop_token_ids=[-1]),
        comp(stop_token_ids=[2**70]), comp(best_of=5), comp(min_tokens=10, max_tokens=4),
    ]  # fmt: skip
    sizes = [
        comp(prompt=""), comp(prompt=[]), comp(prompt=[[]]), comp(prompt=[""]),
        comp(prompt=["Once"] * 1000), comp(prompt="hello " * 150_000),
        comp(prompt=[5] * 600), comp(prompt="x" * (2 << 20)),
        chat(messages=[]), chat(messages=[{"role": "user", "content": "a"}] * 5000),
    ]  # fmt: skip
    ids = [
        comp(prompt=[-1]), comp(prompt=[VOCAB]), comp(prompt=[2**63]), comp(prompt=[2**70]),
        comp(prompt=[[1, 2], [-5]]),
    ]
    chats = [
        chat(messages="hi"), chat(messages=[{"role": 1}]), chat(messages=[{"content": "x"}]),
        chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": "x"}}]}]),
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        chat(chat_template_kwargs={"tokenize": True}), chat(top_logprobs=5),
        chat(continue_final_message=True),
    ]  # fmt: skip
    policy = [
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        comp(guided_json={"type": "nonsense"}), chat(tools=[{"type": "function"}]),
        chat(tool_choice="required"), comp(use_beam_search=True), comp(tools=[{"type": "x"}]),
        comp(structured_outputs={"regex": "a("}), comp(foo=1), comp(stream_options={}),
        comp(suffix="end"), comp(prompt=[1, 2], echo=True), comp(cache_salt=""),
        chat(chat_template="{{ 1 }}"), comp(logprobs=3, logprob_token_ids=[1]),
    ]  # fmt: skip
    ops = [
        ("/tokenize", json.dumps({"tokens": [1]})),
        ("/tokenize", json.dumps({"prompt": "a", "messages": msg})),
        ("/tokenize", json.dumps({"prompt": "\ud800"})),
        ("/detokenize", json.dumps({"tokens": [-1]})),
        ("/detokenize", json.dumps({"tokens": [10**6]})),
        ("/detokenize", json.dumps({"tokens": "abc"})),
    ]
    bodies = list(raw) + [(ch if '"messages"' in b else c, b) for b in typed + ranges]
    bodies += [(ch if '"messages"' in b else c, b) for b in sizes + ids + chats + policy]
    return bodies + ops


def test_hostile_bodies_get_4xx_and_leave_the_server_untouched(srv):
    before = greedy_text(srv.url)
    bodies = _bodies()
    assert len(bodies) >= 50

    async def volley() -> tuple[list[httpx.Response], list[str]]:
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
            valid = [
                http.post(
                    "/v1/completions",
                    headers=auth(),
                    json={"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0},
                )
                for _ in range(3)
            ]
            bad = [
                http.post(path, content=body, headers={**auth(), "Content-Type": "application/json"})
                for path, body in bodies
            ]
            results = await asyncio.gather(*valid, *bad)
        return results[3:], [r.json()["choices"][0]["text"] for r in results[:3]]

    responses, concurrent = asyncio.run(volley())
    for (path, body), r in zip(bodies, responses):
        shown = (body[:80] if isinstance(body, bytes) else body[:80], path)
        assert 400 <= r.status_code < 500, (r.status_code, shown, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], shown
    assert concurrent == [before] * 3
    assert greedy_text(srv.url) == before
    led = _idle(srv)
    assert led["used_blocks"] == 0 and not led["requests"]
    assert "Traceback" not in srv.log()


def _idle(srv: ServerProcess, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        led = httpx.get(f"{srv.url}/v1/ledger", headers=auth(), timeout=30).json()
        if (led["used_blocks"] == 0 and not led["requests"]) or time.monotonic() > deadline:
            return led
        time.sleep(0.1)


def test_refusals_name_the_field(srv):
    cases = {
        "response_format": {"type": "xml"},
        "guided_regex": "a(",
        "tools": [{"type": "function"}],
        "use_beam_search": True,
        "no_such_field": 3,
    }
    for name, value in cases.items():
        r = httpx.post(
            f"{srv.url}/v1/chat/completions",
            headers=auth(),
            json={"messages": [{"role": "user", "content": "hi"}], name: value},
            timeout=60,
        )
        assert r.status_code == 400, (name, r.text)
        assert name in r.json()["error"]["message"], r.text
    # a known field at its neutral value, and an unknown one set to null, pass
    r = httpx.post(
        f"{srv.url}/v1/completions",
        headers=auth(),
        json={"prompt": "Once", "max_tokens": 2, "use_beam_search": False, "tool_choice": "none",
              "response_format": {"type": "text"}, "presence_penalty": 0, "whatever": None},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text


def test_sampling_fields_are_forwarded_or_refused_by_name(srv):
    """A vLLM sampling field is forwarded when SamplingParams has it, else a 400 naming it."""
    import dataclasses

    from kvledger.sampling_params import SamplingParams

    have = {f.name for f in dataclasses.fields(SamplingParams)}
    values = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
              "bad_words": ["girl"], "allowed_token_ids": [1, 2, 3, 4, 5]}  # fmt: skip
    for name, value in values.items():
        r = httpx.post(
            f"{srv.url}/v1/completions",
            headers=auth(),
            json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, name: value},
            timeout=60,
        )
        if name in have:
            assert r.status_code == 200, (name, r.text)
        else:
            assert r.status_code == 400 and name in r.json()["error"]["message"], (name, r.text)
    r = httpx.post(
        f"{srv.url}/v1/completions",
        headers=auth(),
        json={"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
              "prompt_logprobs": 2},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(tokenize(srv, "Once upon a time"))
    assert all(len(d) >= 1 for d in plp[1:])


def tokenize(srv: ServerProcess, prompt: str) -> list[int]:
    r = httpx.post(f"{srv.url}/tokenize", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_tokenize_detokenize_version_ping(srv):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    r = httpx.post(
        f"{srv.url}/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True}
    ).json()
    assert r["tokens"] == tok("Once upon a time").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    no_bos = httpx.post(
        f"{srv.url}/tokenize", json={"prompt": "Once", "add_special_tokens": False}
    ).json()
    assert no_bos["tokens"] == tok("Once", add_special_tokens=False).input_ids
    chat = httpx.post(
        f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi there"}]}
    ).json()
    assert chat["tokens"] == tok("Hi there\n", add_special_tokens=False).input_ids
    d = httpx.post(f"{srv.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d == {"prompt": tok.decode(r["tokens"])}
    import kvledger

    assert httpx.get(f"{srv.url}/version").json() == {"version": kvledger.__version__}
    assert httpx.get(f"{srv.url}/ping").status_code == 200
    assert httpx.post(f"{srv.url}/ping").status_code == 200


def test_several_api_keys_cors_and_root_path(srv):
    for key in KEYS:
        assert httpx.get(f"{srv.url}/v1/models", headers=auth(key)).status_code == 200
    assert httpx.get(f"{srv.url}/v1/models", headers=auth("sk-three")).status_code == 401
    # the root path: the proxy strips it; links the API gives out carry it
    assert httpx.get(f"{srv.url}/openapi.json").json()["servers"] == [{"url": "/api"}]
    pre = httpx.options(
        f"{srv.url}/v1/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"},
    )  # fmt: skip
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{srv.url}/v1/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers
    got = httpx.get(f"{srv.url}/v1/models", headers={**auth(), "Origin": ORIGIN})
    assert got.headers["access-control-allow-origin"] == ORIGIN
    assert "request cmpl-" not in srv.log()  # --disable-log-requests


def test_metrics_under_vllm_names(srv):
    greedy_text(srv.url)
    text = httpx.get(f"{srv.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }  # fmt: skip
    for name, kind in kinds.items():
        assert name in fams and fams[name].type == kind, name
        for s in fams[name].samples:
            assert s.labels["model_name"] == str(STORIES) and s.labels["engine"] == "0", s
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    length = [s.value for s in fams["vllm:request_success"].samples
              if s.labels["finished_reason"] == "length" and s.name.endswith("_total")]  # fmt: skip
    assert length[0] >= 1
    # the same figures as kvledger's own series
    gen = {
        n: fams[n].samples[0].value
        for n in ("vllm:generation_tokens", "kvledger:generation_tokens")
    }
    assert gen["vllm:generation_tokens"] == gen["kvledger:generation_tokens"] > 0
    ttft = [s for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft[0].value >= 1
    buckets = [s.labels["le"] for s in fams["vllm:e2e_request_latency_seconds"].samples
               if s.name.endswith("_bucket")]  # fmt: skip
    assert buckets[:3] == ["0.3", "0.5", "0.8"] and "7680.0" in buckets


def test_chat_text_parts_join_with_newlines_and_echo_with_logprobs(srv):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    parts = client.chat.completions.create(
        model=str(STORIES), max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Once upon"},
                                               {"type": "text", "text": "a time"}]}],
    )  # fmt: skip
    joined = client.chat.completions.create(
        model=str(STORIES), max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Once upon\na time"}],
    )  # fmt: skip
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    prompt = "Once upon a time"
    ids = tokenize(srv, prompt)
    r = client.completions.create(
        model=str(STORIES), prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    ch = r.choices[0]
    assert ch.text.startswith(prompt) and len(ch.text) > len(prompt)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 5 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    plain = client.completions.create(
        model=str(STORIES), prompt=prompt, max_tokens=5, temperature=0, logprobs=1
    )
    assert ch.text == prompt + plain.choices[0].text
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs)
    stream = client.completions.create(
        model=str(STORIES), prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1,
        stream=True,
    )  # fmt: skip
    text, toks = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            toks += c.logprobs.tokens if c.logprobs else []
    assert text == ch.text and toks == lp.tokens
    cont = client.chat.completions.create(
        model=str(STORIES), max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "Once upon a time"},
                  {"role": "assistant", "content": "there was"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert cont.choices[0].message.content


def test_env_keys_and_tls(tmp_path):
    """VLLM_API_KEY and KVLEDGER_API_KEY both work when no --api-key is given; with
    --ssl-keyfile/--ssl-certfile the server speaks HTTPS only."""
    if not (STORIES / "config.json").exists():
        pytest.skip("stories260k not found")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        capture_output=True,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip("openssl cannot make a certificate here")
    env = {**os.environ, "VLLM_API_KEY": "sk-vllm", "KVLEDGER_API_KEY": "sk-kvl",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    port = _free_port()
    log = open(tmp_path / "tls.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger", "serve", str(STORIES), "--port", str(port),
         "--torch-threads", "1", "--num-kv-blocks", "64", "--ssl-keyfile", str(key),
         "--ssl-certfile", str(cert)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    tls = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "tls.log").read_text()
            try:
                if httpx.get(f"{url}/health", verify=tls, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "tls.log").read_text()
            time.sleep(0.3)
        for k in ("sk-vllm", "sk-kvl"):
            r = httpx.get(f"{url}/v1/models", headers=auth(k), verify=tls)
            assert r.status_code == 200
        assert httpx.get(f"{url}/v1/models", headers=auth("x"), verify=tls).status_code == 401
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_tls_and_cors_flags_are_one_line_errors(tmp_path):
    for args, words in [
        (["--ssl-keyfile", str(tmp_path / "nope.pem"), "--ssl-certfile", "x"], "ssl-keyfile"),
        (["--allowed-origins", "*"], "JSON list"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "kvledger", "serve", *args],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert words in r.stderr, r.stderr

