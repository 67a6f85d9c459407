"""Draft-model speculation (``speculative_config`` method ``draft_model``) is exact: the target
without speculation is the oracle. The drafts come from stories260k with layers removed (a
draft that agrees sometimes, so drafts are both accepted and rejected) and from stories260k
itself (every draft accepted: a full acceptance leaves the draft one token behind). The draft's
KV shares the target's blocks: the ledger counts it, rollbacks and preemption drop it with the
target's, and after every step the tables cover exactly the verified tokens."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.common import layer_subset_copy
from kvledger import LLM, SamplingParams
from kvledger.errors import ConfigError
from tests.model_factory import build_hf_model, tiny_config
from tests.test_spec_decode import PROMPTS, assert_exercised, outputs, stats

GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def pruned(stories_path, tmp_path_factory):
    """stories260k's layers 0, 1 and 4 of 5: accepts ~10 % of 4 drafts on these prompts."""
    return layer_subset_copy(stories_path, tmp_path_factory.mktemp("draft") / "d014", [0, 1, 4])


def draft_cfg(path, k: int = 4, **kw) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **kw}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},  # the first draft forward catches up a chunked prompt
        {"block_size": 4},  # drafts cross blocks; rollbacks free whole blocks of both models
        {"kv_cache_dtype": "int8"},  # the target's KV quantised, the draft's in float32
    ],
    ids=["default", "no-prefix-cache", "chunked-16", "bs4", "int8-kv"],
)
def test_greedy_identical_with_a_pruned_draft(stories_path, pruned, options):
    kw = dict(calibrate_preemption=False, **options)
    a = LLM(str(stories_path), speculative_config=draft_cfg(pruned, adaptive=False), **kw)
    b = LLM(str(stories_path), **kw)
    assert outputs(a, PROMPTS, GREEDY) == outputs(b, PROMPTS, GREEDY)
    assert_exercised(a)


def test_the_target_as_its_own_draft_accepts_every_draft(stories_path, stories_llm):
    """Same weights: the draft's KV (caught up over the prompt in one forward, then one token
    per round, one behind after a full acceptance) must give the target's argmaxes, so nearly
    every draft is accepted; a draft position or slot off by one would not be."""
    a = LLM(str(stories_path), calibrate_preemption=False, speculative_config=draft_cfg(stories_path, 5))
    assert outputs(a, PROMPTS, GREEDY) == outputs(stories_llm, PROMPTS, GREEDY)
    s = stats(a)
    assert s.num_draft_tokens > 200
    assert s.num_accepted_tokens >= 0.95 * s.num_draft_tokens, s


def test_n_greater_than_one_and_prefix_cache_hits(stories_path, pruned, stories_llm):
    a = LLM(str(stories_path), calibrate_preemption=False, speculative_config=draft_cfg(pruned))
    sp = SamplingParams(temperature=0, max_tokens=40, n=3, ignore_eos=True)
    assert outputs(a, PROMPTS[:2], sp) == outputs(stories_llm, PROMPTS[:2], sp)
    # The same prompts again: their blocks come from the prefix cache, the draft recomputes
    # its own KV for them, the outputs stay the target's.
    hits = a.ledger().prefix_cache_hits
    assert outputs(a, PROMPTS, GREEDY) == outputs(stories_llm, PROMPTS, GREEDY)
    assert a.ledger().prefix_cache_hits > hits
    assert_exercised(a)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_speculation(stories_path, mode):
    rng = random.Random(0)
    prompts = [rng.choice(PROMPTS) for _ in range(16)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(20, 50), ignore_eos=True)
        for _ in prompts
    ]
    opts = dict(num_kv_blocks=24, block_size=8, preemption_mode=mode, calibrate_preemption=False)
    # The target as draft: a preempted request's draft KV must be rebuilt, or its acceptance drops.
    a = LLM(str(stories_path), speculative_config=draft_cfg(stories_path), **opts)
    ref = outputs(LLM(str(stories_path), calibrate_preemption=False), prompts, params)
    assert outputs(a, prompts, params) == ref
    assert a.ledger().preemptions[mode] > 0, "the pool was meant to force preemption"
    s = stats(a)
    assert s.num_accepted_tokens >= 0.95 * s.num_draft_tokens > 0, s


