"""Incremental detokenization: the text a sequence's tokens add after the prompt, produced one
token at a time, equals what decoding everything at once gives; stop strings and streams."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvledger import LLM, SamplingParams
from kvledger.core.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)
from kvledger.engine.async_engine import AsyncEngine
from kvledger.sampling_params import RequestOutputKind

UNICODE = ["naïve café 世界 — 😀 ok", "Ünïcödé ẞ and 日本語のテキスト", "plain ascii, then ñ"]


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False)


@pytest.fixture(scope="module")
def stories_tok(stories_path):
    return AutoTokenizer.from_pretrained(str(stories_path))


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE (GPT-2 style) small enough that most non-ASCII characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Once upon a time there was a little girl. " * 3, *UNICODE]
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed tokens one at a time; the cumulative text after each."""
    seen = []
    for t in ids:
        assert detok.update([t], False) is None
        seen.append(detok.output_text)
    detok.finish()
    return seen


@pytest.mark.parametrize("kind", ["fast", "slow"])
@pytest.mark.parametrize("which", ["stories", "byte_bpe"])
def test_prompt_plus_text_is_the_decode_of_everything(which, kind, stories_tok, byte_bpe):
    tok = stories_tok if which == "stories" else byte_bpe
    cls = FastIncrementalDetokenizer if kind == "fast" else SlowIncrementalDetokenizer
    split = 0
    for text in UNICODE:
        for cut in (4, 9):
            prompt_text, rest = text[:cut], text[cut:]
            prompt_ids = tok(prompt_text).input_ids
            out_ids = tok(rest, add_special_tokens=False).input_ids
            pieces = [tok.decode([t]) for t in out_ids]
            split += sum("\ufffd" in p for p in pieces)  # a character spread over several tokens
            params = SamplingParams()
            detok = (
                cls(tok, tok.backend_tokenizer, prompt_ids, params)
                if kind == "fast"
                else cls(tok, prompt_ids, params)
            )
            seen = _feed(detok, out_ids)
            whole = tok.decode(prompt_ids + out_ids, skip_special_tokens=True)
            prompt_decoded = tok.decode(prompt_ids, skip_special_tokens=True)
            assert prompt_decoded + detok.output_text == whole, (text, cut)
            # Partial characters are held back, never shown and later replaced.
            assert all("\ufffd" not in s for s in seen)
            assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    assert split >= 3, "the inputs must split characters across tokens to test anything"


def test_the_first_token_keeps_its_leading_space(llm):
    prompt = "Lily and Tom went to the beach. They"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    c = out.outputs[0]
    tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.tokenizer
    assert c.text.startswith(" ") and not c.text.startswith("  ")
    assert prompt + c.text == tok.decode(out.prompt_token_ids + c.token_ids, skip_special_tokens=True)


def _readme_story(stories_path) -> str:
    """The README's known-good greedy continuation of "Once upon a time" (llama2.c and HF)."""
    lines = (stories_path / "README.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("Once upon a time,"))
    story = []
    for ln in lines[start:]:
        if not ln.strip():
            break
        story.append(ln.strip())
    return " ".join(story)


def test_greedy_text_reads_as_the_readme_streamed_or_not_with_stops(llm, stories_path):
    prompt = "Once upon a time"
    story = _readme_story(stories_path)
    greedy = SamplingParams(temperature=0, max_tokens=60)
    c = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    joined = " ".join((prompt + c.text).split())  # the README wraps its lines
    assert joined.startswith(story), joined
    # A stop string that spans tokens: cut exactly before it, the same streamed or not.
    stop = SamplingParams(temperature=0, max_tokens=60, stop=["red ball", "zzz"])
    cut = llm.generate([prompt], stop, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "red ball"
    assert cut.text == c.text[: c.text.index("red ball")]
    assert len(cut.token_ids) < len(c.token_ids)

    async def stream(params: SamplingParams) -> tuple[list[str], str | None]:
        aengine = AsyncEngine(llm.engine)
        pieces, reason = [], None
        try:
            async for out in aengine.generate(prompt, params, "s"):
                for co in out.outputs:
                    pieces.append(co.text)
                    reason = co.finish_reason
        finally:
            aengine.shutdown()
        return pieces, reason

    for params, want in ((greedy, c), (stop, cut)):
        delta = SamplingParams(**{**params.__dict__, "output_kind": RequestOutputKind.DELTA})
        pieces, reason = asyncio.run(stream(delta))
        assert "".join(pieces) == want.text and reason == want.finish_reason
        assert len(pieces) > 5  # really streamed: a forming stop string never leaks out
        llm.engine.stream_outputs = False


def test_stop_string_search_covers_only_new_text_and_min_tokens(stories_tok):
    tok = stories_tok
    prompt = tok("Once").input_ids
    out = tok("upon a time there was a cat", add_special_tokens=False).input_ids  # "▁upon"…
    # "a t" spans tokens (" a", " time"); found as soon as its last token arrives.
    d = IncrementalDetokenizer.new(tok, prompt, SamplingParams(stop=["a t"]))
    hit_at = next(i for i, t in enumerate(out) if d.update([t], False) is not None)
    assert "a t" not in tok.decode(out[:hit_at]) and "a t" in tok.decode(out[: hit_at + 1])
    assert d.output_text == " upon "
    # Text produced before min_tokens never matches, even as the start of a later overlap.
    d = IncrementalDetokenizer.new(tok, prompt, SamplingParams(stop=["upon"], min_tokens=3))
    assert all(d.update([t], False) is None for t in out)
    # include_stop_str_in_output keeps it; stream deltas never show a forming stop string.
    d = IncrementalDetokenizer.new(
        tok, prompt, SamplingParams(stop=["a time"], include_stop_str_in_output=True)
    )
    first = next(i for i in range(len(out)) if "a time" in tok.decode(out[: i + 1]))
    hits = [d.update([t], False) for t in out[: first + 1]]
    assert hits[first] == "a time" and not any(hits[:first])
    assert d.output_text == " upon a time"
    d = IncrementalDetokenizer.new(tok, prompt, SamplingParams(stop=["there"]))
    sent = []
    for t in out:
        stop = d.update([t], False)
        sent.append(d.get_next_output_text(finished=stop is not None, delta=True))
        if stop:
            break
    assert "".join(sent) == " upon a time " and all("th" not in s for s in sent)


def test_delta_outputs_of_n2_add_up_to_the_cumulative_ones(llm):
    eng = llm.engine
    base = dict(n=2, temperature=1.0, seed=11, max_tokens=25, logprobs=1, ignore_eos=True)
    ref = llm.generate(["Lily"], SamplingParams(**base), use_tqdm=False)[0]
    eng.stream_outputs = True
    try:
        eng.add_request("Lily", SamplingParams(**base, output_kind=RequestOutputKind.DELTA), "d")
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
    finally:
        eng.stream_outputs = False
    assert len(outs) > 5 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    # Plain data: outputs cross a process boundary unchanged (the engine may move out).
    assert pickle.loads(pickle.dumps(outs[-1])) == outs[-1]
    merged = outs[0]
    for o in outs[1:]:
        merged.add(o, aggregate=True)
    for m, r in zip(sorted(merged.outputs, key=lambda c: c.index), ref.outputs):
        assert (m.text, m.token_ids, m.finish_reason) == (r.text, r.token_ids, r.finish_reason)
        assert len(m.logprobs) == len(r.logprobs) == 25
        assert m.cumulative_logprob == pytest.approx(r.cumulative_logprob)
