"""Greedy text on stories260k equals what llama2.c's ``run.c`` prints, character for character.

``run.c`` (tests/oracle/llama2c, MIT, unchanged) is an independent C implementation of the same
model that reads the original llama2.c checkpoint and tokenizer, so it shares no code with
kvledger, transformers or ``tokenizers``: agreeing with it checks the numerics, the tokenizer's
encoding of the prompt, detokenization (the leading space of the first generated token, byte
fallback) and stop handling at once, streamed and not.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from kvledger import LLM, SamplingParams
from kvledger.engine.async_engine import AsyncEngine
from kvledger.sampling_params import RequestOutputKind

RUN_C = Path(__file__).parent / "oracle" / "llama2c" / "run.c"
# (prompt, run.c's -n steps: positions including the prompt's, how the story ends: at the step
# budget, or where the model samples BOS, which ends a TinyStories story)
CASES = [
    ("Once upon a time", 256, "length"),
    ("Lily and Tom went to the beach. They", 80, "length"),
    ("The little dog", 120, "length"),
    ("The sun was hot", 500, "stop"),
]


@pytest.fixture(scope="module")
def run_c(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:  # scripts/test.sh installs one; a missing compiler must not pass silently
        pytest.fail("no C compiler (cc/gcc) on PATH: the llama2.c oracle cannot be built")
    exe = tmp_path_factory.mktemp("llama2c") / "run"
    subprocess.run([cc, "-O2", "-o", str(exe), str(RUN_C), "-lm"], check=True)
    return exe


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False)


def _c_text(run_c: Path, stories_path: Path, prompt: str, steps: int) -> str:
    d = stories_path / "llama2c"
    out = subprocess.run(
        [str(run_c), str(d / "stories260K.bin"), "-z", str(d / "tok512.bin"),
         "-t", "0", "-n", str(steps), "-i", prompt],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    assert out.endswith("\n")  # run.c ends its story with one newline (tok/s goes to stderr)
    return out[:-1]


def _params(llm: LLM, prompt: str, steps: int, **kw) -> SamplingParams:
    # run.c samples at positions P-1 .. steps-1 (P = prompt tokens with BOS): steps - P + 1 tokens,
    # fewer when it samples BOS (id 1), where it stops as kvledger does (generation_config's eos).
    p = len(llm.get_tokenizer().encode(prompt))
    return SamplingParams(temperature=0, max_tokens=steps - p + 1, **kw)


async def _stream(llm: LLM, prompt: str, params: SamplingParams) -> str:
    aengine = AsyncEngine(llm.engine)
    delta = SamplingParams(**{**params.__dict__, "output_kind": RequestOutputKind.DELTA})
    pieces = []
    try:
        async for out in aengine.generate(prompt, delta, "oracle"):
            pieces += [co.text for co in out.outputs]
    finally:
        aengine.shutdown()
        llm.engine.stream_outputs = False
    assert len(pieces) > 5  # really streamed, a piece per step or so
    return "".join(pieces)


@pytest.mark.parametrize("prompt,steps,reason", CASES)
def test_greedy_text_is_run_c_text_streamed_or_not(run_c, llm, stories_path, prompt, steps, reason):
    want = _c_text(run_c, stories_path, prompt, steps)
    assert want.startswith(prompt) and len(want) > len(prompt) + 40
    params = _params(llm, prompt, steps)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert prompt + got.text == want
    assert got.finish_reason == reason
    assert prompt + asyncio.run(_stream(llm, prompt, params)) == want


@pytest.mark.parametrize("prompt,steps", [c[:2] for c in CASES[:2]])
def test_stop_strings_cut_run_c_text_exactly(run_c, llm, stories_path, prompt, steps):
    generated = _c_text(run_c, stories_path, prompt, steps)[len(prompt):]
    # A stop string from the middle of the C text, long enough to span several tokens.
    mid = len(generated) // 2
    stop = generated[mid : mid + 9]
    want = generated[: generated.index(stop)]
    params = _params(llm, prompt, steps, stop=[stop, "never in a story \x00"])
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want, "stop", stop)
    assert asyncio.run(_stream(llm, prompt, params)) == want
    # include_stop_str_in_output keeps the stop string, still nothing after it.
    keep = _params(llm, prompt, steps, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate([prompt], keep, use_tqdm=False)[0].outputs[0].text == want + stop
