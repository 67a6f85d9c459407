"""Embeddings (issue 45): LLM(runner="pooling").embed() against transformers' hidden states.

Random-weight Llama folders (tests/model_factory.py), float32: the last token's final hidden
state (after the final norm) or the mean of all of them, L2-normalised as the folder's
sentence-transformers files say, must match ours to cosine >= 0.9999. The prompts include one
longer than the step's token budget (chunked prefill: the pool is carried across chunks) and
ones sharing a cached prefix.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_factory import build_hf_model, tiny_config

from kvledger.errors import ConfigError, InvalidRequestError
from kvledger.llm import LLM
from kvledger.pooling.params import PoolingParams
from kvledger.sampling_params import SamplingParams

BUDGET = 16  # max_num_batched_tokens: the long prompt takes 4 chunks
PREFIX = list(range(3, 43))  # 40 tokens: 2 full blocks of 16 shared by two prompts
PROMPTS = [
    [1, 5, 9, 22, 40, 3],
    [1, 7],
    [1, *range(10, 70)],  # 61 tokens > BUDGET
    [1, *PREFIX, 50, 51],
    [1, *PREFIX, 60, 61, 62],  # shares 32 cached tokens with the one before
]


def _write_sentence_transformers(folder: Path, mode: str, normalize: bool) -> None:
    """The files sentence-transformers writes for a decoder embedder (Qwen3-Embedding style)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("embedder")
    hf = build_hf_model(tiny_config("llama_gqa"), path)
    return path, hf


