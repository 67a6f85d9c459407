"""Quantised KV cache (issue 5): formats and error bounds, the attention rule with the
full-precision overlay, engine plumbing (prefix cache, COW, swap, recompute) and the memory
ledger. Quality (perplexity) is in test_kv_quant_quality.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvledger import LLM, SamplingParams
from kvledger.ledger.accounting import kv_bytes_per_token
from kvledger.ledger.spec import ModelSpec
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.model.attention.torch_backend import TorchAttentionBackend
from kvledger.storage.kv_cache import HostKVPool, KVCachePool
from kvledger.storage.kv_quant import QMAX, dequantize, quantize

FORMATS = ["int8", "fp8", "fp8_int8"]


# -- formats and error bounds --------------------------------------------------------------
def _adversarial(g: torch.Generator) -> dict[str, torch.Tensor]:
    base = torch.randn(64, 4, 64, generator=g)
    outlier_channels = base.clone()
    outlier_channels[:, :, [3, 17]] *= 60.0  # a few huge channels, as in real K
    outlier_token = base.clone()
    outlier_token[0] *= 80.0  # an attention sink: the first token dwarfs the rest
    mixed = base * torch.logspace(-3, 3, 64)[:, None, None]  # tokens spanning six decades
    zeros = base.clone()
    zeros[5] = 0.0  # absmax = 0
    zeros[6] = 1e-30  # far below float16's range
    return {
        "random": base,
        "outlier_channels": outlier_channels,
        "outlier_token": outlier_token,
        "mixed_magnitudes": mixed,
        "zeros_and_tiny": zeros,
    }


CASES = list(_adversarial(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("case", CASES)
def test_int8_error_is_at_most_absmax_over_254_per_token_and_head(case):
    x = _adversarial(torch.Generator().manual_seed(0))[case]
    codes, scales = quantize(x, "int8")
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert scales.shape == x.shape[:2] and codes.abs().max() <= 127
    y = dequantize(codes, scales, "int8")
    assert torch.isfinite(y).all()
    amax = x.abs().amax(-1, keepdim=True)
    # The scale is a float16, rounded to nearest: 2^-11 of slack on top of absmax / 254.
    bound = amax / 254 * (1 + 2**-10) + 2**-24
    assert ((y - x).abs() <= bound).all()


@pytest.mark.parametrize("case", CASES)
def test_fp8_e4m3_relative_error_is_at_most_one_sixteenth(case):
    x = _adversarial(torch.Generator().manual_seed(0))[case]
    codes, scales = quantize(x, "fp8")
    y = dequantize(codes, scales, "fp8")
    assert torch.isfinite(y).all()
    s = scales.float().unsqueeze(-1)
    normal = (x / s).abs() >= 2.0**-6  # e4m3's normal range (in units of the scale)
    err = (y - x).abs()
    assert (err[normal] <= 2.0**-4 * x.abs()[normal] * (1 + 2**-10)).all()
    # Subnormals: absolute error at most half the subnormal step, 2^-10 of the scale.
    assert (err[~normal] <= 2.0**-10 * s.expand_as(x)[~normal] + 2**-24).all()


def _per_tensor_int8(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().max() / 127
    return torch.round(x / s).clamp(-127, 127) * s


def test_per_token_head_scales_beat_per_tensor_on_an_outlier_token():
    x = _adversarial(torch.Generator().manual_seed(0))["outlier_token"]
    per_token = dequantize(*quantize(x, "int8"), "int8")
    per_tensor = _per_tensor_int8(x)
    rest = slice(1, None)  # the ordinary tokens, whose scale the sink ruins per tensor
    err_token = ((per_token - x)[rest].norm() / x[rest].norm()).item()
    err_tensor = ((per_tensor - x)[rest].norm() / x[rest].norm()).item()
    assert err_token < 0.01 and err_tensor > 20 * err_token, (err_token, err_tensor)


def test_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([[[1.0, -2.0, 3.0, 4.0]]])
    codes, scales = quantize(x, "fp8")
    y = dequantize(codes, scales, "fp8")
    assert codes.view(torch.float8_e4m3fn).float().abs().max() <= QMAX["fp8"]
    assert torch.allclose(y, x, rtol=2**-4)


# -- storage: blocks on dim 1, copies and swaps move codes verbatim -------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_layout_bytes_and_verbatim_copies(fmt):
    layers, blocks, bs, heads, hd = 2, 6, 4, 2, 16
    pool = KVCachePool(layers, blocks, bs, heads, hd, torch.float32, kv_cache_dtype=fmt)
    spec = ModelSpec("t", layers, 4, heads, hd, 64, 100)
    assert pool.bytes_per_block == kv_bytes_per_token(spec, fmt).total * bs
    assert pool.num_bytes <= pool.data.numel()  # codes and scales are views of one buffer
    for t in pool.layers[0].storage:
        assert t.shape[1] == blocks
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(8, heads, hd, generator=g), torch.randn(8, heads, hd, generator=g)
    slots = torch.arange(8)  # blocks 0 and 1
    for layer in pool.layers:
        layer.write(k, v, slots)
    before = pool.layers[1].read(torch.tensor([0, 1]))
    pool.copy_blocks([(0, 4), (1, 5)])
    after = pool.layers[1].read(torch.tensor([4, 5]))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    host = HostKVPool(3, pool)
    assert host.bytes_per_block == pool.bytes_per_block
    host.swap_out([(4, 0), (5, 2)])
    pool.data.zero_()
    host.swap_in([(0, 3), (2, 1)])
    back = pool.layers[1].read(torch.tensor([3, 1]))
    assert all(torch.equal(a, b) for a, b in zip(before, back))


# -- the attention rule: per query, key p is full precision iff p < S or q - p < R -----------
def _dense_reference(q, k, v, fmt, S, R, sink_from, window_from, scale):
    """Causal attention of every position of one sequence with the overlay rule, densely."""
    k_fmt, v_fmt = {"int8": ("int8", "int8"), "fp8": ("fp8", "fp8"), "fp8_int8": ("fp8", "int8")}[fmt]
    kd = dequantize(*quantize(k, k_fmt), k_fmt)
    vd = dequantize(*quantize(v, v_fmt), v_fmt)
    T, H, D = q.shape
    out = []
    for t in range(T):
        p = torch.arange(t + 1)
        full = ((p < S) & (p >= sink_from)) | ((t - p < R) & (p >= window_from) & (p >= S))
        full = full[:, None, None]
        kk = torch.where(full, k[: t + 1], kd[: t + 1]).transpose(0, 1)
        vv = torch.where(full, v[: t + 1], vd[: t + 1]).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[t][:, None], kk, vv, scale=scale, enable_gqa=True
        )  # [H, 1, D]
        out.append(o.reshape(H * D))
    return torch.stack(out)


class _Driver:
    """Feeds several sequences through the backend in given chunks, with overlay slots."""

    def __init__(self, fmt, S, R, bs=4, heads=4, kv_heads=2, hd=16, blocks=64):
        self.pool = KVCachePool(
            1, blocks, bs, kv_heads, hd, torch.float32, kv_cache_dtype=fmt,
            sink_tokens=S, recent_tokens=R, overlay_slots=4,
        )
        self.bs, self.backend = bs, TorchAttentionBackend()
        self.free = list(range(blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def step(self, batch, seqs, sink_from, window_from, scale):
        """batch: [(seq index, start, n)]; returns {seq: (start, output rows)}."""
        qs, ks, vs, slots, qlens, slens, tables = [], [], [], [], [], [], []
        for i, start, n in batch:
            q, k, v = seqs[i]
            table = self.tables.setdefault(i, [])
            while len(table) * self.bs < start + n:
                table.append(self.free.pop())
            for p in range(start, start + n):
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
            qs.append(q[start : start + n])
            ks.append(k[start : start + n])
            vs.append(v[start : start + n])
            qlens.append(n)
            slens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(qsl),
            seq_lens=torch.tensor(slens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            block_size=self.bs,
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            query_lens_list=qlens,
            seq_lens_list=slens,
            overlay_slots=[i for i, _, _ in batch],
            overlay_sink_from=[sink_from[i] for i, _, _ in batch],
            overlay_window_from=[window_from[i] for i, _, _ in batch],
        )
        out = self.backend.forward(
            torch.cat(qs), torch.cat(ks), torch.cat(vs), self.pool.layers[0], meta, scale
        )
        res = {}
        for j, (i, start, _) in enumerate(batch):
            res[i] = (start, out[qsl[j] : qsl[j + 1]])
        return res


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("S,R", [(0, 0), (3, 0), (0, 5), (3, 5)])
def test_backend_applies_the_overlay_rule_whatever_the_chunking(fmt, S, R):
    g = torch.Generator().manual_seed(3)
    T, scale = 30, 0.25
    seqs = []
    for _ in range(3):
        k = torch.randn(T, 2, 16, generator=g) * 3
        k[0] *= 20  # a sink-like outlier
        seqs.append((torch.randn(T, 4, 16, generator=g), k, torch.randn(T, 2, 16, generator=g)))
    # Sequence 2 starts at 8 as if its first two blocks came from the prefix cache: its slot
    # holds nothing before position 8 (sinks and window rows there are read dequantised).
    sink_from, window_from = [0, 0, 8], [0, 0, 8]
    d = _Driver(fmt, S, R)
    prefix = seqs[2][1][:8], seqs[2][2][:8]
    d.tables[2] = [d.free.pop(), d.free.pop()]
    pre_slots = torch.tensor([d.tables[2][p // 4] * 4 + p % 4 for p in range(8)])
    d.pool.layers[0].write(prefix[0], prefix[1], pre_slots)
    # Mixed steps: long prefill chunks, short chunks, single-token decodes batched together.
    plan = [
        [(0, 0, 11), (1, 0, 2), (2, 8, 1)],
        [(0, 11, 1), (1, 2, 7), (2, 9, 6)],
        [(0, 12, 1), (1, 9, 1), (2, 15, 1)],
        [(0, 13, 1), (1, 10, 1), (2, 16, 1)],
        [(0, 14, 9), (1, 11, 13), (2, 17, 1)],
        *[[(0, t, 1), (1, t + 1, 1), (2, t - 5, 1)] for t in range(23, 29)],
        [(0, 29, 1), (2, 24, 6)],
    ]
    got: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}, 2: {}}
    for batch in plan:
        for i, (start, rows) in d.step(batch, seqs, sink_from, window_from, scale).items():
            for j in range(rows.shape[0]):
                got[i][start + j] = rows[j]
    for i, (q, k, v) in enumerate(seqs):
        ref = _dense_reference(q, k, v, fmt, S, R, sink_from[i], window_from[i], scale)
        first = 8 if i == 2 else 0
        assert sorted(got[i]) == list(range(first, T)), i
        out = torch.stack([got[i][t] for t in range(first, T)])
        torch.testing.assert_close(out, ref[first:], rtol=1e-5, atol=1e-5)


# -- the engine: prefix cache, copy-on-write, swap and recompute -----------------------------
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day"  # 34 tokens: a partial last block


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_cache_sink_cache_and_forks(stories_path, fmt):
    llm = LLM(str(stories_path), calibrate_preemption=False, kv_cache_dtype=fmt)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    second = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 16
    # The cached blocks hold the very codes the first run wrote, and the sinks come back in full
    # precision from the sink cache, so with no window the continuation is identical.
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    snap = llm.ledger()
    assert snap.sink_cache_hits == 1 and snap.sink_cache_misses == 0
    # n > 1: children fork the parent's blocks (COW on the shared partial block) and its overlay.
    forked = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [first.outputs[0].token_ids] * 3
    snap = llm.ledger()
    assert snap.cow_copies > 0
    assert snap.used_blocks == 0 and snap.overlay_slots_used == 0


def test_forks_copy_the_window_and_the_overlay_grows_past_its_slots(stories_path):
    llm = LLM(str(stories_path), calibrate_preemption=False, kv_cache_dtype="fp8_int8",
              kv_recent_tokens=16, max_num_seqs=1, enable_prefix_caching=False)
    assert llm.ledger().overlay_slots == 5  # max_num_seqs + headroom
    alone = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([PROMPT], SamplingParams(n=8, temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [alone] * 8
    snap = llm.ledger()
    assert snap.overlay_slots == 10 and snap.overlay_bytes == 10 * snap.overlay_bytes_per_request


def _workload(n=12, seed=1):
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(5, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(10, 40), ignore_eos=True)
              for _ in prompts]
    return prompts, params


_REFS: dict = {}


def _reference(stories_path, fmt, recent):
    """Each format's tokens with ample memory and no chunking (cached per module)."""
    key = (fmt, recent)
    if key not in _REFS:
        prompts, params = _workload()
        llm = LLM(str(stories_path), calibrate_preemption=False, kv_cache_dtype=fmt,
                  kv_recent_tokens=recent, block_size=8)
        _REFS[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return _REFS[key]


@pytest.mark.parametrize(
    "fmt,recent,options",
    [
        ("int8", 0, {"preemption_mode": "swap"}),
        ("int8", 0, {"preemption_mode": "recompute"}),
        ("fp8", 0, {"preemption_mode": "swap"}),
        ("fp8", 0, {"preemption_mode": "recompute"}),
        ("fp8_int8", 0, {"preemption_mode": "swap"}),
        ("fp8_int8", 0, {"preemption_mode": "recompute"}),
        ("fp8_int8", 16, {"preemption_mode": "swap"}),
        # With a window, a recompute that resumes from its own cached blocks further back than
        # the ring reaches reads those window rows dequantised (docs/kv_quant.md); from scratch
        # it is exact.
        ("fp8_int8", 16, {"preemption_mode": "recompute", "enable_prefix_caching": False}),
        ("fp8_int8", 16, {"max_num_batched_tokens": 7, "block_size": 4}),  # chunked prefill
    ],
)
def test_preemption_and_chunking_leave_tokens_identical(stories_path, fmt, recent, options):
    prompts, params = _workload()
    ref = _reference(stories_path, fmt, recent)
    tiny = "preemption_mode" in options
    kw = {"block_size": 8, "num_kv_blocks": 12, **options} if tiny else options
    llm = LLM(str(stories_path), calibrate_preemption=False, kv_cache_dtype=fmt,
              kv_recent_tokens=recent, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    snap = llm.ledger()
    if tiny:
        assert snap.preemptions[options["preemption_mode"]] > 0, "the pool was meant to preempt"
    assert snap.used_blocks == 0 and snap.swapped_blocks == 0 and snap.overlay_slots_used == 0


# -- memory: the ledger and real admission ---------------------------------------------------
def test_plan_and_engine_ledger_agree_on_bytes(stories_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "plan", "--model", str(stories_path), "--kv-dtype", "int8",
         "--device-memory", "1GiB", "--context-len", "256", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    snap = LLM(str(stories_path), calibrate_preemption=False, kv_cache_dtype="int8").ledger()
    # stories260k: 5 layers x 4 KV heads x head_dim 8: 2*5*4*8 = 320 B of codes + 2*5*4*2 = 80 B
    # of float16 scales per token; 4 float32 sink tokens = 4 * 1280 B per request.
    assert plan["bytes_per_token"] == snap.bytes_per_token == 400
    assert plan["scale_bytes_per_token"] == snap.scale_bytes_per_token == 80
    assert plan["per_request_overhead_bytes"] == snap.overlay_bytes_per_request == 4 * 1280
    assert snap.overlay_bytes == snap.overlay_slots * snap.overlay_bytes_per_request
    auto = LLM(str(stories_path), calibrate_preemption=False).ledger()
    assert auto.bytes_per_token == 1280 and auto.overlay_bytes == 0


@pytest.fixture(scope="module")
def bf16_hd64_model(tmp_path_factory):
    from transformers import LlamaConfig

    from tests.model_factory import build_hf_model

    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("hd64")
    build_hf_model(cfg, path, dtype=torch.bfloat16)
    return path


def _admitted(path, kv_cache_dtype: str) -> tuple[int, int]:
    """Pool blocks, and how many 1008-token requests the engine's scheduler admits at once into
    16 MiB. Only the scheduling half of a step runs: bfloat16 matmuls are very slow on CPU and
    the forward pass changes nothing about who fits (the generation tests run the rest)."""
    llm = LLM(str(path), dtype="bfloat16", calibrate_preemption=False, kv_cache_memory=16 << 20,
              kv_cache_dtype=kv_cache_dtype, max_num_seqs=64, max_num_batched_tokens=1 << 16)
    eng = llm.engine
    prompt = [1] + [3 + (7 * j) % 94 for j in range(1007)]
    rids = [eng.add_request(prompt, SamplingParams(max_tokens=512, ignore_eos=True, seed=i))
            for i in range(80)]
    # Admission is limited by free blocks alone (token budget and max_num_seqs are ample).
    so = eng.scheduler.schedule()
    running = len(eng.scheduler.running)
    assert len(so.req_ids) == running
    for rid in rids:
        eng.abort_request(rid)
    return llm.ledger().total_blocks, running


def test_int8_pool_holds_1_9x_the_tokens_of_bf16_in_the_same_memory(bf16_hd64_model):
    blocks16, running16 = _admitted(bf16_hd64_model, "auto")
    blocks8, running8 = _admitted(bf16_hd64_model, "int8")
    # 64-dim heads: 128 B of int8 codes + 4 B of scales vs 256 B per token and KV head, i.e.
    # 1.94x, less the overlay (72 slots x 4 sink tokens) and the sink cache out of the budget.
    assert blocks16 == (16 << 20) // (16 * 512)
    assert blocks8 / blocks16 >= 1.9, (blocks8, blocks16)
    assert running16 == 32 and running8 / running16 >= 1.9, (running8, running16)
