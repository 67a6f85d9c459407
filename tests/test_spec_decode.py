"""Speculative decoding (n-gram, suffix) is exact: the engine's own outputs without speculation
are the oracle (that engine is itself tested identical to HF transformers), in every mode the
engine has; rejected drafts' slots are released in the step that rejects them; with temperature
> 0 the emitted tokens follow the target distribution. The parts alone: test_spec_decode_parts.py."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import LLM, SamplingParams
from kvledger.sampling_params import StructuredOutputsParams
from kvledger.spec_decode.ngram import NgramIndex

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 3,
}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "Tom and his dog went to the park. Tom and his dog",
    "The sun was shining. The birds were singing. The sun",
    "One day, a big bear",
    "Sue had a red ball. She",
]


def outputs(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def stats(llm: LLM):
    return llm.llm_engine.scheduler.speculator.stats


def assert_exercised(llm: LLM) -> None:
    """Drafts were both accepted and rejected: the comparison covered both paths."""
    s = stats(llm)
    assert s.num_accepted_tokens > 0, s
    assert s.num_accepted_tokens < s.num_draft_tokens, s


# -- exactness in every mode -----------------------------------------------------------------


@pytest.fixture(scope="module")
def spec(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False, speculative_config=SPEC)


def test_greedy_outputs_are_identical(stories_llm, spec):
    sp = SamplingParams(temperature=0, max_tokens=120)
    assert outputs(spec, PROMPTS, sp) == outputs(stories_llm, PROMPTS, sp)
    assert_exercised(spec)
    s = stats(spec)
    assert s.num_drafts and sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
    assert s.num_accepted_tokens_per_pos == sorted(s.num_accepted_tokens_per_pos, reverse=True)


def test_suffix_greedy_outputs_are_identical(stories_path, stories_llm):
    """Twice over the prompts: the second time the shared cache holds the first run's tokens."""
    suffix = LLM(str(stories_path), calibrate_preemption=False, speculative_config=SUFFIX)
    sp = SamplingParams(temperature=0, max_tokens=100)
    ref = outputs(stories_llm, PROMPTS, sp)
    assert [outputs(suffix, [p], sp)[0] for p in PROMPTS] == ref
    first = stats(suffix).num_accepted_tokens
    assert outputs(suffix, PROMPTS, sp) == ref
    assert_exercised(suffix)
    assert stats(suffix).num_accepted_tokens - first > first  # the cache made drafts better


def test_greedy_identical_alone_and_in_a_batch(stories_llm, spec):
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ref = outputs(stories_llm, PROMPTS, sp)
    assert [outputs(spec, [p], sp)[0] for p in PROMPTS] == ref


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 11, 13, 29])
def test_max_tokens_reached_inside_a_draft(stories_llm, spec, max_tokens):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = outputs(spec, PROMPTS[1:3], sp)
    assert got == outputs(stories_llm, PROMPTS[1:3], sp)
    assert all(len(o[0]) == max_tokens for o in got)


def test_stop_strings_and_stop_ids_cut_accepted_drafts(stories_llm, spec):
    ref_text = stories_llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False
    )
    text = ref_text[0].outputs[0].text
    ids = ref_text[0].outputs[0].token_ids
    # A stop string and a stop token id from the middle of the greedy continuation.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    for sp in (
        SamplingParams(temperature=0, max_tokens=60, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=60, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[ids[len(ids) // 2]]),
    ):
        a = spec.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0]
        b = stories_llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
        assert len(b.token_ids) < 60


def test_logprobs_of_accepted_tokens_equal_plain_ones(stories_llm, spec):
    sp = SamplingParams(temperature=0, max_tokens=60, logprobs=3, ignore_eos=True)
    a = spec.generate(PROMPTS[:2], sp, use_tqdm=False)
    b = stories_llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids
        for dx, dy in zip(x.logprobs, y.logprobs):
            assert list(dx) == list(dy)  # the same tokens in the same order (chosen, then top-3)
            for t in dx:
                assert dx[t].rank == dy[t].rank
                assert dx[t].logprob == pytest.approx(dy[t].logprob, abs=1e-4)
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)


def test_n_greater_than_one(stories_llm, spec):
    sp = SamplingParams(temperature=0, max_tokens=50, n=3, ignore_eos=True)
    assert outputs(spec, PROMPTS[:2], sp) == outputs(stories_llm, PROMPTS[:2], sp)