def _hidden(hf, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of one prompt."""
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), runner="pooling", calibrate_preemption=False, num_kv_blocks=64,
               max_num_batched_tokens=BUDGET, **kw)  # fmt: skip


def _embed(llm: LLM, prompts, params=None):
    return llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _cosines(outs, refs) -> list[float]:
    return [F.cosine_similarity(torch.tensor(o.outputs.embedding), r, dim=0).item() for o, r in zip(outs, refs)]


def test_default_is_last_token_normalised(folder):
    path, hf = folder
    llm = _llm(path)
    assert llm.llm_engine.pooler_config.pooling_type == "LAST"
    outs = _embed(llm, PROMPTS)
    refs = [F.normalize(_hidden(hf, p)[-1], dim=-1) for p in PROMPTS]
    assert min(_cosines(outs, refs)) >= 0.9999
    for o, r in zip(outs, refs):
        assert torch.allclose(torch.tensor(o.outputs.embedding), r, atol=1e-4)  # normalised: same length
        assert o.outputs.hidden_size == 32 and o.finished
    # The shared prefix was served from the cache, and the embedding is still right.
    assert llm.ledger().prefix_cache_hits >= 32
    # A one-token prompt is a step of one row per request (the runner's decode-shaped path).
    one = _embed(llm, [[5], [7]])
    assert min(_cosines(one, [F.normalize(_hidden(hf, p)[-1], dim=-1) for p in ([5], [7])])) >= 0.9999


def test_mean_pooling_over_chunks(folder, tmp_path):
    src, hf = folder
    path = tmp_path / "mean"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).symlink_to(f)
    _write_sentence_transformers(path, "mean_tokens", normalize=True)
    llm = _llm(path)
    assert llm.llm_engine.pooler_config.pooling_type == "MEAN"
    outs = _embed(llm, PROMPTS)
    refs = [F.normalize(_hidden(hf, p).mean(dim=0), dim=-1) for p in PROMPTS]
    assert min(_cosines(outs, refs)) >= 0.9999
    for o, r in zip(outs, refs):
        assert torch.allclose(torch.tensor(o.outputs.embedding), r, atol=1e-4)
    # Mean pooling reads every prompt row, so it takes no prefix hits (its blocks are cached).
    assert llm.ledger().prefix_cache_hits == 0


def test_folder_without_normalize_and_cls(folder, tmp_path):
    src, hf = folder
    for mode, pick in (("lasttoken", lambda h: h[-1]), ("cls_token", lambda h: h[0])):
        path = tmp_path / mode
        path.mkdir()
        for f in src.iterdir():
            (path / f.name).symlink_to(f)
        _write_sentence_transformers(path, mode, normalize=False)
        llm = _llm(path)
        outs = _embed(llm, PROMPTS[2:4])
        for o, p in zip(outs, PROMPTS[2:4]):
            assert torch.allclose(torch.tensor(o.outputs.embedding), pick(_hidden(hf, p)), atol=1e-4, rtol=1e-4)
        # normalize=True per request wins over the folder
        unit = _embed(llm, PROMPTS[2:3], PoolingParams(normalize=True))[0].outputs.embedding
        assert abs(sum(x * x for x in unit) - 1.0) < 1e-5
        llm.llm_engine.shutdown()


def test_matryoshka_dimensions(folder, tmp_path):
    src, hf = folder
    llm = _llm(src)
    with pytest.raises(InvalidRequestError, match="dimensions is not supported"):
        _embed(llm, PROMPTS[:1], PoolingParams(dimensions=8))
    path = tmp_path / "mrl"
    path.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [8, 16, 32]}))
    llm = _llm(path)
    out = _embed(llm, PROMPTS[:1], PoolingParams(dimensions=8))[0].outputs.embedding
    ref = F.normalize(_hidden(hf, PROMPTS[0])[-1][:8], dim=-1)  # truncate, then normalise
    assert len(out) == 8 and torch.allclose(torch.tensor(out), ref, atol=1e-4)
    with pytest.raises(InvalidRequestError, match="not one of this model's Matryoshka dimensions"):
        _embed(llm, PROMPTS[:1], PoolingParams(dimensions=12))


def test_runner_is_enforced_both_ways(folder):
    path, _ = folder
    llm = _llm(path)
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    gen = LLM(str(path), calibrate_preemption=False, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        gen.embed([PROMPTS[0]])
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        gen.llm_engine.add_request(PROMPTS[0], PoolingParams())
    assert not gen.llm_engine.has_unfinished_requests()
    with pytest.raises(ConfigError, match="runner must be one of"):
        LLM(str(path), runner="embed", calibrate_preemption=False)
    with pytest.raises(ConfigError, match="speculative_config needs the generate runner"):
        LLM(str(path), runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_task_embed_is_the_older_alias(folder, caplog):
    path, hf = folder
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        llm = LLM(str(path), task="embed", calibrate_preemption=False, num_kv_blocks=64)
    assert llm.llm_engine.pooler_config is not None
    out = _embed(llm, PROMPTS[:1])[0].outputs.embedding
    assert torch.allclose(torch.tensor(out), F.normalize(_hidden(hf, PROMPTS[0])[-1], dim=-1), atol=1e-4)
    with pytest.raises(ConfigError, match="task 'reward' is not supported"):
        LLM(str(path), task="reward", calibrate_preemption=False)


def test_pooling_request_is_in_the_ledger_while_it_runs(folder):
    """A long prompt takes several steps; between them its blocks are held and shown, and
    once pooled it frees them (the leak fixture checks the runner too)."""
    path, hf = folder
    eng = _llm(path).llm_engine
    eng.add_request(PROMPTS[2], PoolingParams(), request_id="long")
    assert eng.step() == []
    snap = eng.ledger()
    assert "long" in snap.requests and snap.used_blocks > 0
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["long"] and len(outs[0].outputs.data) == 32
    assert eng.ledger().used_blocks == 0


def test_abort_mid_prefill_leaves_nothing(folder):
    path, _ = folder
    eng = _llm(path, pooler_config={"pooling_type": "MEAN"}).llm_engine
    eng.add_request(PROMPTS[2], PoolingParams(), request_id="m")
    eng.step()
    assert eng.executor.worker.runner.pooler.partial  # a running sum between chunks
    eng.abort_request("m")
    assert not eng.has_unfinished_requests()



def test_a_recompute_restarts_the_running_sum():
    """Preempted by recompute, a request's prompt is computed again from position 0: the
    partial sum of its first life must not count (a swapped one resumes where it was)."""
    from kvledger.pooling.pooler import PoolingAccumulator

    h = torch.randn(10, 4)
    p = PoolingParams(normalize=False, pooling_type="MEAN")
    acc = PoolingAccumulator()
    assert acc.pool_step(h[:4], [("r", p, 0, 4, 0, 10)]) == {}
    assert acc.pool_step(h[4:7], [("r", p, 0, 3, 4, 10)]) == {}  # then preempted: recompute
    assert acc.pool_step(h[:6], [("r", p, 0, 6, 0, 10)]) == {}
    out = acc.pool_step(torch.cat([torch.randn(2, 4), h[6:]]), [("r", p, 2, 4, 6, 10)])
    assert torch.allclose(torch.tensor(out["r"]), h.mean(dim=0), atol=1e-6) and not acc.partial


@pytest.mark.parametrize("mode", ["mean_tokens", "lasttoken"])
def test_sentence_transformers_agrees(stories_path, tmp_path, mode):
    """sentence-transformers (not a dependency: skipped without it) loads the same folder, with
    its tokenizer, and pools as its files say; our vectors match its, text in."""
    st = pytest.importorskip("sentence_transformers")
    path = tmp_path / "st"
    path.mkdir()
    for f in stories_path.iterdir():
        (path / f.name).symlink_to(f)
    _write_sentence_transformers(path, mode, normalize=True)
    model = st.SentenceTransformer(str(path), device="cpu")
    model.tokenizer.pad_token = model.tokenizer.eos_token  # one text per call: never padded
    texts = ["Once upon a time", "Tom went to the park and played with a big red ball all day long"]
    refs = [model.encode(t, convert_to_tensor=True).float() for t in texts]
    outs = LLM(str(path), runner="pooling", calibrate_preemption=False, num_kv_blocks=64).embed(texts, use_tqdm=False)
    assert min(_cosines(outs, refs)) >= 0.9999


def test_tensor_parallel_ranks_pool_as_one_device(folder):
    """TP=2: rank 0 pools the gathered hidden states (the other rank computes, never pools);
    mean pooling across chunks as on one device."""
    path, hf = folder
    llm = _llm(path, tensor_parallel_size=2, pooler_config={"pooling_type": "MEAN"})
    try:
        outs = _embed(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()
    refs = [F.normalize(_hidden(hf, p).mean(dim=0), dim=-1) for p in PROMPTS]
    assert min(_cosines(outs, refs)) >= 0.9999
