"""Speculative decoding's parts on their own: the configuration (vLLM's keys, refused by name),
the proposers (n-gram, suffix), the acceptance rule and its distribution (chi-square at a fixed
seed), and the scheduler's rule that drafts never cost a request its place."""

from __future__ import annotations

import pytest
import torch

from kvledger import LLM, SamplingParams
from kvledger.errors import ConfigError
from kvledger.sample.sampler import SampleRequest, sample
from kvledger.spec_decode.config import SpeculativeConfig
from kvledger.spec_decode.ngram import NgramIndex
from kvledger.spec_decode.rejection import num_accepted
from kvledger.spec_decode.suffix import SuffixCache, SuffixIndex
from tests.test_spec_decode import SPEC


def test_config_takes_vllms_keys_and_defaults():
    c = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 4})
    assert c.num_speculative_tokens == 4  # vLLM's default for suffix: the depth
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    # vLLM infers draft_model from `model` (and "ngram" as a model is its older spelling).
    c = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.quantization) == ("draft_model", "/some/draft", None)
    c = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 3})
    assert (c.method, c.model) == ("ngram", None)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 3}).method == "ngram"


def test_engine_config_checks_the_draft_quantization():
    from kvledger.config import EngineConfig

    cfg = {"model": "/d", "num_speculative_tokens": 2, "quantization": "fp4"}
    with pytest.raises(ConfigError, match=r"speculative_config.quantization must be one of int8"):
        EngineConfig(model="/m", speculative_config=cfg).validate()


@pytest.mark.parametrize(
    "value, named",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}, "lookup"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size"),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 2},
            "suffix_decoding_min_token_prob",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
            "suffix_decoding_max_tree_depth",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "tree_nodes": 8}, "tree_nodes"),
        ({"method": "suffix", "tree_nodes": -1}, "tree_nodes"),
        ('{"method": ', "JSON"),
    ],
)
def test_config_refuses_bad_keys_and_values_by_name(value, named):
    with pytest.raises(ConfigError, match=named):
        SpeculativeConfig.parse(value)


BAD_SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}'


def test_cli_refuses_a_bad_config_in_one_line(stories_path, capsys):
    """`serve` as a process (it sets up the process's logging); `generate` through the CLI's main
    in process, the code path of the console script without a second torch import."""
    import subprocess
    import sys

    from kvledger.cli import main

    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", str(stories_path), "--speculative-config", BAD_SPEC],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert main(["generate", str(stories_path), "--speculative-config", BAD_SPEC]) == 2
    for err in (r.stderr, capsys.readouterr().err):
        assert err.startswith("kvledger: error:") and "bogus" in err, err
        assert "Traceback" not in err


