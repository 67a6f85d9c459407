"""Classification and scoring (issue 45): *ForSequenceClassification folders and bare decoders on
the pooling runner, LLM.classify() / LLM.score(), against transformers in float32.

Random-weight folders (tests/model_factory.py): transformers' Llama / Qwen2 / Qwen3
ForSequenceClassification (the ``score`` head on the last token; no pad token in these configs,
so transformers pools the last token too) and LlamaModel / Qwen3Model saved without a head. The
prompts include one longer than the step's token budget (chunked prefill) and two that share a
cached prefix. Probabilities must match to 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_factory import (
    build_hf_bare_decoder,
    build_hf_classifier,
    build_hf_model,
    build_stories_cross_encoder,
    tiny_config,
)
from transformers import AutoTokenizer

from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.llm import LLM
from kvledger.pooling.params import PoolingParams
from tests.test_pooling import BUDGET, PROMPTS
from tests.test_server import STORIES

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _llm(path: Path, **kw) -> LLM:
    kw = {"num_kv_blocks": 64, "max_num_batched_tokens": BUDGET, **kw}
    return LLM(str(path), calibrate_preemption=False, **kw)


def _ids(prompts) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' classification logits of one prompt (pooled by its own rule)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    """The folder's weights (linked) under a config.json with ``changes``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    path = tmp_path_factory.mktemp("cls3")
    hf = build_hf_classifier(tiny_config("llama_mha"), path, num_labels=3, id2label=LABELS,
                             label2id={v: k for k, v in LABELS.items()})  # fmt: skip
    return path, hf


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """One label, stories260k's real tokenizer: a cross-encoder reranker."""
    if not (STORIES / "tokenizer.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    path = tmp_path_factory.mktemp("ce")
    return path, build_stories_cross_encoder(path, STORIES)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2", "qwen3"])
def test_classify_matches_transformers(kind, tmp_path):
    hf = build_hf_classifier(tiny_config(kind), tmp_path, num_labels=3)
    llm = _llm(tmp_path)  # runner "auto": a *ForSequenceClassification folder pools
    pooler = llm.llm_engine.pooler_config
    assert pooler is not None and pooler.tasks == ("classify", "score") and pooler.pooling_type == "LAST"
    outs = llm.classify(_ids(PROMPTS), use_tqdm=False)
    for o, p in zip(outs, PROMPTS):
        want = _logits(hf, p).softmax(dim=-1)
        assert o.outputs.num_classes == 3 and o.finished
        assert torch.allclose(torch.tensor(o.outputs.probs), want, atol=1e-5), (o.outputs.probs, want)
    # The last two prompts share a cached prefix: served from the cache, still right.
    assert llm.ledger().prefix_cache_hits >= 32


def test_activation_follows_problem_type_and_use_activation(three_labels, tmp_path):
    """vLLM's rules: softmax over several labels, sigmoid per label for multi-label,
    the logits for regression or with use_activation=False."""
    src, hf = three_labels
    prompts = PROMPTS[:3]
    logits = [_logits(hf, p) for p in prompts]
    llm = _llm(src)
    assert llm.llm_engine.pooler_config.classifier.labels == ("negative", "neutral", "positive")
    for params, fn in ((None, lambda x: x.softmax(-1)), (PoolingParams(use_activation=False), lambda x: x)):
        outs = llm.classify(_ids(prompts), params, use_tqdm=False)
        for o, lg in zip(outs, logits):
            assert torch.allclose(torch.tensor(o.outputs.probs), fn(lg), atol=1e-5)
    llm.llm_engine.shutdown()
    for problem, fn in (("multi_label_classification", torch.sigmoid), ("regression", lambda x: x)):
        path = _copy_with_config(src, tmp_path / problem, problem_type=problem)
        outs = _llm(path).classify(_ids(prompts), use_tqdm=False)
        for o, lg in zip(outs, logits):
            assert torch.allclose(torch.tensor(o.outputs.probs), fn(lg), atol=1e-5), problem


def test_cross_encoder_score_matches_transformers(cross_encoder):
    path, hf = cross_encoder
    tok = AutoTokenizer.from_pretrained(path)
    llm = _llm(path)
    query = "Where did Tom play?"
    docs = ["Tom played in the park with Max.", "Lily baked a cake.", "The sun was hot."]

    def ref(a: str, b: str) -> float:
        return _logits(hf, tok(a, text_pair=b).input_ids)[0].sigmoid().item()

    outs = llm.score(query, docs, use_tqdm=False)  # one text_1 against each text_2
    assert [round(o.outputs.score - ref(query, d), 5) for o, d in zip(outs, docs)] == [0.0] * 3
    assert outs[0].prompt_token_ids == tok(query, text_pair=docs[0]).input_ids  # the pair encoding
    side = llm.score(docs[:2], docs[1:], use_tqdm=False)  # side by side
    assert abs(side[1].outputs.score - ref(docs[1], docs[2])) < 1e-5
    cut = llm.score(query, docs[:1], truncate_prompt_tokens=6, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 6
    with pytest.raises(InvalidRequestError, match="data_1 has 2 texts and data_2 3"):
        llm.score(docs[:2], docs)
    with pytest.raises(InvalidRequestError, match="data_2 is empty"):
        llm.score(query, [])
    with pytest.raises(InvalidRequestError, match="does not support embed"):
        llm.embed(["hi"])


def test_score_and_embed_are_refused_by_name(three_labels):
    path, _ = three_labels
    llm = _llm(path)
    with pytest.raises(InvalidRequestError, match="score needs a cross-encoder with one label; this model has 3"):
        llm.llm_engine.add_request([1, 2], PoolingParams(task="score"))
    with pytest.raises(InvalidRequestError, match="dimensions is for embeddings"):
        llm.llm_engine.add_request([1, 2], PoolingParams(task="classify", dimensions=2))
    with pytest.raises(InvalidRequestError, match="pooling task 'embed' is not supported by this model"):
        llm.llm_engine.add_request([1, 2], PoolingParams())
    assert not llm.llm_engine.has_unfinished_requests()


def test_bi_encoder_score_is_the_cosine_of_embeddings(stories_path):
    """An embedding model's LLM.score: each text embedded once, the cosine of each pair."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(stories_path)
    llm = LLM(str(stories_path), runner="pooling", calibrate_preemption=False, num_kv_blocks=64)
    texts = ["Once upon a time", "Tom had a red ball.", "The end."]

    def vec(t: str) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([tok(t).input_ids]), output_hidden_states=True).hidden_states[-1][0, -1]

    outs = llm.score(texts[0], texts, use_tqdm=False)
    want = [F.cosine_similarity(vec(texts[0]), vec(t), dim=0).item() for t in texts]
    assert max(abs(o.outputs.score - w) for o, w in zip(outs, want)) < 1e-5
    assert abs(outs[0].outputs.score - 1.0) < 1e-6
    with pytest.raises(InvalidRequestError, match="does not support classify"):
        llm.classify(texts)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen3"])
def test_bare_decoder_checkpoint_embeds(kind, tmp_path):
    """LlamaModel / Qwen3Model folders (no LM head, no "model." prefix) load, pool by default
    (runner auto) and refuse to generate by name."""
    hf = build_hf_bare_decoder(tiny_config(kind), tmp_path)
    arch = json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert arch.endswith("Model") and not arch.endswith("ForCausalLM")
    outs = _llm(tmp_path).embed(_ids(PROMPTS[:3]), use_tqdm=False)
    for o, p in zip(outs, PROMPTS[:3]):
        with torch.no_grad():
            want = F.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
        assert F.cosine_similarity(torch.tensor(o.outputs.embedding), want, dim=0).item() >= 0.9999
    with pytest.raises(ConfigError, match=f"{arch} has no LM head and cannot generate text"):
        _llm(tmp_path, runner="generate")


def test_truncate_prompt_tokens_keeps_the_last_tokens(three_labels):
    path, hf = three_labels
    llm = _llm(path)
    long = PROMPTS[2]
    out = llm.classify(_ids([long]), truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-10:]
    assert torch.allclose(torch.tensor(out.outputs.probs), _logits(hf, long[-10:]).softmax(-1), atol=1e-5)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be -1 or a positive integer"):
        llm.classify(_ids([long]), truncate_prompt_tokens=0)


@pytest.mark.parametrize("task", ["classify", "embed"])
def test_a_pooling_request_preempted_by_recompute_is_right(three_labels, tmp_path, task):
    """A pooling-only engine never preempts by itself (at a step's start at most one prompt is
    mid-prefill: the next is admitted with the budget the finishing one leaves). So another
    holder takes the free blocks through the KV manager, as a running request would: the
    scheduler preempts the request mid-prefill (recompute), and once the blocks come back it is
    computed again and still right: a classify request (LAST: its published blocks from the
    prefix cache) and a MEAN embedding (no prefix hits: its running sum restarts at 0)."""
    long = [1, *range(10, 70)]  # 61 tokens: 4 chunks of 16
    if task == "classify":
        path, hf = three_labels
        want = _logits(hf, long).softmax(-1)
        kw = {}
    else:
        hf = build_hf_bare_decoder(tiny_config("llama_mha"), tmp_path)
        with torch.no_grad():
            want = F.normalize(hf(torch.tensor([long])).last_hidden_state[0].mean(dim=0), dim=-1)
        path, kw = tmp_path, {"pooler_config": {"pooling_type": "MEAN"}}
    eng = _llm(path, num_kv_blocks=12, block_size=8, preemption_mode="recompute", **kw).llm_engine
    eng.add_request(long, PoolingParams(task=task), request_id="c")
    assert eng.step() == [] and eng.step() == []
    snap = eng.ledger()
    assert "c" in snap.requests and snap.used_blocks == 4  # shown while it runs
    assert eng.kv.allocate_slots("holder", eng.kv.num_free_blocks * 8)  # every free block
    assert eng.step() == []
    assert eng.scheduler.num_preemptions["recompute"] == 1 and "c" not in eng.ledger().requests
    eng.kv.free("holder")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    (out,) = outs
    assert out.metrics.num_preemptions == 1
    assert torch.allclose(torch.tensor(out.outputs.data), want, atol=1e-5)
    assert eng.ledger().used_blocks == 0


def test_tensor_parallel_classifies_as_one_device(three_labels):
    """TP=2: rank 0 applies the score head to the gathered last row (the other computes)."""
    path, hf = three_labels
    llm = _llm(path, tensor_parallel_size=2)
    try:
        outs = llm.classify(_ids(PROMPTS[1:3]), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for o, p in zip(outs, PROMPTS[1:3]):
        assert torch.allclose(torch.tensor(o.outputs.probs), _logits(hf, p).softmax(-1), atol=1e-5)


@pytest.mark.parametrize("method", ["from_2_way_softmax", "no_post_processing"])
def test_reranker_head_from_lm_head_tokens(tmp_path, method):
    """vLLM's hf_overrides for rerankers shipped as causal LMs (Qwen3-Reranker: the next
    token's "yes" against "no"): the score head is built from the LM head's rows at load.
    stories260k's 512-token vocabulary has no "yes"/"no", so "▁and" / "▁the" stand in."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)  # fmt: skip
    hf = build_hf_model(cfg, tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / f, tmp_path / f)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    no, yes = tok.convert_tokens_to_ids(["▁and", "▁the"])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"]}
    if method == "from_2_way_softmax":
        overrides |= {"classifier_from_token": ["▁and", "▁the"], "is_original_qwen3_reranker": True}
    else:
        overrides |= {"classifier_from_token": ["▁the"], "method": "no_post_processing"}
    llm = _llm(tmp_path, hf_overrides=overrides)  # runner auto: the overridden architecture pools
    query, docs = "Where did Tom play?", ["Tom played in the park.", "Lily baked a cake."]
    outs = llm.score(query, docs, use_tqdm=False)
    for o, d in zip(outs, docs):
        with torch.no_grad():
            lg = hf(torch.tensor([tok(query, text_pair=d).input_ids])).logits[0, -1]
        want = lg[[no, yes]].softmax(-1)[1] if method == "from_2_way_softmax" else lg[yes].sigmoid()
        assert abs(o.outputs.score - want.item()) < 1e-5
    with pytest.raises(ConfigError, match="'no' is not a token"):
        _llm(tmp_path, hf_overrides={**overrides, "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True})
