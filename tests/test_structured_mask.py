"""The grammar mask on the sampling path: the fused masked argmax kernel and the sampler's
greedy shortcut (mask only the rows whose argmax the grammar forbids) give exactly what
applying the mask with xgrammar and taking the argmax gives."""

from __future__ import annotations

import warnings

import pytest
import torch
import xgrammar as xgr

from kvledger.core.request import Request
from kvledger.kernels import native
from kvledger.sample.sampler import SampleRequest, sample
from kvledger.sampling_params import SamplingParams
from kvledger.structured.state import apply_bitmask, disallowed_rows


def _random_mask(gen: torch.Generator, rows: int, vocab: int, density: float) -> torch.Tensor:
    mask = xgr.allocate_token_bitmask(rows, vocab)
    bits = (torch.rand(rows, mask.shape[1] * 32, generator=gen) < density).to(torch.int64)
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    mask.copy_(((words + 2**31) % 2**32 - 2**31).to(torch.int32))  # the uint32 bits as int32
    return mask


def _reference(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    ref = logits.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # logits wider than the mask: xgrammar warns, leaves them
        xgr.apply_token_bitmask_inplace(ref, mask, indices=rows)
    return ref[rows].argmax(dim=-1)


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.02, 0.5, 1.0])
def test_masked_argmax_kernel_equals_apply_then_argmax(density):
    gen = torch.Generator().manual_seed(0)
    for trial in range(12):
        rows, vocab = 1 + trial % 5, 1000 + 37 * trial
        logits = torch.randn(rows, vocab + (trial % 3) * 5, generator=gen)  # sometimes wider
        if trial % 4 == 1:
            logits[:, ::2] = float("-inf")
        if trial % 4 == 2:
            logits = logits.round()  # ties: the first index wins, as in torch
        mask = _random_mask(gen, rows, vocab, density)
        pick = list(range(0, rows, 1 + trial % 2))
        assert torch.equal(native.masked_argmax(logits, mask, pick), _reference(logits, mask, pick))


def test_greedy_shortcut_samples_what_the_full_mask_does(monkeypatch):
    """Greedy rows (with and without penalties), logprob rows and random rows in one batch."""
    gen = torch.Generator().manual_seed(1)
    vocab, n = 3000, 8
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={7: 5.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
    ]

    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(native, "masked_argmax", lambda *a: None)  # the torch fallback
        for density in (1e-3, 0.3, 0.97):
            logits = torch.randn(n, vocab, generator=gen)
            mask = _random_mask(gen, n, vocab, density)
            rows = [0, 1, 2, 4, 5, 6]  # 3 and 7 unconstrained
            mask[5] = -1  # everything allowed: the unmasked argmax stands
            reqs = lambda: [  # noqa: E731
                SampleRequest(sp, torch.Generator().manual_seed(9) if sp.seed else None,
                              Request(f"r{i}", [1, 2, 3], sp, output_token_ids=[4, 5]))
                for i, sp in enumerate(params)
            ]
            got, got_lp = sample(logits.clone(), reqs(), None, (mask, rows))
            full = logits.clone()
            apply_bitmask(full, (mask, rows))
            want, want_lp = sample(full, reqs(), None, None)
            assert got == want and got_lp == want_lp
            for i in rows:
                assert (int(mask[i, got[i] >> 5]) >> (got[i] & 31)) & 1  # allowed by the grammar
            assert disallowed_rows(mask, rows, torch.tensor(got)) == []


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_masked_argmax_kernel_rows_over_threads(threads):
    """Enough rows and logits for the kernel's OpenMP split: the same tokens as the reference."""
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 19, 32000
    logits = torch.randn(rows, vocab, generator=gen)
    logits[3] = logits[3].round()  # ties
    logits[7, ::2] = float("-inf")
    for density in (1e-3, 0.3, 1.0):
        mask = _random_mask(gen, rows, vocab, density)
        pick = [0, 1, 2, 3, 5, 7, 8, 11, 12, 13, 17, 18]
        assert torch.equal(native.masked_argmax(logits, mask, pick, threads), _reference(logits, mask, pick))


