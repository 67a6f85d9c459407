"""/score, /rerank (and /v1/, /v2/), /classify and /pooling (issue 45) on a real `kvledger serve`
of a cross-encoder: a random-weight LlamaForSequenceClassification with one label
(tests/model_factory.py) and stories260k's real tokenizer, driven with httpx (no client library
has these endpoints).

Scores are checked against transformers on the same folder: the tokenizer's pair encoding of
(query, document), the score head on the last token, a sigmoid (one label: vLLM's activation).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from model_factory import build_stories_cross_encoder
from transformers import AutoTokenizer

from tests.test_server import STORIES, running_server

KEY = "sk-score-test"
QUERY = "Where did Tom play with his dog?"
DOCS = [
    "Tom and his dog Max went to the big green park.",
    "Lily liked to bake cakes with her mom.",
    "The cat sat on the mat all day.",
    "Max ran after the red ball in the park.",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if not (STORIES / "tokenizer.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    path = tmp_path_factory.mktemp("reranker")
    return path, build_stories_cross_encoder(path, STORIES)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    with running_server(tmp_path_factory, str(folder[0]), "--api-key", KEY, "--served-model-name", "rr") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(folder):
    path, hf = folder
    tok = AutoTokenizer.from_pretrained(path)

    def score(a: str, b: str) -> float:
        ids = tok(a, text_pair=b).input_ids
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, 0].sigmoid().item()

    return score


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def test_score_matches_transformers(server, reference):
    refs = [reference(QUERY, d) for d in DOCS]
    for path in ("/score", "/v1/score"):
        r = _post(server, path, {"model": "rr", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "rr" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        assert all(d["object"] == "score" for d in body["data"])
        got = [d["score"] for d in body["data"]]
        assert max(abs(g - w) for g, w in zip(got, refs)) < 1e-5, (got, refs)
        assert body["usage"]["prompt_tokens"] > 0
    # Side by side: text_1[i] with text_2[i].
    r = _post(server, "/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    pairs = [reference(DOCS[0], DOCS[2]), reference(DOCS[1], DOCS[3])]
    assert max(abs(d["score"] - w) for d, w in zip(r["data"], pairs)) < 1e-5
    # use_activation false: the raw logit (the sigmoid's inverse of the reference).
    raw = _post(server, "/score", {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False}).json()
    assert abs(torch.sigmoid(torch.tensor(raw["data"][0]["score"])).item() - refs[0]) < 1e-5
    assert server.ledger(KEY)["used_blocks"] == 0


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance(server, reference, path):
    refs = [reference(QUERY, d) for d in DOCS]
    r = _post(server, path, {"model": "rr", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("rerank-") and set(body["usage"]) == {"prompt_tokens", "total_tokens"}
    res = body["results"]
    assert [x["index"] for x in res] == sorted(range(4), key=lambda i: -refs[i])
    for x in res:
        assert abs(x["relevance_score"] - refs[x["index"]]) < 1e-5
        assert x["document"] == {"text": DOCS[x["index"]]}
    # Jina/Cohere: top_n, return_documents, documents as {"text": ...} objects.
    r = _post(server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                             "return_documents": False}).json()  # fmt: skip
    assert [x["index"] for x in r["results"]] == [x["index"] for x in res[:2]]
    assert all("document" not in x for x in r["results"])


def test_classify_and_pooling_on_a_one_label_classifier(server, reference, folder):
    path, hf = folder
    tok = AutoTokenizer.from_pretrained(path)
    r = _post(server, "/classify", {"model": "rr", "input": DOCS[:2]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for d, text in zip(body["data"], DOCS[:2]):
        with torch.no_grad():
            want = hf(torch.tensor([tok(text).input_ids])).logits[0].sigmoid().tolist()
        assert d["num_classes"] == 1 and d["label"] == "LABEL_0"
        assert max(abs(a - b) for a, b in zip(d["probs"], want)) < 1e-5
    pooled = _post(server, "/pooling", {"input": DOCS[0]}).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert abs(pooled["data"][0]["data"][0] - body["data"][0]["probs"][0]) < 1e-6
    assert server.ledger(KEY)["used_blocks"] == 0


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/rerank", {"query": QUERY, "documents": []}, "documents is empty"),
        ("/rerank", {"query": "", "documents": ["a"]}, "query is empty"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": QUERY, "documents": "a"}, "documents"),
        ("/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, "documents"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v2/rerank", {"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "colour": 1}, "colour"),
        ("/score", {"text_1": [], "text_2": ["a"]}, "text_1 is empty"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1 has 2 texts"),
        ("/score", {"text_1": "a"}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "gpt-4"}, "gpt-4"),
        ("/v1/score", {"text_1": "a", "text_2": [5]}, "text_2"),
        ("/classify", {"input": []}, "input is empty"),
        ("/classify", {"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "exactly one of"),
        ("/classify", {"input": [100000]}, "vocabulary"),
        ("/v1/embeddings", {"input": "hi"}, "does not support Embeddings API"),
        ("/pooling", {"input": "hi", "task": "embed"}, "does not support Pooling API"),
    ],
)
def test_hostile_bodies_get_4xx_naming_the_problem(server, path, body, needle):
    r = _post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_api_key_is_enforced_on_every_pooling_route(server):
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/pooling"):
        assert _post(server, path, {"query": "a", "documents": ["b"]}, key=None).status_code == 401, path
        assert _post(server, path, {"query": "a", "documents": ["b"]}, key="wrong").status_code == 401, path


def test_pooling_routes_count_in_vllm_metrics(server):
    key = "vllm:request_success_total{engine=0,finished_reason=stop}"
    before = server.metrics().get(key, 0)
    assert _post(server, "/rerank", {"query": QUERY, "documents": DOCS[:3]}).status_code == 200
    assert _post(server, "/classify", {"input": DOCS[:2]}).status_code == 200
    assert server.metrics()[key] == before + 5  # one pooling request per pair / input


def test_every_endpoint_has_its_http_series(server):
    """vLLM's per-route series (prometheus-fastapi-instrumentator's names): requests by handler,
    method and status class, durations by handler; 401s from the key guard and paths no route
    serves are counted too."""
    import httpx

    def count(handler: str, status: str) -> float:
        return server.metrics().get(f"http_requests_total{{handler={handler},method=POST,status={status}}}", 0)

    ok, denied, lost = count("/v1/rerank", "2xx"), count("/score", "4xx"), count("none", "4xx")
    assert _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS[:2]}).status_code == 200
    assert _post(server, "/score", {"text_1": "a", "text_2": "b"}, key="wrong").status_code == 401
    assert httpx.post(f"{server.url}/v1/nowhere", json={}, timeout=30).status_code in (401, 404)
    m = server.metrics()
    assert count("/v1/rerank", "2xx") == ok + 1 and count("/score", "4xx") == denied + 1
    assert count("none", "4xx") == lost + 1
    assert m["http_request_duration_seconds_count{handler=/v1/rerank,method=POST}"] >= 1
