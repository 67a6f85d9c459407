"""/v1/embeddings (issue 45) on a real `kvledger serve --runner pooling` of stories260k, driven
with the official `openai` client: strings, lists, token ids, float and base64 (the client's
default) encodings, usage, Matryoshka `dimensions` refused by name, generation endpoints refused
naming the runner, hostile bodies as 4xx, the API key, and vLLM's request metrics.

The vectors are checked against transformers on the same folder: the last token's final hidden
state, L2-normalised (vLLM's default for a decoder model without a pooling config).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.test_server import STORIES, TEMPLATE, running_stories

KEY = "sk-embed-test"
NAME = "stories-embed"
TEXTS = ["Once upon a time", "Tom and his dog Max went to the big green park and played all day"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_stories(tmp_path_factory, "--runner", "pooling", "--api-key", KEY, "--served-model-name", NAME,
                         "--chat-template", TEMPLATE) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(KEY)


@pytest.fixture(scope="module")
def reference():
    """transformers' normalised last-token hidden state of a token-id prompt."""
    hf = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return F.normalize(h, dim=-1)

    return embed


def _ids(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["tokens"]


def _cos(a, b: torch.Tensor) -> float:
    return F.cosine_similarity(torch.tensor(a, dtype=torch.float32), b, dim=0).item()


def test_openai_client_embeddings_match_transformers(client, server, reference):
    ids = [_ids(server, t) for t in TEXTS]
    for fmt in ("base64", "float"):  # the client asks for base64 unless told
        kw = {} if fmt == "base64" else {"encoding_format": "float"}
        res = client.embeddings.create(model=NAME, input=TEXTS, **kw)
        assert [d.index for d in res.data] == [0, 1] and res.model == NAME
        for d, i in zip(res.data, ids):
            assert len(d.embedding) == 64 and _cos(d.embedding, reference(i)) >= 0.9999
        assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and _cos(one.data[0].embedding, reference(ids[0])) >= 0.9999
    by_ids = client.embeddings.create(model=NAME, input=ids[1], encoding_format="float")
    assert _cos(by_ids.data[0].embedding, reference(ids[1])) >= 0.9999
    many = client.embeddings.create(model=NAME, input=[ids[1], ids[0], [1, 400, 401]])
    assert [round(_cos(d.embedding, reference(i)), 4) for d, i in zip(many.data, [ids[1], ids[0], [1, 400, 401]])] == [1.0] * 3
    assert server.ledger(KEY)["used_blocks"] == 0


def test_dimensions_refused_by_name_on_a_non_matryoshka_model(client):
    with pytest.raises(openai.BadRequestError, match="dimensions is not supported by this model"):
        client.embeddings.create(model=NAME, input="hi", dimensions=8)


def test_generation_endpoints_name_the_runner(client, server):
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model=NAME, prompt="Once", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model=NAME, prompt="Once", max_tokens=3, stream=True)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.responses.create(model=NAME, input="Once", max_output_tokens=3)
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert r.status_code == 400 and "pooling runner" in r.json()["error"]["message"], r.text
    assert server.ledger(KEY)["used_blocks"] == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": []}, "input is empty"),
        ({"input": [[]]}, "empty"),
        ({"input": ["a", ""]}, "empty"),
        ({"input": [-1]}, "input"),
        ({"input": [10**30]}, "input"),
        ({"input": [100000]}, "vocabulary"),
        ({"input": [1] * 600}, "context"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": True}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "colour": "red"}, "colour"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "input": "hi"}, "exactly one of"),
        ({"messages": "hi"}, "messages"),
        ({"input": "hi", "model": "gpt-4"}, "gpt-4"),
        ({"input": ["x"] * 2049}, "at most 2048"),
    ],
)
def test_hostile_bodies_get_4xx_naming_the_problem(server, body, needle):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server, reference):
    ids = _ids(server, TEXTS[1])
    for k, want in ((5, ids[-5:]), (-1, ids), (len(ids) + 10, ids)):
        res = client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float",
                                       extra_body={"truncate_prompt_tokens": k})  # fmt: skip
        assert res.usage.prompt_tokens == len(want)
        assert _cos(res.data[0].embedding, reference(want)) >= 0.9999


