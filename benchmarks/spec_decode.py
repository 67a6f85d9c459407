"""Speculative decoding (n-gram) off vs on, same run, same process, on stories260k::

    python -m benchmarks.spec_decode                    # ~2 min on a quiet 2-core VM
    python -m benchmarks.spec_decode --repeats 3 --k 5 --min 2 --max 3

1. Single-stream greedy: each prompt alone, off then on (taking turns, ``--repeats`` times,
   the fastest of each kept), on the prompts the proposer was developed with (``TUNED``) and
   on a held-out set written afterwards (``HELD_OUT``). Prints tokens/s of both, the ratio,
   tokens per verification step, and checks the outputs are token-identical.
2. "Never a loss": a workload where every draft misses. The drafts come from a proposer that
   knows the greedy continuation (from the run without speculation) and proposes a different
   token at every position, at every step: the worst case for the verification cost, which the
   adaptive gate (kvledger/spec_decode/adaptive.py) must bring back to within 3 % of
   speculation off, at 1 and at 64 streams.

Threads: ``--threads`` (default 1; on a shared 2-core VM, 2 spin-waiting OpenMP threads swing
timings by tens of percent). Results: ``bench_out/spec_decode/result.json``. ``--method suffix``: suffix decoding, whose
shared cache holds the prompts run before (never an earlier run of the same prompt); it verifies
a token tree of ``--tree-nodes`` nodes (speculative_config.tree_nodes, default 8; 0: one chain).
``--method draft_model --draft PATH [--draft-quantization int8]``: a draft model
(kvledger/worker/drafter.py); ``--draft self`` is the served model itself.

``--workload copy``: the copy-heavy workload instead of stories260k: prompts that quote a
document and ask for it back with one word replaced, served by a small Llama trained to copy
(benchmarks/copy_model.py builds it, ~16 min of one core the first time); 5 tasks as "tuned" and
5 more as "held-out" (other seeds), greedy until EOS. ``--no-never-hit`` skips part 2.
``--llamacpp``: also llama.cpp's n-gram speculation on the same model and prompts, same run
(benchmarks/spec_llamacpp.py).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_OUT, machine_info, print_header, save_json

STORIES = "../shared/models/stories260k"
CPU_TIME = False  # --cpu-time
TUNED = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "Tom and his dog went to the park. Tom and his dog",
    "The sun was shining. The birds were singing. The sun",
    "One day, a big bear",
    "Sue had a red ball. She",
]
HELD_OUT = [
    "Once upon a time, there was a boy named Tim. Tim had a big box of toys.",
    'Mom said, "Let\'s go to the store." Lucy was happy.',
    "There was a small cat who lived in a house with a kind old man.",
    "Ben wanted to fly like a bird.",
    "It was a cold day. Anna put on her hat and",
]


MODEL = STORIES  # --workload copy: the copy model's folder


def _llm(spec: dict | None, threads: int):
    import torch

    from kvledger import LLM

    torch.set_num_threads(threads)
    return LLM(MODEL, calibrate_preemption=False, speculative_config=spec)


def _ids(llm, p: str | list[int]) -> list[int]:
    return list(p) if isinstance(p, list) else llm.llm_engine.tokenize(p)


def _timed(llm, prompts: list, params) -> tuple[float, list[list[int]]]:
    """Seconds of the generate call (this process's CPU seconds with ``--cpu-time``: with one
    thread, a figure that other processes on a shared machine barely move), and the outputs."""
    clock = time.process_time if CPU_TIME else time.perf_counter
    t0 = clock()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return clock() - t0, [o.outputs[0].token_ids for o in outs]


def single_stream(
    off, on, prompts: list[str], repeats: int, max_tokens: int, history: list[list[int]]
) -> dict[str, Any]:
    """Each prompt alone; off and on take turns; the fastest repeat of each is kept.

    Method "suffix": before each run its shared cache is rebuilt to hold exactly the prompts
    run before this one (``history``, prompt + output tokens, one run each), never an earlier
    repeat of the same prompt, whose output would be its own perfect draft."""
    from kvledger import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    st = on.llm_engine.scheduler.speculator.stats
    t_off = t_on = 0.0
    tokens = 0
    identical = True
    steps_before, drafts_before, acc_before = _steps(on), st.num_drafts, st.num_accepted_tokens
    for p in prompts:
        best_off = best_on = float("inf")
        for _ in range(repeats):
            s, a = _timed(off, [p], sp)
            best_off = min(best_off, s)
            _reset_shared(on, history)
            s, b = _timed(on, [p], sp)
            best_on = min(best_on, s)
            identical &= a == b
        history.append(_ids(off, p) + a[0])
        t_off += best_off
        t_on += best_on
        tokens += len(a[0])
    drafts = st.num_drafts - drafts_before
    accepted = st.num_accepted_tokens - acc_before
    return {
        "prompts": len(prompts), "tokens": tokens, "identical": identical,
        "off_tok_s": tokens / t_off, "on_tok_s": tokens / t_on, "ratio": t_off / t_on,
        "steps_on": (_steps(on) - steps_before) // repeats,
        "drafts": drafts // repeats, "accepted": accepted // repeats,
    }  # fmt: skip


def _reset_shared(on, history: list[list[int]]) -> None:
    from kvledger.spec_decode.suffix import SuffixCache

    spec = on.llm_engine.scheduler.speculator
    if spec.shared is not None:
        spec.shared = SuffixCache(spec.shared.depth, spec.shared.max_requests)
        for tokens in history:
            spec.shared.add(tokens)


def _steps(llm) -> int:
    return llm.llm_engine.scheduler.step


def missing_drafts(on, reference: dict[tuple[int, ...], list[int]]) -> None:
    """Make ``on`` propose, at every decode step, k tokens that are each one off the greedy
    continuation it will produce (``reference``: prompt ids -> greedy output)."""
    from kvledger.spec_decode.speculator import Speculator, can_speculate

    spec = on.llm_engine.scheduler.speculator
    vocab = on.llm_engine.vocab_size

    class Missing(Speculator):
        def propose(self, req: Any, max_drafts: int, max_depth: int | None = None) -> tuple[list[int], None]:
            k = min(self.k, max_drafts, max_drafts if max_depth is None else max_depth)
            if k <= 0 or not can_speculate(req):
                return [], None
            if req.spec_state is None:
                req.spec_state = _state(self)
            if req.spec_state.gate is not None and not req.spec_state.gate.allow():
                return [], None
            ref = reference[tuple(req.prompt_token_ids)]
            nxt = ref[req.num_output_tokens : req.num_output_tokens + k]
            return [(t + 1) % vocab for t in nxt], None

    miss = Missing(spec.config)
    on.llm_engine.scheduler.speculator = miss


def _state(spec):
    from kvledger.spec_decode.adaptive import AcceptanceGate
    from kvledger.spec_decode.ngram import NgramIndex
    from kvledger.spec_decode.speculator import SpecState

    return SpecState(NgramIndex(1, 1), AcceptanceGate() if spec.config.adaptive else None)


def never_a_loss(off, on, streams: int, repeats: int, max_tokens: int) -> dict[str, Any]:
    from kvledger import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [(TUNED + HELD_OUT)[i % 10] + " " * (i // 10) for i in range(streams)]
    _, ref = _timed(off, prompts, sp)
    tok = off.llm_engine.tokenize
    missing_drafts(on, {tuple(tok(p)): r for p, r in zip(prompts, ref)})
    best_off = best_on = float("inf")
    identical = True
    ratios = []  # off / on of each pair of runs: their median is steadier than either minimum
    sums = [0.0, 0.0]  # and the seconds of all runs, off and on: their ratio steadier still
    for _ in range(repeats):
        s_off, a = _timed(off, prompts, sp)
        best_off = min(best_off, s_off)
        s, b = _timed(on, prompts, sp)
        best_on = min(best_on, s)
        ratios.append(s_off / s)
        sums[0] += s_off
        sums[1] += s
        identical &= a == b == ref
    st = on.llm_engine.scheduler.speculator.stats
    n = sum(len(r) for r in ref)
    return {
        "streams": streams, "tokens": n, "identical": identical,
        "off_tok_s": n / best_off, "on_tok_s": n / best_on, "ratio": best_off / best_on,
        "median_pair_ratio": sorted(ratios)[len(ratios) // 2], "sum_ratio": sums[0] / sums[1],
        "drafts": st.num_drafts // repeats, "accepted": st.num_accepted_tokens,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft_model"])
    ap.add_argument("--draft", default=None, help="draft model folder for --method draft_model ('self': the model)")
    ap.add_argument("--draft-layers", default=None,
                    help="draft = the served model with only these decoder layers, e.g. 0,1,4 (built in bench_out)")
    ap.add_argument("--draft-quantization", default=None, choices=["int8", "int4"],
                    help="the draft's on-the-fly weight quantization")
    ap.add_argument("--workload", default="stories", choices=["stories", "copy"],
                    help="stories260k continuations, or the copy-heavy tasks (benchmarks/copy_model.py)")
    ap.add_argument("--no-never-hit", action="store_true", help="skip the never-a-hit part")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also llama.cpp's n-gram speculation, same model and prompts (benchmarks/spec_llamacpp.py)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--max", type=int, default=3, help="prompt_lookup_max")
    ap.add_argument("--repeats", type=int, default=3, help="runs per prompt (never-hit: 2 x + 1)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-adaptive", action="store_true", help="turn the adaptive gate off")
    ap.add_argument("--tree-nodes", type=int, default=None,
                    help="speculative_config.tree_nodes (method suffix: drafts over a token tree)")
    ap.add_argument("--cpu-time", action="store_true", help="time by this process's CPU seconds")
    a = ap.parse_args()
    global CPU_TIME, MODEL
    CPU_TIME = a.cpu_time
    spec: dict[str, Any] = {
        "method": a.method,
        "num_speculative_tokens": a.k,
        "adaptive": not a.no_adaptive,
    }
    if a.method == "ngram":
        spec.update(prompt_lookup_min=a.min, prompt_lookup_max=a.max)
    if a.tree_nodes is not None:
        spec.update(tree_nodes=a.tree_nodes)
    sets: tuple[tuple[str, list], ...] = (("tuned", TUNED), ("held-out", HELD_OUT))
    max_tokens = a.max_tokens
    if a.workload == "copy":
        from benchmarks import copy_model

        MODEL = str(copy_model.ensure())
        sets = tuple(
            (name, [p for p, _ in copy_model.copy_prompts(5, seed)])
            for name, seed in (("tuned", 1234), ("held-out", 4321))
        )
        max_tokens = 64  # every answer (<= 49 tokens with EOS) ends before
    if a.method == "draft_model":
        if a.draft_layers:
            from benchmarks.common import layer_subset_copy

            keep = [int(x) for x in a.draft_layers.split(",")]
            out = BENCH_OUT / "spec_decode" / f"{Path(MODEL).name}-layers-{'-'.join(map(str, keep))}"
            a.draft = str(layer_subset_copy(Path(MODEL), out, keep))
        if not a.draft:
            ap.error("--method draft_model needs --draft PATH or --draft-layers")
        spec.update(model=MODEL if a.draft == "self" else a.draft, quantization=a.draft_quantization)
    off, on = _llm(None, a.threads), _llm(spec, a.threads)
    print_header(f"speculative decoding ({a.method}) off vs on, {Path(MODEL).name} ({a.workload}), greedy")
    print(f"date    : {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; spec {spec}")
    print(
        f"timing  : {'CPU' if CPU_TIME else 'wall'} seconds, fastest of {a.repeats} (off and on take turns)"
    )
    result: dict[str, Any] = {"machine": machine_info(), "spec": spec}
    history: list[list[int]] = []  # method suffix: what the shared cache has seen
    for name, prompts in sets:
        r = result[name] = single_stream(off, on, prompts, a.repeats, max_tokens, history)
        print(
            f"{name:9s}: 1 stream, {r['prompts']} prompts, {r['tokens']} tokens: off "
            f"{r['off_tok_s']:.0f} tok/s, on {r['on_tok_s']:.0f} tok/s, x{r['ratio']:.2f}; "
            f"{r['tokens'] / max(r['steps_on'], 1):.2f} tokens/step, {r['accepted']}/{r['drafts']} "
            f"accepted/drafts; identical: {r['identical']}"
        )
    if a.llamacpp:
        from benchmarks import spec_llamacpp

        for name, prompts in sets:
            ids = [_ids(off, p) for p in prompts]
            r = result[f"llamacpp_{name}"] = spec_llamacpp.compare(MODEL, ids, max_tokens, a.k, a.threads)
            print(spec_llamacpp.describe(name, r))
    for streams in () if a.no_never_hit else (1, 64):
        on_miss = _llm(spec, a.threads)
        tokens = 256 if streams == 1 else 128
        r = result[f"never_hit_{streams}"] = never_a_loss(
            off, on_miss, streams, 2 * a.repeats + 1, tokens
        )
        print(
            f"never-hit: {streams} stream(s), {r['tokens']} tokens: off {r['off_tok_s']:.0f} tok/s, "
            f"on {r['on_tok_s']:.0f} tok/s, x{r['ratio']:.3f} (median of pairs x{r['median_pair_ratio']:.3f}, "
            f"all runs x{r['sum_ratio']:.3f}); "
            f"{r['drafts']} drafts verified, "
            f"{r['accepted']} accepted; identical: {r['identical']}"
        )
    save_json(result, BENCH_OUT / "spec_decode" / "result.json")


if __name__ == "__main__":
    main()