@pytest.mark.parametrize(
    "options",
    [
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16},  # chunked prefill beside speculating decodes
        {"block_size": 4},  # drafts cross several blocks; rollbacks free whole blocks
        {"kv_cache_dtype": "int8"},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "int8", "kv_recent_tokens": 8},  # rejected rows in the overlay window
        {"block_size": 4, "max_num_batched_tokens": 16, "speculative_config": SUFFIX},
    ],
    ids=[
        "no-prefix-cache",
        "chunked-16",
        "bs4",
        "int8-kv",
        "fp8-kv",
        "int8-recent8",
        "suffix-bs4-chunked",
    ],
)
def test_greedy_identical_under_engine_options(stories_path, options):
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    options = {"speculative_config": SPEC, **options}
    a = LLM(str(stories_path), calibrate_preemption=False, **options)
    del options["speculative_config"]
    b = LLM(str(stories_path), calibrate_preemption=False, **options)
    assert outputs(a, PROMPTS, sp) == outputs(b, PROMPTS, sp)
    assert_exercised(a)


def test_prefix_cache_hits_on_blocks_of_accepted_drafts(spec, stories_llm):
    """A second run of the same prompts reuses blocks; outputs stay identical."""
    sp = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    first = outputs(spec, PROMPTS, sp)
    hits = spec.ledger().prefix_cache_hits
    # The prompt extended by its own greedy output: its blocks, some filled by accepted
    # drafts, are served from the cache.
    again = [spec.llm_engine.tokenize(p) + o[0][:-1] for p, o in zip(PROMPTS, first)]
    sp1 = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert outputs(spec, again, sp1) == outputs(stories_llm, again, sp1)
    assert spec.ledger().prefix_cache_hits - hits >= sum(len(p) // 16 - 1 for p in again) * 16


# A token tree of suffix decoding (tests/test_spec_tree.py), whose accepted paths off its first
# branch have their K/V moved in the step.
TREE = {"method": "suffix", "num_speculative_tokens": 6, "tree_nodes": 12}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("config", [SPEC, TREE], ids=["ngram", "suffix-tree"])
def test_preemption_mid_speculation(stories_path, mode, config):
    rng = random.Random(0)
    prompts = [rng.choice(PROMPTS) for _ in range(24)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(20, 60), ignore_eos=True)
        for _ in prompts
    ]
    opts = dict(num_kv_blocks=24, block_size=8, preemption_mode=mode, calibrate_preemption=False)
    a = LLM(str(stories_path), speculative_config=config, **opts)
    ref = outputs(LLM(str(stories_path), calibrate_preemption=False), prompts, params)
    assert outputs(a, prompts, params) == ref
    assert a.ledger().preemptions[mode] > 0, "the pool was meant to force preemption"
    assert_exercised(a)
    if config is TREE:
        assert a.llm_engine.executor.worker.runner.num_tree_moves > 0


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_structured_outputs_advance_and_roll_back_the_grammar(stories_path, stories_llm, spec, backend):
    if backend == "guidance":
        pytest.importorskip("llguidance")
        kw = dict(calibrate_preemption=False, structured_outputs_config={"backend": "guidance"})
        stories_llm = LLM(str(stories_path), **kw)
        spec = LLM(str(stories_path), speculative_config=SPEC, **kw)
    # Free words, then sentences the prompt holds (drafts that hit), in the grammar's words.
    words = r"( ?(Tom|the|dog|park|and|went|to|The|big|red)){6,40}\."
    so = StructuredOutputsParams(
        regex=words + r"( Tom and his dog went to the (park|big park)\.){1,4}"
    )
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    before = stats(spec).num_accepted_tokens
    a = spec.generate(PROMPTS[1:3], sp, use_tqdm=False)
    b = stories_llm.generate(PROMPTS[1:3], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
    assert stats(spec).num_accepted_tokens > before


def test_seeded_random_sampling_runs_and_is_reproducible(spec):
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=60, ignore_eos=True)
    assert outputs(spec, PROMPTS[:2], sp) == outputs(spec, PROMPTS[:2], sp)


# -- the ledger through every rollback ---------------------------------------------------------


