"""The Triton kernels (issue 19) under the interpreter on CPU tensors, against the torch reference.

Each case fills a paged pool (blocks in shuffled order) with a cached prefix per request, then runs
one step -- ragged prefill chunks over cached prefixes (prefix-cache hits), block boundaries,
decodes -- through ``TorchAttentionBackend`` and ``TritonAttentionBackend`` on twin pools, and
compares the outputs and everything written (values, int8/fp8 codes and scales, overlay rows).
Shapes are tiny: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # conftest sets it first; kept for running this file alone

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvledger.errors import ConfigError  # noqa: E402
from kvledger.model.attention.metadata import AttentionMetadata  # noqa: E402
from kvledger.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvledger.model.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    resolve_attention_backend,
)
from kvledger.storage.kv_cache import KVCachePool  # noqa: E402
from kvledger.storage.kv_quant import quantize  # noqa: E402


def _pools(kv_dtype, dtype, heads_kv, head_dim, bs, num_blocks, S=0, R=0, slots=0):
    def one():
        return KVCachePool(
            1, num_blocks, bs, heads_kv, head_dim, dtype,
            kv_cache_dtype=kv_dtype, sink_tokens=S, recent_tokens=R, overlay_slots=slots,
        )  # fmt: skip

    a, b = one(), one()
    return a, b


def _step(
    reqs: list[tuple[int, int]],
    pools: tuple[KVCachePool, KVCachePool],
    heads: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    overlay: list[tuple[int, int]] | None = None,
):
    """reqs: (cached, new) tokens per request. Fills the cached prefix into both pools (same
    random K/V, blocks in shuffled order), builds the step's metadata and its q/k/v."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    a, b = pools
    bs = a.block_size
    free = list(range(1, a.num_blocks))  # block 0 stays the padding block
    rng.shuffle(free)
    tables, slots, qsl = [], [], [0]
    for cached, new in reqs:
        n_blocks = -(-(cached + new) // bs)
        table = [free.pop() for _ in range(n_blocks)]
        tables.append(table)
        if cached:
            pos = torch.arange(cached)
            sm = torch.tensor(table)[pos // bs] * bs + pos % bs
            k = torch.randn(cached, heads_kv, head_dim, generator=g).to(dtype)
            v = torch.randn(cached, heads_kv, head_dim, generator=g).to(dtype)
            for p in (a, b):
                p.layers[0].write(k, v, sm)
        pos = torch.arange(cached, cached + new)
        slots.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor([c + n for c, n in reqs]),
        block_tables=bt,
        block_size=bs,
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(c + n for c, n in reqs),
        query_lens_list=[n for _, n in reqs],
        seq_lens_list=[c + n for c, n in reqs],
    )
    if overlay is not None:
        # Slot i per request; random full-precision rows (both pools hold the same).
        rows = a.overlay
        rows.copy_(torch.randn(rows.shape, generator=g).to(dtype))
        b.overlay.copy_(rows)
        meta.overlay_slots = list(range(len(reqs)))
        meta.overlay_sink_from = [s for s, _ in overlay]
        meta.overlay_window_from = [w for _, w in overlay]
    t = qsl[-1]
    # As in the model: q and k are views of one fused row, v another tensor (other row strides).
    qk = torch.randn(t, heads + heads_kv, head_dim, generator=g).to(dtype)
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn(t, heads_kv, head_dim, generator=g).to(dtype)
    return meta, q, k, v


def _compare(pools, meta, q, k, v, tol, num_splits=None, **kw):
    a, b = pools
    scale = q.shape[-1] ** -0.5
    ref = TorchAttentionBackend().forward(q, k, v, a.layers[0], meta, scale, **kw)
    tri = TritonAttentionBackend()
    tri.fixed_num_splits = num_splits
    out = tri.forward(q, k, v, b.layers[0], meta, scale, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max |triton - torch| = {err}"
    # Everything written is identical: values or codes + scales, and the overlay rows.
    assert torch.equal(a.data, b.data)
    if a.overlay is not None:
        assert torch.equal(a.overlay, b.overlay)
    return out


CASES = {
    # name: (heads, kv heads, head_dim, block size, [(cached, new)], dtype, tol)
    "decode_gqa_ragged": (8, 2, 16, 16, [(0, 1), (16, 1), (31, 1), (47, 1)], torch.float32, 2e-5),
    "prefill_mqa_prefix_hits": (4, 1, 8, 16, [(0, 5), (16, 7), (33, 1), (12, 20)], torch.float32, 2e-5),
    "chunks_block32_mha": (2, 2, 32, 32, [(32, 3), (0, 33), (64, 2)], torch.float32, 2e-5),
    "fp16_gqa_mixed": (4, 2, 64, 16, [(5, 12), (40, 1), (0, 17)], torch.float16, 4e-3),
    "bf16_decode": (4, 4, 16, 16, [(20, 1), (3, 1)], torch.bfloat16, 3e-2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_torch_reference(case):
    heads, kvh, d, bs, reqs, dtype, tol = CASES[case]
    pools = _pools("auto", dtype, kvh, d, bs, 24)
    meta, q, k, v = _step(reqs, pools, heads, kvh, d, dtype, seed=len(case))
    _compare(pools, meta, q, k, v, tol)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_head_dims_with_split_k(head_dim):
    """Split-K over a context several tiles long, merged by the reduction kernel."""
    pools = _pools("auto", torch.float32, 1, head_dim, 16, 12)
    meta, q, k, v = _step([(70, 1), (9, 1)], pools, 2, 1, head_dim, torch.float32, seed=head_dim)
    _compare(pools, meta, q, k, v, 2e-5, num_splits=4)


def test_split_k_prefill_matches_unsplit():
    pools = _pools("auto", torch.float32, 2, 16, 16, 16)
    meta, q, k, v = _step([(40, 9), (0, 3)], pools, 4, 2, 16, torch.float32, seed=3)
    _compare(pools, meta, q, k, v, 2e-5, num_splits=2)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_int8"])
def test_quantised_kv_dequantised_in_kernel(fmt):
    """Codes and scales written bit-identically to kv_quant.quantize; attention over them
    (no overlay) equals the reference's dequantise-then-attend."""
    pools = _pools(fmt, torch.float32, 2, 16, 16, 16)
    meta, q, k, v = _step([(17, 4), (30, 1), (0, 6)], pools, 4, 2, 16, torch.float32, seed=7)
    _compare(pools, meta, q, k, v, 2e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8_int8"])
def test_quantised_overlay_sinks_and_recent_window(fmt):
    """S = 2 sinks, R = 3 recent rows in full precision: a prefill chunk over a cached prefix
    (window rows from the slot's ring), a decode, a first chunk, and a request whose slot lacks
    its sinks and part of its window (prefix-cache hit: sink_from / window_from past them)."""
    pools = _pools(fmt, torch.float32, 2, 16, 16, 16, S=2, R=3, slots=4)
    reqs = [(10, 5), (21, 1), (0, 7), (18, 2)]
    overlay = [(0, 7), (0, 15), (0, 0), (2, 17)]
    meta, q, k, v = _step(reqs, pools, 4, 2, 16, torch.float32, seed=11, overlay=overlay)
    _compare(pools, meta, q, k, v, 2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window_and_softcap(num_splits):
    """Sliding-window layers (keys p - window < j <= p; blocks wholly before the window are
    never read: their table entries here point past the pool) and Gemma 2's score softcap."""
    pools = _pools("auto", torch.float32, 2, 16, 16, 16)
    reqs = [(20, 6), (40, 1), (0, 9), (35, 3)]
    meta, q, k, v = _step(reqs, pools, 4, 2, 16, torch.float32, seed=13)
    meta.block_tables[1, 0] = 10**6  # request 1 sees keys 35..40 only: block 0 is gone
    meta.block_tables[3, 0] = 10**6  # request 3's queries 35..37 see keys >= 31
    _compare(pools, meta, q, k, v, 2e-5, num_splits=num_splits, window=5, softcap=2.0)


def test_write_codes_match_torch_quantize_on_ties():
    """Values on fp8 / int8 rounding ties (round half to even) encode like torch."""
    from kvledger.model.attention import triton_kernels as tk

    torch.manual_seed(0)
    x = torch.randn(6, 2, 16) * 3
    x[0, 0, 1:] = torch.arange(15) + 0.5  # int8 ties once scaled by absmax 127 below
    x[0, 0, 0] = 127.0
    x[1, 0] = 0.0  # absmax 0
    for fmt in ("int8", "fp8"):
        pool = KVCachePool(1, 2, 8, 2, 16, torch.float32, kv_cache_dtype=fmt)
        cache = tk.CacheView.of(pool.layers[0])
        slots = torch.tensor([3, 0, 9, 15, 4, 7])
        tk.write_kv(x, x, cache, slots)
        codes, scales = quantize(x, fmt)
        assert torch.equal(cache.k[slots], codes) and torch.equal(cache.v[slots], codes)
        assert torch.equal(cache.k_scales[slots], scales)


def test_negative_slots_are_skipped():
    from kvledger.model.attention import triton_kernels as tk

    pool = KVCachePool(1, 2, 4, 1, 8, torch.float32)
    cache = tk.CacheView.of(pool.layers[0])
    x = torch.ones(2, 1, 8)
    tk.write_kv(x, x, cache, torch.tensor([-1, 5]))
    assert cache.k.sum().item() == 8.0 and cache.k[5].sum().item() == 8.0


def test_backend_choice_and_errors(monkeypatch):
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("triton", torch.device("cpu")) == "triton"  # interpreter on
    with pytest.raises(ConfigError, match="attention_backend must be one of auto, torch, triton"):
        resolve_attention_backend("flash", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", torch.device("cpu"))


# -- end to end ------------------------------------------------------------------------------
def test_llm_with_triton_backend_equals_hf_greedy(stories_path):
    """The whole engine on the Triton kernels (interpreted): greedy tokens equal HF float32's,
    through chunked prefill (8-token chunks over 16-token blocks), batched decodes and a
    prefix-cache hit (the second call's prompt shares the first's first 16 tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvledger import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(stories_path))
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    a = tok("Once upon a time, there was a little girl named Lily. She").input_ids
    b = a[:16] + tok("big dog", add_special_tokens=False).input_ids
    c = tok("The cat sat").input_ids
    llm = LLM(
        str(stories_path),
        attention_backend="triton",
        max_num_batched_tokens=8,
        num_kv_blocks=24,
        calibrate_preemption=False,
    )
    assert llm.engine.executor.worker.spec.attention_backend == "triton"
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([a, c], sp, use_tqdm=False)
    second = llm.generate([b], sp, use_tqdm=False)
    assert second[0].num_cached_tokens == 16
    for prompt, out in zip([a, c, b], [*first, *second]):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref


def test_decode_graph_padding_rows_change_nothing():
    """CUDA-graph inputs (core/cuda_graphs.DecodeGraphs.stage): a 3-request decode step padded to
    the captured size 4 (slot -1, one context token) attends exactly like the step itself, and
    the padding row writes nothing. The capture itself needs a GPU (benchmarks/gpu_check.py)."""
    from kvledger.worker.cuda_graphs import DecodeGraphs, capture_sizes

    assert capture_sizes(3) == [1, 2, 4, 8] and capture_sizes(1000)[-1] == 512
    pools = _pools("auto", torch.float32, 2, 16, 16, 16)
    meta, q, k, v = _step([(20, 1), (3, 1), (33, 1)], pools, 4, 2, 16, torch.float32, seed=5)
    graphs = DecodeGraphs(None, pools[1].layers, 8, 64, 16, 2, torch.device("cpu"))
    b = graphs.stage(torch.zeros(3, dtype=torch.int64), meta.seq_lens - 1, meta)
    assert b == 4 and graphs.slots[3].item() == -1
    pad = torch.zeros(1, *q.shape[1:])
    ref = TorchAttentionBackend().forward(q, k, v, pools[0].layers[0], meta, 0.25)
    out = TritonAttentionBackend().forward(
        torch.cat([q, pad]), torch.cat([k, pad[:, :2]]), torch.cat([v, pad[:, :2]]),
        pools[1].layers[0], graphs.meta_for(b), 0.25,
    )  # fmt: skip
    assert (out[:3] - ref).abs().max().item() <= 2e-5
    assert torch.equal(pools[0].data, pools[1].data)


def test_llm_int8_kv_with_window_same_tokens_as_torch_backend(stories_path):
    """int8 KV with 2 sinks and a 4-token window through the engine (runner's overlay slots,
    chunked prefill, a prefix hit): the Triton backend's greedy tokens equal the torch backend's."""
    from kvledger import LLM, SamplingParams

    prompts = [list(range(5, 30)), list(range(5, 21)) + [40, 41, 42]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(stories_path), attention_backend=backend, kv_cache_dtype="int8",
                  kv_sink_tokens=2, kv_recent_tokens=4, max_num_batched_tokens=8,
                  num_kv_blocks=24, max_num_seqs=4, calibrate_preemption=False)  # fmt: skip
        first = llm.generate(prompts[:1], sp, use_tqdm=False)
        second = llm.generate(prompts[1:], sp, use_tqdm=False)
        assert second[0].num_cached_tokens == 16
        outs[backend] = [o.outputs[0].token_ids for o in first + second]
    assert outs["triton"] == outs["torch"]