@pytest.mark.parametrize("threads", [1, 2, 3, None])
def test_batched_fill_equals_per_row_fill(stories_path, threads):
    """The engine's fill (xgrammar rows in one BatchGrammarMatcher call over ``threads``
    threads, llguidance rows one by one, unconstrained rows between them) sets exactly the bits
    the per-row fill does, over 40 steps of matchers in varied states."""
    import json

    from transformers import AutoTokenizer

    from kvledger.sampling_params import StructuredOutputsParams
    from kvledger.structured.backends import guidance_available, resolve_backend
    from kvledger.structured.compiler import GrammarCompiler
    from kvledger.structured.state import GrammarState, MaskBuffer, fill_bitmask, mask_threads
    from tests.data.json_schemas import SCHEMAS

    tok = AutoTokenizer.from_pretrained(str(stories_path))
    vocab = json.loads((stories_path / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tok, vocab, (tok.eos_token_id,))
    specs = [{"json": SCHEMAS[0]}, {"json": SCHEMAS[22]}, {"regex": r"[a-z]{2,6} (cat|dog)s?!"},
             {"choice": ["yes", "no", "maybe so"]}, {"grammar": 'root ::= ("ab" | "cd")+ "."'}]
    backends = ["xgrammar", "guidance"] if guidance_available() else ["xgrammar"]
    compiled = []
    for backend in backends:
        for spec in specs:
            params = StructuredOutputsParams(disable_any_whitespace=True, **spec)
            resolve_backend(params, backend)
            compiled.append(compiler.compile_now(params))
    compiler.shutdown()

    def state(c):
        from concurrent.futures import Future

        fut: Future = Future()
        fut.set_result(c)
        s = GrammarState(fut)
        s.start()
        return s

    # 30 rows: every grammar of every backend, interleaved, and unconstrained rows between.
    states = [None if j % 7 == 3 else state(compiled[j % len(compiled)]) for j in range(30)]
    owners = [type("Owner", (), {"grammar": s})() for s in states]
    xgrammar_rows = sum(1 for s in states if s is not None and type(s.matcher).__name__ == "GrammarMatcher")
    assert xgrammar_rows >= 12 and (len(backends) == 1 or xgrammar_rows < 30 - 5)
    buf = MaskBuffer(threads)
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        want_mask, want_rows = fill_bitmask(states, vocab)
        got_mask, got_rows = buf.fill(owners)
        assert got_rows == want_rows
        assert torch.equal(got_mask[got_rows], want_mask[want_rows])
        for i in want_rows:  # advance by a random token the grammar allows; restart a finished one
            bits = (want_mask[i].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
            allowed = bits.flatten()[:vocab].nonzero().flatten()
            t = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
            if states[i].accept(t):
                states[i].matcher.reset()
    # The batched path ran, with the thread count asked for (capped by rows per thread).
    want_threads = min(threads or mask_threads(), xgrammar_rows // 4)
    assert set(buf._batch) == {max(1, want_threads)}


@pytest.mark.parametrize("value", ["two", "0", "-1"])
def test_a_bad_mask_threads_setting_fails_at_start_up_naming_it(monkeypatch, value):
    """KVLEDGER_MASK_THREADS is read at each step; a bad value must stop the engine's start-up
    (ModelRunner builds its MaskBuffer) with a message naming it, not fail mid-step."""
    from kvledger.errors import ConfigError
    from kvledger.structured.state import MASK_THREADS_ENV, MaskBuffer

    monkeypatch.setenv(MASK_THREADS_ENV, value)
    with pytest.raises(ConfigError, match=f"{MASK_THREADS_ENV} must be a positive integer, got '{value}'"):
        MaskBuffer()
    monkeypatch.setenv(MASK_THREADS_ENV, "2")
    assert MaskBuffer().fill_threads(16) == 2