def test_rejected_slots_are_released_in_the_step_and_never_cached(stories_path):
    """After every step: each running request's tables cover exactly its computed tokens (no
    slot or block kept for a rejected draft), and every cached block's tokens are a block of
    some request's verified tokens."""
    llm = LLM(str(stories_path), calibrate_preemption=False, block_size=4, speculative_config=SPEC)
    eng = llm.llm_engine
    kv = eng.kv
    reqs = []
    for i, p in enumerate(PROMPTS):
        eng.add_request(
            p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id=str(i)
        )
        reqs.append(eng.scheduler.requests[str(i)])
    verified: set[tuple[int, ...]] = set()
    released = 0
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:
            assert kv.requests[req.request_id].num_tokens == req.num_computed_tokens
            assert req.num_computed_tokens == req.num_tokens - 1
        for req in reqs:
            toks = req.all_token_ids[: req.num_computed_tokens]
            verified |= {tuple(toks[j : j + 4]) for j in range(0, len(toks) - 3, 4)}
        kv.check_invariants()
        released += stats(llm).last_step_released_blocks
        for blk in kv.pool.blocks:
            if blk.block_hash is not None:
                assert blk.token_ids in verified
    assert released > 0 and released == stats(llm).released_blocks
    assert_exercised(llm)


def test_metrics_and_ledger_report_speculation(stories_path):
    from prometheus_client.parser import text_string_to_metric_families

    from kvledger.engine.stats import capture_stats
    from kvledger.server.metrics import ServerMetrics

    llm = LLM(str(stories_path), calibrate_preemption=False, speculative_config=SPEC)
    outputs(llm, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    s = stats(llm)
    text = ServerMetrics("m").render(capture_stats(llm.llm_engine)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str) -> float:
        (sample,) = [x for x in fams[name].samples if x.name.endswith("_total")]
        assert sample.labels["engine"] == "0"
        return sample.value

    assert value("vllm:spec_decode_num_drafts") == s.num_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens") == s.num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens") == s.num_accepted_tokens > 0
    per_pos = {int(x.labels["position"]): x.value for x in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
               if x.name.endswith("_total")}  # fmt: skip
    assert per_pos == dict(enumerate(s.num_accepted_tokens_per_pos)) and len(per_pos) == 5
    row = llm.ledger().to_dict()["speculation"]
    assert row["released_blocks"] == s.released_blocks > 0
    assert row["released_bytes"] == s.released_blocks * llm.ledger().bytes_per_block
    assert llm.ledger().used_blocks == 0


@pytest.mark.parametrize("kind", ["gemma2", "mistral_window"])
def test_greedy_identical_with_sliding_windows(tmp_path, kind):
    """Hybrid full + sliding groups (Gemma 2, window 7) and an all-sliding model (window 9):
    rollbacks trim every group's table, windows release blocks behind them, same tokens."""
    from tests.model_factory import build_hf_model, tiny_config

    build_hf_model(tiny_config(kind), tmp_path)
    prompts = [[5, 6, 7, 8] * 6, list(range(30, 50)) + list(range(30, 40)), [9, 10, 11] * 5]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    kw = dict(block_size=4, calibrate_preemption=False)
    a = LLM(str(tmp_path), speculative_config=SPEC, **kw)
    assert outputs(a, prompts, sp) == outputs(LLM(str(tmp_path), **kw), prompts, sp)
    assert_exercised(a)
    assert a.llm_engine.kv.windowed


def test_serve_with_speculation_reports_it_on_metrics_and_ledger(stories_path, stories_llm, tmp_path):
    """`kvledger serve --speculative-config`: the engine core process speculates, the completion
    is the offline greedy one, /metrics and /v1/ledger show the drafts."""
    import json

    import httpx

    from tests.test_server import ServerProcess

    srv = ServerProcess(
        str(stories_path), "--torch-threads", "1", "--no-dashboard",
        "--speculative-config", json.dumps(SPEC), log_path=tmp_path / "server.log",
    )  # fmt: skip
    try:
        srv.wait_ready()
        body = {
            "model": str(stories_path),
            "prompt": PROMPTS[1],
            "max_tokens": 60,
            "temperature": 0,
        }
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        want = stories_llm.generate(
            PROMPTS[1], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False
        )
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        accepted = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("vllm:spec_decode_num_accepted_tokens_total{")
        ]
        assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0, metrics
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0"' in metrics
        led = httpx.get(f"{srv.url}/v1/ledger", timeout=30).json()
        assert led["speculation"]["num_accepted_tokens"] > 0 and led["used_blocks"] == 0
    finally:
        srv.stop()