def test_chat_messages_are_one_prompt_through_the_template(client, server, reference):
    """vLLM's chat-style embeddings request: the conversation rendered by the chat template,
    tokenized without special tokens (vLLM's default for messages)."""
    msgs = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": "there was a cat."}]
    text = "Once upon a time\nthere was a cat.\n"  # TEMPLATE's rendering
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    ids = r.json()["tokens"]
    res = client.embeddings.create(model=NAME, input=[], encoding_format="float", extra_body={"messages": msgs, "input": None})
    assert res.usage.prompt_tokens == len(ids) and _cos(res.data[0].embedding, reference(ids)) >= 0.9999
    with_bos = client.embeddings.create(model=NAME, input=[], encoding_format="float",
                                        extra_body={"messages": msgs, "input": None, "add_special_tokens": True})  # fmt: skip
    assert with_bos.usage.prompt_tokens == len(ids) + 1


def test_bi_encoder_score_and_rerank_are_cosines(server, reference):
    """An embedding model scores a pair by the cosine of the two embeddings (vLLM's rule)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    docs = [TEXTS[1], "The end.", TEXTS[0]]
    vecs = {t: reference(_ids(server, t)) for t in [TEXTS[0], *docs]}
    want = [F.cosine_similarity(vecs[TEXTS[0]], vecs[d], dim=0).item() for d in docs]
    r = httpx.post(f"{server.url}/v1/score", json={"text_1": TEXTS[0], "text_2": docs}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert max(abs(d["score"] - w) for d, w in zip(r.json()["data"], want)) < 1e-4
    r = httpx.post(f"{server.url}/rerank", json={"query": TEXTS[0], "documents": docs, "top_n": 2},
                   headers=auth, timeout=60).json()  # fmt: skip
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
    assert r["results"][0]["index"] == 2 and abs(r["results"][0]["relevance_score"] - 1.0) < 1e-5  # itself
    r = httpx.post(f"{server.url}/classify", json={"input": "hi"}, headers=auth, timeout=60)
    assert r.status_code == 400 and "does not support Classification API" in r.json()["error"]["message"]
    pooled = httpx.post(f"{server.url}/pooling", json={"input": TEXTS[0]}, headers=auth, timeout=60).json()
    assert _cos(pooled["data"][0]["data"], vecs[TEXTS[0]]) >= 0.9999
    assert server.ledger(KEY)["used_blocks"] == 0


def test_raw_garbage_and_missing_key(server):
    url = f"{server.url}/v1/embeddings"
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for raw in (b"{", b"[1,2]", b"null", b'{"input": {"a": 1}}', b"\xff\xfe"):
        r = httpx.post(url, content=raw, headers=auth, timeout=30)
        assert 400 <= r.status_code < 500, (raw, r.text)
    r = httpx.post(url, content=b'{"input": "\\ud800"}', headers=auth, timeout=30)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    r = httpx.post(url, json={"input": "hi"}, timeout=30)
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong-key").embeddings.create(model=NAME, input="hi")


def test_embeddings_count_in_vllm_metrics(client, server):
    key = "vllm:request_success_total{engine=0,finished_reason=stop}"
    before = server.metrics().get(key, 0)
    client.embeddings.create(model=NAME, input=["one", "two", "three"])
    assert server.metrics()[key] == before + 3
    assert server.ledger(KEY)["used_blocks"] == 0


def test_a_generate_server_refuses_embeddings_naming_the_runner(shared_stories_server):
    """And every other pooling route, with vLLM's "does not support ... API" message. (A plain
    generate server: the one tests/test_server_load.py loads.)"""
    srv = shared_stories_server()
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        srv.client().embeddings.create(model=str(STORIES), input="hi")
    for path, body, api in [
        ("/classify", {"input": "hi"}, "Classification"),
        ("/score", {"text_1": "a", "text_2": "b"}, "Score"),
        ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank (Score)"),
        ("/pooling", {"input": "hi"}, "Pooling"),
    ]:
        r = httpx.post(f"{srv.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert f"The model does not support {api} API" in msg and "--runner pooling" in msg, msg