def test_ngram_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(2, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # The tail (1, 2, 3) last occurred ending at 7: what followed it, then the tail itself.
    assert idx.propose(tokens, 3) == [7, 8, 1]
    assert NgramIndex(2, 3).propose([4, 5, 6, 4], 3) == []  # no 2-gram of the tail recurs
    # A periodic tail continues through the proposal itself (an overlapping copy).
    assert NgramIndex(2, 2).propose([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]


def test_ngram_index_grows_with_the_context():
    idx = NgramIndex(2, 2)
    tokens = [1, 2, 3]
    assert idx.propose(tokens, 2) == []
    tokens += [4, 1, 2]
    assert idx.propose(tokens, 2) == [3, 4]


def test_suffix_drafts_the_most_frequent_follower_here_and_in_other_requests():
    shared = SuffixCache(depth=2, max_requests=2)
    idx = SuffixIndex(shared, min_token_prob=0.3, max_spec_factor=4.0)
    # In this request 7 followed (1, 2) twice, 8 once: the draft takes 7, then the followers
    # of (2, 7), (7, 3), (3, 1), ...
    assert idx.propose([1, 2, 7, 3, 1, 2, 8, 1, 2, 7, 3, 1, 2], 5) == [7, 3, 1, 2, 7]
    # The longest tail that occurred wins over a more frequent shorter one.
    assert SuffixIndex(SuffixCache(3, 0), 0.3, 4.0).propose(
        [1, 2, 7, 3, 1, 2, 8, 1, 2, 7, 3, 1, 2], 1
    ) == [8]
    # Another request's tokens: (5, 9) -> 6 is known only from the shared cache.
    assert SuffixIndex(shared, 0.3, 4.0).propose([4, 5, 9], 2) == []
    shared.add([5, 9, 6, 7])
    assert SuffixIndex(shared, 0.3, 4.0).propose([4, 5, 9], 2) == [6, 7]
    # The cache keeps the last max_requests requests: the first one's counts leave.
    shared.add([1, 1])
    shared.add([2, 2])
    assert SuffixIndex(shared, 0.3, 4.0).propose([4, 5, 9], 2) == []
    assert set(shared.counts[1]) == {(1, 1), (2, 2)} or not shared.counts[1]


def test_acceptance_is_the_longest_agreeing_prefix():
    assert num_accepted([5, 6, 7], [5, 6, 8, 1]) == 2
    assert num_accepted([5, 6, 7], [4, 6, 7, 1]) == 0
    assert num_accepted([5, 6, 7], [5, 6, 7, 1]) == 3


def test_random_verification_keeps_the_target_distribution():
    """Point-mass drafts: accept x with p(x), else a draw from p without x. Over 20,000 seeded
    trials on a 6-token vocabulary, the first emitted token's frequencies (accepted draft or
    correction) and the second's after an accepted first draft match the target's softmax
    (chi-square, p > 0.001)."""
    from scipy.stats import chisquare

    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(2, vocab) * 1.5
    target = logits.softmax(-1)
    drafts = [2, 4]  # the first is likely under row 0, the second under row 1
    params = SamplingParams(temperature=1.0, seed=7)
    gen = torch.Generator().manual_seed(7)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    trials = 20_000
    for _ in range(trials):
        rows = [SampleRequest(params, gen), SampleRequest(params, gen), SampleRequest(params, gen)]
        tokens, _ = sample(torch.cat([logits, logits[1:]]).clone(), rows)
        a = num_accepted(drafts, tokens)
        emitted = tokens[: a + 1]
        first[emitted[0]] += 1
        if a >= 1:
            second[emitted[1]] += 1
    for counts, p in ((first, target[0]), (second, target[1])):
        expected = (p * counts.sum()).numpy()
        assert chisquare(counts.numpy(), expected).pvalue > 1e-3
    # The draft was accepted about as often as its probability says.
    assert abs(second.sum() / trials - target[0, 2]) < 0.02


def test_drafts_never_cost_a_request_its_place(stories_path):
    """Drafts are optional: when the batch's blocks do not fit with them they are dropped
    before anyone is preempted, and a request at the pool's edge is not ended early for them."""
    from kvledger.config import CacheConfig, SchedulerConfig
    from kvledger.core.request import Request
    from kvledger.core.scheduler import Scheduler
    from kvledger.spec_decode.speculator import Speculator

    sched = Scheduler.build(
        SchedulerConfig(), CacheConfig(block_size=4), num_blocks=4, bytes_per_token=1
    )
    sched.speculator = Speculator(SpeculativeConfig.parse(SPEC))
    params = SamplingParams(temperature=0, max_tokens=20)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [1, 2, 3, 1, 2, 3, 1], params, max_total_tokens=64))
    so = sched.schedule()  # both prompts: 2 blocks each, the pool is full
    sched.update_from_output(so, {"a": 2, "b": 2}, now=0.0)
    so = sched.schedule()  # each decode fits in its last block; with 5 drafts it would not
    assert so.req_ids == ["a", "b"] and so.num_scheduled_tokens == [1, 1]
    assert not so.preempted and not so.spec_token_ids
    sched.update_from_output(so, {"a": 3, "b": 3}, now=1.0)
    for rid in ("a", "b"):
        sched.finish_request(sched.requests[rid], "abort")
    # At the pool's edge (5 blocks of 4, max_tokens past it) the request ends where it would
    # without speculation.
    kw = dict(num_kv_blocks=5, block_size=4, calibrate_preemption=False)
    prompt = [1, 403, 407, 261, 479, 292, 27, 310, 1, 403, 407, 261]
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    a = LLM(str(stories_path), speculative_config=SPEC, **kw).generate(
        [prompt], sp, use_tqdm=False
    )[0]
    b = LLM(str(stories_path), **kw).generate([prompt], sp, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "length"


def test_a_draft_models_gate_counts_its_forwards():
    """A draft model's proposal costs k draft forwards: its gate pauses a request whose drafts
    pay for the verification rows but not for those forwards (~1 accepted of 5), where the
    draft-free methods' gate would keep it on; a well-accepted draft (4-5 of 5) keeps going."""
    from kvledger.spec_decode.adaptive import AcceptanceGate

    cheap, draft, good = (AcceptanceGate(), *(AcceptanceGate.for_draft_model(5) for _ in "ab"))
    for _ in range(20):
        for gate in (cheap, draft):
            if gate.allow():
                gate.record(5, 1)
        if good.allow():
            good.record(5, 4 + _ % 2)
    assert cheap.pause == 0 and cheap.average > 0.9
    assert draft.backoff > 4  # paused more than once
    assert good.pause == 0 and good.backoff == 4
