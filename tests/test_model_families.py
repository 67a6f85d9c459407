"""The new families through the whole engine against HF float32 greedy: Gemma 2/3, Phi-3,
Mixtral, Qwen3-MoE and the RoPE scalings (issue 20). One sliding-window model and one MoE model
also go through prefix-cache hits, n > 1 and forced preemption (swap and recompute)."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger import LLM, SamplingParams
from tests.model_factory import build_hf_model, tiny_config
from tests.test_engine_exact import hf_greedy


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "kind", ["gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "llama_yarn", "mistral_window"]
)
def test_engine_greedy_matches_hf(kind, tmp_path):
    """Batched requests (prefill chunks and decodes in one step) several windows long."""
    hf = build_hf_model(tiny_config(kind), tmp_path)
    llm = LLM(str(tmp_path), block_size=4, calibrate_preemption=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 17, 2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), (kind, p)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_moe", "mistral_window"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefix_hits_n2_and_preemption_match_hf(kind, mode, tmp_path):
    hf = build_hf_model(tiny_config(kind), tmp_path)
    rng = random.Random(3)
    shared = [rng.randrange(3, 97) for _ in range(13)]  # three full 4-token blocks shared
    prompts = [shared + [rng.randrange(3, 97) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 24), ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(temperature=0, n=2, max_tokens=20, ignore_eos=True)
    blocks = 10 if kind == "mistral_window" else 22  # a window model holds far fewer blocks
    llm = LLM(str(tmp_path), block_size=4, num_kv_blocks=blocks, preemption_mode=mode, calibrate_preemption=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, sp, o in zip(prompts, params, outs):
        ref = hf_greedy(hf, p, sp.max_tokens)
        assert [c.token_ids for c in o.outputs] == [ref] * sp.n, (kind, p)
    snap = llm.ledger()
    assert snap.prefix_cache_hits > 0
    assert snap.preemptions[mode] > 0
    assert snap.used_blocks == 0 and snap.swapped_blocks == 0


def test_window_model_request_holds_only_its_window(tmp_path):
    """Every layer sliding (window 9): a 100-token request several windows long holds at most
    the window's blocks plus the chunk being written, step after step, and matches HF."""
    from kvledger.cache.attention_policy import cdiv

    hf = build_hf_model(tiny_config("mistral_window"), tmp_path)
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=8, calibrate_preemption=False)
    eng = llm.engine
    assert eng.kv.windows == [9]  # one group, every layer with the window
    prompt = torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True), request_id="r")
    bound = cdiv(9 - 1 + 8, 4) + 1  # the window before a chunk of 8, plus a partial block
    peak, out = 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        used = eng.ledger().used_blocks
        assert used <= bound
        peak = max(peak, used)
    assert peak >= 3  # the window's blocks were really held
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 70)


def test_hybrid_model_sliding_groups_hold_only_their_window(tmp_path):
    """Gemma 3 (two local layers of window 6 per global one): the KV cache groups split the
    layers, each local group holds at most its window's blocks step after step while the
    global group holds every token, the pool charges exactly that, and the output matches HF."""
    from kvledger.cache.attention_policy import cdiv

    hf = build_hf_model(tiny_config("gemma3"), tmp_path)
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=8, calibrate_preemption=False)
    eng = llm.engine
    assert eng.kv_layout.windows == [None, 6, 6] and eng.executor.worker.kv_pool.num_layers == 1
    prompt = torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id="r")
    bound = cdiv(6 - 1 + 8, 4) + 1  # the window before a chunk of 8, plus a partial block
    peak, out = 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if "r" not in eng.kv.requests:
            break
        full, *local = (sum(b >= 0 for b in t) for t in eng.kv.block_tables("r"))
        assert full == cdiv(eng.kv.requests["r"].num_tokens, 4)
        assert all(n <= bound for n in local)
        assert eng.ledger().used_blocks == full + sum(local)
        peak = max(peak, *local)
    assert peak >= 2  # the window's blocks were really held
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 50)


def test_longrope_matches_hf_across_the_switch_point(tmp_path):
    """Phi-3 LongRoPE with original_max_position_embeddings 48: HF uses the long factors for
    every position once a sequence is longer than 48, recomputing its cache when a generation
    crosses. kvledger recomputes such a request (short-factor K are not reused), prefills long
    prompts with the long table even in chunks that end before 48, and caches the two kinds of
    K apart: decodes crossing the point, n = 2, chunked long prompts and prefix hits all match."""
    hf = build_hf_model(tiny_config("phi3"), tmp_path)
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 97, (40,), generator=g).tolist()
    prompts = [base, base + torch.randint(3, 97, (20,), generator=g).tolist(), base[:30]]
    params = [
        SamplingParams(temperature=0, n=2, max_tokens=20, ignore_eos=True),  # 40 -> 60: crosses
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # 60: long from the start
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),  # 30 -> 55: crosses
    ]
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=16, calibrate_preemption=False)
    for _ in range(2):  # the second round is served from the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, sp, o in zip(prompts, params, outs):
            assert [c.token_ids for c in o.outputs] == [hf_greedy(hf, p, sp.max_tokens)] * sp.n
    assert llm.engine.scheduler.num_rope_recomputes >= 2 * 3  # two children + one, per round
    assert llm.ledger().prefix_cache_hits > 0


def test_disable_hybrid_kv_cache_manager_keeps_one_table(tmp_path):
    """vLLM's --disable-hybrid-kv-cache-manager: one block table (and pool block) for every
    layer of a hybrid model, nothing freed, the same tokens."""
    hf = build_hf_model(tiny_config("gemma2"), tmp_path)
    llm = LLM(str(tmp_path), block_size=4, calibrate_preemption=False, disable_hybrid_kv_cache_manager=True)
    eng = llm.engine
    assert not eng.kv_layout.is_hybrid and eng.executor.worker.kv_pool.num_layers == 3 and not eng.kv.windowed
    prompt = list(range(5, 25))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)
