"""The offline API's contract: sampling options, n > 1 with copy-on-write, logprobs, stops,
and bad input rejected clearly without disturbing anything else."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvledger import LLM, SamplingParams
from kvledger.errors import ConfigError, InvalidRequestError, UnsupportedArchitectureError


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ("x " * 600, SamplingParams(), "context"),
        ([5, 600, 7], SamplingParams(), "token id 600"),
        ([5, -1], SamplingParams(), "token id -1"),
    ],
)
def test_bad_prompts_are_rejected_and_nothing_else_is_disturbed(llm, prompt, params, match):
    good = SamplingParams(temperature=0, max_tokens=12)
    before = llm.generate(["Once upon a time"], good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(["Once upon a time", prompt], [good, params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    after = llm.generate(["Once upon a time"], good, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n must"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_unsupported_architecture_and_missing_folder(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture gpt2; supported: LlamaForCausalLM"):
        LLM(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="unknown option"):
        LLM(str(tmp_path), not_an_option=1)


def test_n_greater_than_one_forks_with_copy_on_write(llm):
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    out = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    texts = {tuple(c.token_ids) for c in out.outputs}
    assert len(texts) > 1, "seeded children should diverge"
    assert all(len(c.token_ids) == 30 for c in out.outputs)
    assert llm.engine.kv.num_cow_copies >= 3  # the shared partial prompt block was copied
    again = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_greedy_n2_children_equal_parent(llm):
    out = llm.generate(["Lily"], SamplingParams(n=2, temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert "Lily" in text
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop=["Lily"]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "Lily"
    assert c.text == text[: text.index("Lily")]
    keep = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0, max_tokens=60, stop=["Lily"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert keep.text == text[: text.index("Lily") + 4]
    tok = base.outputs[0].token_ids[5]
    st = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[tok]), use_tqdm=False)[0].outputs[0]
    assert st.token_ids == base.outputs[0].token_ids[: base.outputs[0].token_ids.index(tok) + 1]
    assert st.stop_reason == tok


def test_logprobs_and_prompt_logprobs_match_hf(stories_path, llm):
    tok = AutoTokenizer.from_pretrained(str(stories_path))
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    ids = tok(text).input_ids
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):  # vLLM's shape: {token id: Logprob(logprob, rank, decoded_token)}
        d = out.prompt_logprobs[i]
        lp = d[ids[i]]
        row = ref[i - 1]
        assert math.isclose(lp.logprob, row[ids[i]].item(), abs_tol=1e-4)
        assert lp.rank == int((row > row[ids[i]]).sum()) + 1
        assert lp.decoded_token == tok.decode([ids[i]])
        assert set(row.topk(2).indices.tolist()) <= set(d) and len(d) in (2, 3)
        assert next(iter(d)) == ids[i]  # the prompt's own token first, as vLLM orders them
    nll = -sum(d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
    ref_nll = -sum(ref[i - 1, ids[i]].item() for i in range(1, len(ids))) / (len(ids) - 1)
    assert math.isclose(math.exp(nll), math.exp(ref_nll), rel_tol=1e-4)
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for d, t in zip(c.logprobs, c.token_ids):
        assert next(iter(d)) == t and len(d) == 3  # greedy: the sampled token is the top-1
        assert d[t].rank == 1 and [lp.rank for lp in d.values()] == [1, 2, 3]
        assert max(lp.logprob for lp in d.values()) == pytest.approx(d[t].logprob)
        assert d[t].decoded_token == tok.decode([t])
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    # Prompt logprobs with chunked prefill: the same numbers.
    chunked = LLM(str(stories_path), max_num_batched_tokens=8, calibrate_preemption=False)
    out2 = chunked.generate([ids], sp, use_tqdm=False)[0]
    assert [d[t].logprob for d, t in zip(out2.prompt_logprobs[1:], ids[1:])] == pytest.approx(
        [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])], abs=1e-5
    )


def test_vllm_style_logprob_code_runs_and_whole_vocab_is_capped(stories_path, llm):
    from kvledger.logprobs import Logprob
    from kvledger.sequence import Logprob as SeqLogprob

    assert SeqLogprob is Logprob
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=0)
    out = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    # What vLLM users write: the prompt's perplexity from prompt_logprobs[1:].
    lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
    assert len(lps) == len(ids) - 1 and all(x <= 0 for x in lps)
    assert all(len(d) == 1 for d in out.outputs[0].logprobs)
    # logprobs=-1 is the whole vocabulary, refused past max_logprobs (20 by default).
    with pytest.raises(InvalidRequestError, match="logprobs of 512.*max_logprobs"):
        llm.generate(["Once"], SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt logprobs of 21"):
        llm.generate(["Once"], SamplingParams(max_tokens=2, prompt_logprobs=21), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    wide = LLM(str(stories_path), calibrate_preemption=False, max_logprobs=-1, num_kv_blocks=16)
    c = wide.generate(["Once"], SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)[0].outputs[0]
    for d, t in zip(c.logprobs, c.token_ids):
        assert len(d) == 512 and next(iter(d)) == t
        assert sorted(lp.rank for lp in d.values()) == list(range(1, 513))
        assert math.isclose(sum(math.exp(lp.logprob) for lp in d.values()), 1.0, rel_tol=1e-4)


def test_ledger_returns_to_zero_and_reports(llm):
    snap = llm.ledger()
    assert snap.used_blocks == 0
    d = snap.to_dict()
    for key in ("total_blocks", "used_blocks", "free_blocks", "cached_blocks", "bytes_per_token",
                "bytes_per_block", "tokens_stored", "shared_blocks", "utilization", "requests", "preemptions"):
        assert key in d
    assert d["free_blocks"] + d["used_blocks"] + d["cached_blocks"] == d["total_blocks"]
    assert d["bytes_per_token"] == 2 * 5 * 4 * 8 * 4  # layers x kv_heads x head_dim x fp32, K and V