def test_tensor_parallel_ranks_verify_the_same_drafts(tmp_path):
    """TP=2: every rank runs the verification rows of the same step message; rank 0 samples and
    accepts; the tokens are those of TP=1 without speculation."""
    from tests.model_factory import build_hf_model, tiny_config

    build_hf_model(tiny_config("llama_gqa"), tmp_path)
    prompts = [[5, 6, 7, 8] * 6, list(range(30, 50)) * 2, [9, 10, 11] * 5]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(block_size=4, calibrate_preemption=False)
    tp2 = LLM(str(tmp_path), tensor_parallel_size=2, speculative_config=SPEC, **kw)
    try:
        assert outputs(tp2, prompts, sp) == outputs(LLM(str(tmp_path), **kw), prompts, sp)
        assert_exercised(tp2)
    finally:
        tp2.llm_engine.shutdown()


def test_longrope_switch_point_is_never_inside_a_verification(tmp_path):
    """Phi-3 LongRoPE (switch at 48 tokens): drafts stop short of the switch, so no row is
    verified with the short factors where decoding one by one would use the long ones."""
    from tests.model_factory import build_hf_model, tiny_config

    build_hf_model(tiny_config("phi3"), tmp_path)
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 10, list(range(20, 40)) * 2]  # 40, 30, 40 tokens
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(block_size=4, calibrate_preemption=False)
    a = LLM(str(tmp_path), speculative_config=SPEC, **kw)
    assert outputs(a, prompts, sp) == outputs(LLM(str(tmp_path), **kw), prompts, sp)
    assert_exercised(a)
    assert a.llm_engine.scheduler.num_rope_recomputes >= 3


def test_history_dependent_processors_decode_one_token_at_a_time(stories_llm, spec):
    """Penalties, bad words and a min_tokens still in force depend on the tokens just before
    each row: those requests get no drafts, and decode exactly as without speculation;
    stateless processors (logit_bias, allowed_token_ids) speculate."""
    s = stats(spec)
    for sp in (
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=40, frequency_penalty=0.5, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=40, bad_words=["dog"]),
    ):
        drafts = s.num_drafts
        assert outputs(spec, PROMPTS[1:3], sp) == outputs(stories_llm, PROMPTS[1:3], sp)
        assert s.num_drafts == drafts
    sp = SamplingParams(
        temperature=0, max_tokens=40, min_tokens=30, logit_bias={13: 2.0}, ignore_eos=False
    )
    drafts = s.num_drafts
    assert outputs(spec, PROMPTS[1:3], sp) == outputs(stories_llm, PROMPTS[1:3], sp)
    assert s.num_drafts > drafts  # after the 30th token


def test_sampled_tokens_after_an_accepted_draft_follow_the_target(stories_path, stories_llm):
    """Engine level, temperature 1, top-k 5, 6,000 seeds: among the runs whose first token
    repeats the prompt's pattern and whose second is the proposer's draft (accepted), the third
    token comes from the verification's second row; its frequencies match the target's top-5
    softmax after that prefix, computed without speculation (chi-square, p > 0.001)."""
    from collections import Counter

    from scipy.stats import chisquare

    cfg = {**SPEC, "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": 10_000}
    llm = LLM(str(stories_path), calibrate_preemption=False, speculative_config=cfg)
    prompt = llm.llm_engine.tokenize(PROMPTS[1])
    n = 6000
    params = [
        SamplingParams(temperature=1.0, top_k=5, max_tokens=3, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    got = [o[0] for o in outputs(llm, [prompt] * n, params)]
    pairs = Counter((g[0], g[1]) for g in got)
    # The most frequent (first, second) where the second is the draft proposed after the first.
    t1, d = max(
        (pair for pair in pairs if NgramIndex(2, 3).propose(prompt + [pair[0]], 1) == [pair[1]]),
        key=pairs.__getitem__,
    )
    third = [g[2] for g in got if (g[0], g[1]) == (t1, d)]
    assert len(third) > 300, len(third)
    lp = stories_llm.generate(
        [prompt + [t1, d]], SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False
    )
    top = lp[0].outputs[0].logprobs[0]
    ids = sorted(top, key=lambda t: top[t].rank)[:5]
    p = torch.tensor([top[t].logprob for t in ids], dtype=torch.float64).softmax(0)
    counts = torch.tensor([third.count(t) for t in ids], dtype=torch.float64)
    assert counts.sum() == len(third)  # only top-5 tokens were sampled
    assert chisquare(counts.numpy(), (p * len(third)).numpy()).pvalue > 1e-3
    assert stats(llm).num_accepted_tokens > 300