def test_tables_cover_the_verified_tokens_and_the_ledger_counts_the_draft(stories_path, pruned):
    """After every step: each running request's blocks cover exactly its computed tokens, the
    draft's KV reaches no further; the pool's block holds the target's and the draft's KV and
    /v1/ledger says how much is the draft's."""
    llm = LLM(
        str(stories_path), calibrate_preemption=False, block_size=4,
        speculative_config=draft_cfg(pruned, adaptive=False),
    )  # fmt: skip
    eng = llm.llm_engine
    kv, drafter = eng.kv, eng.executor.worker.drafter
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, GREEDY, request_id=str(i))
    draft_bytes = []
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:
            assert kv.requests[req.request_id].num_tokens == req.num_computed_tokens
            assert drafter.computed.get(req.request_id, 0) <= req.num_computed_tokens
        kv.check_invariants()
        row = eng.ledger().to_dict()["speculation"]["draft_model"]
        draft_bytes.append(row["used_kv_bytes"])
        assert row["used_kv_bytes"] == kv.num_used_blocks * row["kv_bytes_per_block"]
    # The draft's KV per token from its config: K and V x 3 layers x 4 KV heads x 8 x float32.
    cfg = json.loads((pruned / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    led = eng.ledger()
    assert row["kv_bytes_per_token"] == per_token == 768
    assert led.bytes_per_token == 5 * 4 * 8 * 2 * 4 + per_token  # the target's, then the draft's
    assert eng.executor.ranks[0].bytes_per_block == led.bytes_per_block
    assert max(draft_bytes) > 0 and row["used_kv_bytes"] == 0 and row["num_forwards"] > 0
    assert stats(llm).released_blocks > 0
    assert_exercised(llm)


def test_requests_with_a_grammar_decode_one_token_at_a_time(stories_path, pruned, stories_llm):
    from kvledger.sampling_params import StructuredOutputsParams

    a = LLM(str(stories_path), calibrate_preemption=False, speculative_config=draft_cfg(pruned))
    so = StructuredOutputsParams(regex=r"( ?(Tom|the|dog|park|and|went|to)){4,20}\.")
    sp = SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)
    assert outputs(a, PROMPTS[1:3], sp) == outputs(stories_llm, PROMPTS[1:3], sp)
    assert stats(a).num_drafts == 0


def test_refuses_a_missing_draft_folder(stories_path, tmp_path):
    with pytest.raises(ConfigError, match=r"speculative_config.model: the draft model folder .* does not exist"):
        LLM(str(stories_path), calibrate_preemption=False, speculative_config=draft_cfg(tmp_path / "x"))


def test_refuses_a_draft_with_another_vocabulary(stories_path, tmp_path):
    build_hf_model(tiny_config("llama_gqa"), tmp_path)  # vocab 97
    with pytest.raises(ConfigError, match=r"vocabulary has 97 tokens, the target's 512"):
        LLM(str(stories_path), calibrate_preemption=False, speculative_config=draft_cfg(tmp_path))


def test_refuses_a_draft_with_another_tokenizer(stories_path, tmp_path):
    draft = layer_subset_copy(stories_path, tmp_path / "d", [0])
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="tokenizer.json vocabulary differs"):
        LLM(str(stories_path), calibrate_preemption=False, speculative_config=draft_cfg(draft))


def test_refuses_a_sliding_window_target(tmp_path):
    target = tmp_path / "t"
    build_hf_model(tiny_config("mistral_window"), target)
    with pytest.raises(ConfigError, match="full-attention target"):
        LLM(str(target), calibrate_preemption=False, speculative_config=draft_cfg(target))


def test_serve_with_a_draft_model_shows_its_kv_on_the_ledger(stories_path, pruned, stories_llm, tmp_path):
    """`kvledger serve --speculative-config '{"model": ...}'`: the completion is the offline
    greedy one; /v1/ledger shows the draft's KV bytes, /metrics its drafts."""
    import httpx

    from tests.test_server import ServerProcess

    srv = ServerProcess(
        str(stories_path), "--torch-threads", "1", "--no-dashboard",
        "--speculative-config", json.dumps(draft_cfg(pruned)), log_path=tmp_path / "server.log",
    )  # fmt: skip
    try:
        srv.wait_ready()
        body = {"model": str(stories_path), "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        want = stories_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        led = httpx.get(f"{srv.url}/v1/ledger", timeout=30).json()
        draft = led["speculation"]["draft_model"]
        assert draft["kv_bytes_per_token"] == 768 and draft["kv_bytes_per_block"] == 768 * 16
        assert draft["total_kv_bytes"] == led["total_blocks"] * 768 * 16
        assert led["bytes_per_token"] == 1280 + 768 and led["used_blocks"] == 0
        assert led["speculation"]["num_draft_tokens"] > 0 and draft["num_forwards"] > 0
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        assert 'vllm:spec_decode_num_draft_tokens_total{engine="0"' in metrics
    finally:
        srv.stop()
