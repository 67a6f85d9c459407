"""Sampling options with vLLM's semantics, checked against transformers' own logits processors:
greedy outputs must be identical token for token. Then n > 1, seeds, batching and prefix
caching must still hold with the options on, and generation_config.json defaults apply."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvledger import LLM, SamplingParams
from kvledger.errors import InvalidRequestError

PROMPT = "Once upon a time"
N = 40


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False)


@pytest.fixture(scope="module")
def hf(stories_path):
    return AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens (transformers has no
    processor for them): logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_greedy(hf, ids: list[int], processors: list, eos=None, n: int = N) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        logits_processor=LogitsProcessorList(processors),
    )
    return out[0, len(ids) :].tolist()


def test_greedy_matches_transformers_processors(llm, hf):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
    base = plain.outputs[0].token_ids
    assert base == hf_greedy(hf, ids, [])
    frequent = max(set(base), key=base.count)
    cases = [
        ({"repetition_penalty": 1.3}, [RepetitionPenaltyLogitsProcessor(1.3)]),
        ({"repetition_penalty": 0.8}, [RepetitionPenaltyLogitsProcessor(0.8)]),
        ({"frequency_penalty": 1.5}, [OpenAIPenalties(len(ids), 0.0, 1.5)]),
        ({"presence_penalty": 2.0, "frequency_penalty": -0.2}, [OpenAIPenalties(len(ids), 2.0, -0.2)]),
        ({"logit_bias": {frequent: -100.0, base[0]: -3.0}},
         [SequenceBiasLogitsProcessor({(frequent,): -100.0, (base[0],): -3.0})]),
        ({"allowed_token_ids": sorted(set(base))[:6]},
         [PrefixConstrainedLogitsProcessor(lambda b, x: sorted(set(base))[:6], num_beams=1)]),
        ({"repetition_penalty": 1.2, "presence_penalty": 0.5},
         [RepetitionPenaltyLogitsProcessor(1.2), OpenAIPenalties(len(ids), 0.5, 0.0)]),
    ]  # fmt: skip
    outs = llm.generate(
        [ids] * len(cases),
        [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw) for kw, _ in cases],
        use_tqdm=False,
    )
    for (kw, procs), out in zip(cases, outs):
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf, ids, procs), kw
        assert got != base, f"{kw} should change the greedy text"
    # Raw logprobs (vLLM's default): the processors do not change them.
    lp = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, logprobs=0, repetition_penalty=1.3,
                                            ignore_eos=True), use_tqdm=False)[0].outputs[0]  # fmt: skip
    with torch.no_grad():
        ref = hf(torch.tensor([ids + lp.token_ids])).logits[0].log_softmax(-1)
    for i, (d, t) in enumerate(zip(lp.logprobs, lp.token_ids)):
        assert d[t].logprob == pytest.approx(ref[len(ids) - 1 + i, t].item(), abs=1e-4)


def test_min_tokens_masks_eos_and_stop_ids_and_bad_words(llm, hf):
    tok = llm.get_tokenizer()
    ids = tok(PROMPT).input_ids
    base = llm.generate([ids], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
    b = base.outputs[0].token_ids
    stop = next(t for t in b[:6] if t in b[8:])  # early, and again later
    sp = SamplingParams(temperature=0, max_tokens=N, min_tokens=6, stop_token_ids=[stop])
    got = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0]
    eos = [1, 2, stop]
    want = hf_greedy(hf, ids, [MinNewTokensLengthLogitsProcessor(len(ids), 6, eos)], eos=eos)
    assert got.token_ids == want and len(got.token_ids) > 6 and stop not in got.token_ids[:6]
    assert got.finish_reason == "stop" and got.token_ids[-1] in eos
    # bad_words: "Lily" is one token here, banned wherever it would come.
    (lily,) = tok.encode("Lily", add_special_tokens=False)
    assert lily in base.outputs[0].token_ids
    bw = llm.generate([ids], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=["Lily"]),
                      use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert bw.token_ids == hf_greedy(hf, ids, [NoBadWordsLogitsProcessor([[lily]], eos_token_id=None)])
    assert "Lily" not in bw.text and lily not in bw.token_ids
    # A two-token bad word: its second token is banned right after its first.
    pair = base.outputs[0].token_ids[3:5]
    word = tok.decode(pair).strip()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=[word]),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    seqs = llm.llm_engine.inputs.bad_words_token_ids([word])
    for s in seqs:
        assert not any(out.token_ids[i : i + len(s)] == s for i in range(len(out.token_ids)))


def test_n_seeds_batching_and_prefix_caching_still_hold(llm):
    ids = llm.get_tokenizer()(PROMPT + ", there was a little girl named Lily. She loved to play outside.").input_ids
    assert len(ids) > 16  # a full block, so that the repeat hits the prefix cache
    opts = dict(max_tokens=24, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.4,
                logit_bias={5: 2.0}, bad_words=["Lily"])  # fmt: skip
    seeded = SamplingParams(temperature=1.0, seed=5, **opts)
    alone = llm.generate([ids], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        [ids, "Lily and Tom", ids], [SamplingParams(temperature=0, **opts), seeded, seeded], use_tqdm=False
    )
    assert batch[2].outputs[0].token_ids == alone and batch[2].num_cached_tokens > 0
    n3 = llm.generate([ids], SamplingParams(n=3, temperature=1.0, seed=5, **opts), use_tqdm=False)[0]
    assert n3.outputs[0].token_ids == alone  # child 0 draws as the request alone
    assert len({tuple(c.token_ids) for c in n3.outputs}) > 1
    greedy2 = llm.generate([ids], SamplingParams(n=2, temperature=0, **opts), use_tqdm=False)[0]
    assert greedy2.outputs[0].token_ids == greedy2.outputs[1].token_ids == batch[0].outputs[0].token_ids


def test_bad_values_are_clear_errors(llm):
    for kw, words in (
        ({"presence_penalty": 3}, "presence_penalty must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"logit_bias": {"x": 1}}, "logit_bias must map token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be"),
        ({"bad_words": [""]}, "bad_words must be"),
    ):
        with pytest.raises(InvalidRequestError, match=words):
            SamplingParams(**kw)
    for kw, words in (({"logit_bias": {512: 1.0}}, "logit_bias has token id 512"),
                      ({"allowed_token_ids": [3, 9999]}, "allowed_token_ids has token id 9999")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)


def test_generation_config_defaults_auto_and_vllm(stories_path, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(stories_path, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(temperature=0.0, repetition_penalty=1.3, max_new_tokens=7, top_k=5)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    auto = LLM(str(folder), calibrate_preemption=False, num_kv_blocks=32)
    d = auto.get_default_sampling_params()
    assert (d.temperature, d.repetition_penalty, d.max_tokens, d.top_k) == (0.0, 1.3, 7, 5)
    out = auto.generate([PROMPT], use_tqdm=False)[0].outputs[0]  # no params: the defaults
    ref = auto.generate([PROMPT], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=7, top_k=5),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == ref.token_ids and len(out.token_ids) <= 7
    plain = LLM(str(folder), calibrate_preemption=False, num_kv_blocks=32, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
