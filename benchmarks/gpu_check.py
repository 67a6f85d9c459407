"""One command for a GPU when one is lent (issue 19): are the Triton kernels right there, does the
engine agree with HF, and how close to the roofline do decode and prefill run.

    python benchmarks/gpu_check.py              # one CUDA GPU, finishes in < 8 minutes
    python benchmarks/gpu_check.py --dry-run    # CPU, Triton interpreter, tiny shapes: it runs

Needs only torch, triton and transformers (plus this repository). Four parts:

1. kernels vs the torch reference backend on the device: head_dim 64/128/256, block sizes 16/32,
   GQA/MQA, ragged prefix hits, fp16/bf16, int8/fp8 KV (with sinks + recent window), split-K;
2. kvledger (attention_backend="triton", bf16) vs HF transformers greedy on the same weights:
   stories260k when ../shared holds it, and a random-weight GQA Llama; prints agreement;
3. a random-weight ~1B Llama (16 x 2048, GQA 32/8, head_dim 64, intermediate 8192, vocab 32000,
   bf16): decode steps at batch 1, 64 and 256 over 1k-token contexts (CUDA graphs), and prefill of
   2k-token prompts, as fractions of the roofline -- HBM bandwidth for decode (bytes = weights
   read + KV read), bf16 dense peak for prefill (FLOPs = 2 x params x tokens + causal attention) --
   printing every figure it computes them from;
4. the price of indirection on the Triton path (issue 21, claim 6; benchmarks/seed_paging.py does
   the native and torch paths): the paged decode kernel alone, one Llama-3-8B attention layer
   (32 query / 8 KV heads of 128, bf16), contexts 256/1024/4096/8192, block sizes 1/16/32/128,
   batch 1 and 64, with (a) each request's blocks scattered at random through a 512k-token pool
   and (b) an identity block table over consecutive blocks holding the same K/V (the table lookup
   is then the only difference from a contiguous layout), plus torch SDPA over a contiguous
   [batch, KV heads, context, 128] copy as a reference. Each timed call is a CUDA graph of up to
   256 launches over disjoint pool regions (no L2-resident re-reads, no launch overhead), best of
   3 interleaved rounds; (a) and (b) must give the same output (and SDPA within bf16 tolerance).
   Prints every configuration's ratios and the median scattered/identity ratio per block size.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Spec-sheet figures (dense bf16 tensor FLOP/s, HBM bytes/s) by device-name fragment, most
# specific first.
ROOFLINES = [
    ("H200", 989e12, 4.8e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
    ("A100-SXM4-80GB", 312e12, 2.039e12),
    ("A100 80GB PCIe", 312e12, 1.935e12),
    ("A100", 312e12, 1.555e12),
    ("L40S", 362e12, 0.864e12),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels,hf,perf,paging")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    sys.path.insert(0, str(REPO))
    import torch
    import triton

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine")
        return 2
    dev = torch.device("cpu" if dry else "cuda")
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    _header(dev, torch, triton)
    ok = True
    if "kernels" not in skip:
        ok &= check_kernels(dev, dry)
    if "hf" not in skip:
        ok &= check_hf(dev, dry)
    if "perf" not in skip:
        perf(dev, dry)
    if "paging" not in skip:
        ok &= paging_cost(dev, dry)
    print(f"\n== done in {time.perf_counter() - t0:.1f} s: {'ALL CHECKS PASSED' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


def _header(dev, torch, triton) -> None:
    import platform

    print("== kvledger gpu_check")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}")
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
    else:
        model = platform.processor() or "cpu"
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        print(f"device: CPU ({model}), Triton interpreter (dry run: shapes are tiny, timings meaningless)")


# -- 1. kernels ---------------------------------------------------------------------------------
def _twin_step(dev, dtype, kv_dtype, heads, kvh, d, bs, reqs, S=0, R=0, seed=0):
    """Two identical pools with the same cached prefixes; the step's metadata and q/k/v."""
    import random

    import torch

    from kvledger.model.attention.metadata import AttentionMetadata
    from kvledger.storage.kv_cache import KVCachePool

    num_blocks = sum(-(-(c + n) // bs) for c, n in reqs) + 2
    slots_ov = len(reqs) if (S or R) else 0
    pools = [
        KVCachePool(1, num_blocks, bs, kvh, d, dtype, device=dev, kv_cache_dtype=kv_dtype,
                    sink_tokens=S, recent_tokens=R, overlay_slots=slots_ov)
        for _ in range(2)
    ]  # fmt: skip
    rng = random.Random(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, qsl = [], [], [0]
    for cached, new in reqs:
        table = [free.pop() for _ in range(-(-(cached + new) // bs))]
        tables.append(table)
        tt = torch.tensor(table, device=dev)
        if cached:
            pos = torch.arange(cached, device=dev)
            k, v = rnd(cached, kvh, d), rnd(cached, kvh, d)
            for p in pools:
                p.layers[0].write(k, v, tt[pos // bs] * bs + pos % bs)
        pos = torch.arange(cached, cached + new, device=dev)
        slots.append(tt[pos // bs] * bs + pos % bs)
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, device=dev),
        seq_lens=torch.tensor([c + n for c, n in reqs], device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
        block_size=bs,
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(c + n for c, n in reqs),
        query_lens_list=[n for _, n in reqs],
        seq_lens_list=[c + n for c, n in reqs],
    )
    if slots_ov:
        ov = rnd(*pools[0].overlay.shape)
        for p in pools:
            p.overlay.copy_(ov)
        meta.overlay_slots = list(range(len(reqs)))
        meta.overlay_sink_from = [0] * len(reqs)
        meta.overlay_window_from = [max(0, c - R // 2) for c, _ in reqs]
    t = qsl[-1]
    return pools, meta, rnd(t, heads, d), rnd(t, kvh, d), rnd(t, kvh, d)


def check_kernels(dev, dry: bool) -> bool:
    import torch

    from kvledger.model.attention.torch_backend import TorchAttentionBackend
    from kvledger.model.attention.triton_backend import TritonAttentionBackend

    print("\n== 1. Triton kernels vs the torch reference backend (same pools, same step)")
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    if dry:
        cases = [
            ("decode gqa d16 bs16", f32, "auto", 4, 2, 16, 16, [(20, 1), (3, 1)], 0, 0, 2),
            ("prefill+prefix mqa", f32, "auto", 4, 1, 16, 16, [(16, 5), (0, 7)], 0, 0, 1),
            ("int8 + sinks/window", f32, "int8", 4, 2, 16, 16, [(10, 4), (20, 1)], 2, 3, 1),
        ]
    else:
        long = [(1000, 1), (37, 1), (511, 1), (2047, 1)]
        mixed = [(0, 300), (129, 77), (1024, 1), (15, 1), (64, 200)]
        cases = []
        for d in (64, 128, 256):
            for bs in (16, 32):
                cases.append((f"decode d{d} bs{bs} gqa4 bf16 split", bf16, "auto", 16, 4, d, bs, long, 0, 0, 8))
                cases.append((f"mixed d{d} bs{bs} gqa4 bf16", bf16, "auto", 16, 4, d, bs, mixed, 0, 0, 1))
        cases += [
            ("mixed d128 mqa fp16", f16, "auto", 8, 1, 128, 16, mixed, 0, 0, 1),
            ("decode d128 mha fp16 split", f16, "auto", 8, 8, 128, 16, long, 0, 0, 4),
            ("mixed d64 fp32 (ieee)", f32, "auto", 8, 2, 64, 16, mixed, 0, 0, 1),
            ("int8 mixed d128 S4 R32", bf16, "int8", 16, 4, 128, 16, mixed, 4, 32, 1),
            ("fp8 mixed d128 S4 R0", bf16, "fp8", 16, 4, 128, 16, mixed, 4, 0, 1),
            ("fp8_int8 decode d128 split", bf16, "fp8_int8", 16, 4, 128, 16, long, 4, 16, 4),
        ]
    all_ok = True
    for name, dtype, kvd, h, kvh, d, bs, reqs, S, R, splits in cases:
        pools, meta, q, k, v = _twin_step(dev, dtype, kvd, h, kvh, d, bs, reqs, S, R, seed=len(name))
        scale = d**-0.5
        ref = TorchAttentionBackend().forward(q, k, v, pools[0].layers[0], meta, scale)
        tri = TritonAttentionBackend()
        tri.fixed_num_splits = splits
        out = tri.forward(q, k, v, pools[1].layers[0], meta, scale)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        err = (out.float() - ref.float()).abs().max().item()
        tol = {f32: 1e-3, f16: 4e-3, bf16: 3e-2}[dtype]
        same = pools[0].data.ne(pools[1].data).sum().item()
        ok = err <= tol and same == 0
        all_ok &= ok
        print(f"  {'ok  ' if ok else 'FAIL'} {name:34s} max|err| {err:.2e} (tol {tol:g}), "
              f"pool bytes differing: {same}")  # fmt: skip
    return all_ok


# -- 2. HF agreement ----------------------------------------------------------------------------
def check_hf(dev, dry: bool) -> bool:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from kvledger import LLM, SamplingParams

    print("\n== 2. kvledger (triton) vs HF transformers greedy, same weights")
    folders = []
    for root in (REPO.parent / "shared", REPO / "shared"):
        if (root / "models/stories260k/config.json").exists():
            folders.append(("stories260k", root / "models/stories260k"))
            break
    tmp = tempfile.TemporaryDirectory()
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64 if dry else 512, intermediate_size=128 if dry else 1536,
        num_hidden_layers=2 if dry else 4, num_attention_heads=4 if dry else 8,
        num_key_value_heads=2, head_dim=16 if dry else 64, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp.name)
    folders.append(("random GQA llama", Path(tmp.name)))
    dtypes = [torch.float32] if dry else [torch.bfloat16, torch.float32]
    n_new = 4 if dry else 32
    prompts = [list(range(3, 3 + (9 if dry else 40))), [5, 17, 33, 2, 9, 100, 7]]
    ok = True
    for label, folder in folders:
        for dtype in dtypes:
            name = str(dtype).replace("torch.", "")
            hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(dev).eval()
            llm = LLM(str(folder), device=dev.type, dtype=name, attention_backend="triton",
                      num_kv_blocks=64, calibrate_preemption=False)  # fmt: skip
            sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            agree = total = 0
            for p, o in zip(prompts, outs):
                with torch.no_grad():
                    ref = hf.generate(torch.tensor([p], device=dev), max_new_tokens=n_new,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
                ref = ref[0, len(p):].tolist()
                got = o.outputs[0].token_ids
                prefix = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
                agree += prefix
                total += len(ref)
            frac = agree / total
            # float32 must agree exactly; bf16 may diverge after a near-tie (reported, not failed).
            exact = dtype == torch.float32
            good = frac == 1.0 or not exact
            ok &= good
            print(f"  {'ok  ' if good else 'FAIL'} {label:18s} {name:9s} greedy tokens agreeing "
                  f"(common prefix): {agree}/{total} = {frac:.1%}")  # fmt: skip
            del llm, hf
    tmp.cleanup()
    return ok


# -- 3. roofline --------------------------------------------------------------------------------
def _build_model(dev, dry: bool):
    import torch

    from kvledger.hf.config import ModelConfig
    from kvledger.model.llama import LlamaForCausalLM

    if dry:
        cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, None, 256, False)
    else:
        cfg = ModelConfig("LlamaForCausalLM", 32000, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, None, 4096, False)
    dtype = torch.float32 if dry else torch.bfloat16
    with torch.device(dev):
        model = LlamaForCausalLM(cfg, rope_device=dev)
    model = model.to(dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=g)
    return model.eval(), cfg, dtype


def _time(fn, dev, iters: int) -> float:
    import torch

    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def perf(dev, dry: bool) -> None:
    import torch

    from kvledger.model.attention.metadata import AttentionMetadata
    from kvledger.model.attention.triton_backend import TritonAttentionBackend
    from kvledger.storage.kv_cache import KVCachePool

    print("\n== 3. random-weight Llama: decode vs HBM roofline, prefill vs bf16 peak")
    model, cfg, dtype = _build_model(dev, dry)
    model.attn_backend = TritonAttentionBackend()
    esize = torch.finfo(dtype).bits // 8
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    print(f"model: {cfg.num_layers} layers x {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, "
          f"head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
          f"{n_params / 1e6:.2f} M params, {dtype}")  # fmt: skip
    if dev.type == "cuda":
        name = torch.cuda.get_device_properties(dev).name
        spec = next(((f, b) for frag, f, b in ROOFLINES if frag in name), None)
        bw_meas, flops_meas = _measure_device(torch, dev)
        if spec is None:
            peak, bw, src = flops_meas, bw_meas, "measured (device not in the spec table)"
        else:
            peak, bw, src = spec[0], spec[1], f"spec sheet for {name}"
        print(f"roofline inputs ({src}): HBM {bw / 1e12:.2f} TB/s, bf16 dense {peak / 1e12:.0f} TFLOP/s; "
              f"measured here: copy {bw_meas / 1e12:.2f} TB/s, bf16 GEMM {flops_meas / 1e12:.0f} TFLOP/s")  # fmt: skip
    else:
        peak = bw = None
    bs = 16
    kv_tok = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * esize  # KV bytes per token
    weight_bytes = (n_params - embed) * esize  # every matmul weight is read once per step
    ctx = 20 if dry else 1024
    batches = (1, 2) if dry else (1, 64, 256)
    iters = 1 if dry else 20  # dry: every path once (the interpreter is slow; timings meaningless)
    max_b = max(batches)
    blocks_per = -(-(ctx + 1) // bs)
    pool = KVCachePool(cfg.num_layers, max_b * blocks_per + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype, device=dev)
    pool.data.normal_(0.0, 1.0)
    for b in batches:
        meta, ids, pos = _decode_meta(torch, AttentionMetadata, dev, b, ctx, bs, blocks_per)
        step = _decode_step(torch, model, pool, meta, ids, pos, dev, dry)
        t = _time(step, dev, iters)
        nbytes = weight_bytes + b * ctx * kv_tok
        line = (f"  decode batch {b:3d}, context {ctx}: {t * 1e3:8.3f} ms/step, {b / t:9.0f} tok/s; "
                f"bytes/step {nbytes / 1e9:.3f} GB (weights {weight_bytes / 1e9:.3f} + KV {b * ctx * kv_tok / 1e9:.3f})")  # fmt: skip
        if bw:
            line += f" -> {nbytes / t / 1e9:.0f} GB/s = {nbytes / t / bw:.1%} of HBM roofline"
            if b == 64:
                line += f" (issue 19 target: >= 70%: {'met' if nbytes / t / bw >= 0.7 else 'NOT met'})"
        print(line)
    # Prefill: a few 2k-token prompts in one step (logits for each prompt's last token).
    plen, nprompts = (16, 2) if dry else (2048, 4)
    meta, ids, pos = _prefill_meta(torch, AttentionMetadata, dev, nprompts, plen, bs)
    pool2 = KVCachePool(cfg.num_layers, nprompts * (-(-plen // bs)) + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype, device=dev)
    last = torch.arange(1, nprompts + 1, device=dev) * plen - 1

    def prefill():
        h = model(ids, pos, meta, pool2.layers)
        return model.compute_logits(h[last])

    t = _time(prefill, dev, 1 if dry else 5)
    tokens = nprompts * plen
    layer_params = n_params - embed - cfg.vocab_size * cfg.hidden_size  # lm_head counted apart
    attn = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * nprompts * plen * (plen + 1) / 2
    flops = 2 * layer_params * tokens + 2 * cfg.vocab_size * cfg.hidden_size * nprompts + attn
    line = (f"  prefill {nprompts} x {plen} tokens: {t * 1e3:8.2f} ms, {tokens / t:9.0f} tok/s; "
            f"FLOPs {flops / 1e12:.2f} T (matmuls {2 * layer_params * tokens / 1e12:.2f} + causal attention {attn / 1e12:.2f})")  # fmt: skip
    if peak:
        line += f" -> {flops / t / 1e12:.0f} TFLOP/s = {flops / t / peak:.1%} of bf16 peak"
        line += f" (issue 19 target: >= 50%: {'met' if flops / t / peak >= 0.5 else 'NOT met'})"
    print(line)


def _measure_device(torch, dev) -> tuple[float, float]:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), dev, 10)
    bw = 2 * x.numel() / t  # read + write
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    t = _time(lambda: a @ a, dev, 10)
    return bw, 2 * 8192**3 / t


def _decode_meta(torch, AttentionMetadata, dev, b, ctx, bs, blocks_per):
    """b requests, each with ctx cached tokens, decoding token ctx; request i owns blocks
    1 + i * blocks_per ...; block 0 is the padding block."""
    tables = 1 + torch.arange(b * blocks_per, device=dev).view(b, blocks_per)
    pos = torch.full((b,), ctx, dtype=torch.int64, device=dev)
    slot = tables[:, ctx // bs] * bs + ctx % bs
    meta = AttentionMetadata(
        slot_mapping=slot,
        query_start_loc=torch.arange(b + 1, device=dev),
        seq_lens=pos + 1,
        block_tables=tables,
        block_size=bs,
        max_query_len=1,
        max_seq_len=ctx + 1,
        query_lens_list=[1] * b,
        seq_lens_list=[ctx + 1] * b,
    )
    ids = torch.randint(3, 200, (b,), device=dev)
    return meta, ids, pos


def _prefill_meta(torch, AttentionMetadata, dev, n, plen, bs):
    per = -(-plen // bs)
    tables = 1 + torch.arange(n * per, device=dev).view(n, per)
    p = torch.arange(plen, device=dev)
    slot = (tables[:, p // bs] * bs + p % bs).reshape(-1)
    meta = AttentionMetadata(
        slot_mapping=slot,
        query_start_loc=torch.arange(n + 1, device=dev) * plen,
        seq_lens=torch.full((n,), plen, device=dev),
        block_tables=tables,
        block_size=bs,
        max_query_len=plen,
        max_seq_len=plen,
        query_lens_list=[plen] * n,
        seq_lens_list=[plen] * n,
    )
    ids = torch.randint(3, 200, (n * plen,), device=dev)
    return meta, ids, p.repeat(n)


def _decode_step(torch, model, pool, meta, ids, pos, dev, dry):
    """One decode step (forward + logits), replayed from a CUDA graph on a GPU."""

    def step():
        h = model(ids, pos, meta, pool.layers)
        return model.compute_logits(h)

    if dev.type != "cuda":
        return step
    from kvledger.worker.cuda_graphs import capture

    graph = capture(step, dev)
    return graph.replay


# -- 4. the price of indirection (issue 21, claim 6) --------------------------------------------
def paging_cost(dev, dry: bool) -> bool:
    """Triton paged decode over scattered blocks vs the same kernel over an identity table on
    consecutive blocks holding the same K/V, and SDPA over a contiguous copy; see the docstring."""
    import statistics

    import torch

    from kvledger.model.attention import triton_kernels as kern

    print("\n== 4. price of indirection: Triton paged decode, scattered blocks vs identity table "
          "(same K/V) vs SDPA on a contiguous buffer")  # fmt: skip
    if dry:
        heads, kvh, d, dtype = 4, 2, 16, torch.float32
        contexts, batches, block_sizes, max_rot, iters, rounds = (128,), (1, 2), (1, 16, 32, 128), 1, 1, 1
        num_sms = 4
    else:
        heads, kvh, d, dtype = 32, 8, 128, torch.bfloat16
        contexts, batches, block_sizes = (256, 1024, 4096, 8192), (1, 64), (1, 16, 32, 128)
        max_rot, iters, rounds = 256, 5, 3
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    total = max(batches) * max(contexts)  # pool tokens: the largest step fills it once
    g = torch.Generator(device=dev).manual_seed(0)
    # The identity-layout pool: flat [tokens, KV heads, d], viewed as [blocks, bs, ...] per bs.
    k1 = torch.randn(total, kvh, d, generator=g, device=dev).to(dtype)
    v1 = torch.randn(total, kvh, d, generator=g, device=dev).to(dtype)
    k2, v2 = torch.empty_like(k1), torch.empty_like(v1)  # the scattered twin, filled per bs
    scale = d**-0.5
    print(f"one layer, {heads} query / {kvh} KV heads x {d}, {str(dtype).replace('torch.', '')}, pool {total} "
          f"tokens ({2 * k1.numel() * k1.element_size() / 2**30:.2f} GiB K+V per layout); ms per decode "
          f"call, best of {rounds} interleaved rounds; rot = calls per timed graph (disjoint regions)")  # fmt: skip
    print(f"  {'batch':>5} {'ctx':>5} {'bs':>4} {'splits':>6} {'rot':>4} | {'scattered':>9} {'identity':>9} "
          f"{'SDPA':>9} | {'scat/ident':>10} {'ident/SDPA':>10} {'scat/SDPA':>9} | max|a-b|  max|b-SDPA|")  # fmt: skip
    rows, ok = [], True
    for b in batches:
        q_all = torch.randn(max_rot, b, heads, d, generator=g, device=dev).to(dtype)
        qsl = torch.arange(b + 1, device=dev)
        dummy = torch.zeros(b, kvh, d, dtype=dtype, device=dev)  # the step's k/v: read only with an overlay
        for ctx in contexts:
            rot = max(1, min(max_rot, total // (b * ctx)))  # one disjoint pool region per call
            lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
            splits = kern.choose_num_splits(b, kvh, ctx, num_sms)  # as the backend picks it
            # SDPA's contiguous buffer [requests, KV heads, ctx, d]: request i = tokens i*ctx... of (b).
            kc = k1.view(total // ctx, ctx, kvh, d).transpose(1, 2).contiguous()
            vc = v1.view(total // ctx, ctx, kvh, d).transpose(1, 2).contiguous()
            sdpa_args = [(q_all[r], kc[r * b : (r + 1) * b], vc[r * b : (r + 1) * b], scale) for r in range(rot)]
            t_sdpa = None
            for bs in block_sizes:
                nblocks, mb = total // bs, ctx // bs
                perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(7 * bs + ctx)).to(dev)
                k2.view(nblocks, -1)[perm] = k1.view(nblocks, -1)  # block j of (b) is block perm[j] of (a)
                v2.view(nblocks, -1)[perm] = v1.view(nblocks, -1)
                ident = [torch.arange(r * b * mb, (r + 1) * b * mb, device=dev).view(b, mb) for r in range(rot)]
                c1 = kern.CacheView(k1, v1, None, None, 0, 0, bs)
                c2 = kern.CacheView(k2, v2, None, None, 0, 0, bs)
                calls = {
                    name: [(q_all[r], dummy, dummy, cache, qsl, lens, tables[r], scale, 1, splits) for r in range(rot)]
                    for name, cache, tables in (("scattered", c2, [perm[t] for t in ident]), ("identity", c1, ident))
                }  # fmt: skip
                if t_sdpa is None:
                    calls["sdpa"] = sdpa_args
                best = {k: float("inf") for k in calls}
                for _ in range(rounds):
                    for k, args in calls.items():
                        fn = _sdpa_decode if k == "sdpa" else _paged_decode
                        best[k] = min(best[k], _time_calls(fn, args, dev, iters))
                t_sdpa = best.get("sdpa", t_sdpa)
                a = _paged_decode(*calls["scattered"][-1]).float()
                ref = _paged_decode(*calls["identity"][-1]).float()
                err_ab = (a - ref).abs().max().item()
                err_sdpa = (ref - _sdpa_decode(*sdpa_args[-1]).float()).abs().max().item()
                good = err_ab <= tol and err_sdpa <= tol
                ok &= good
                row = dict(b=b, ctx=ctx, bs=bs, scat=best["scattered"], ident=best["identity"], sdpa=t_sdpa)
                rows.append(row)
                print(f"  {b:5d} {ctx:5d} {bs:4d} {splits:6d} {rot:4d} | {row['scat'] * 1e3:9.4f} "
                      f"{row['ident'] * 1e3:9.4f} {t_sdpa * 1e3:9.4f} | {row['scat'] / row['ident']:10.3f} "
                      f"{row['ident'] / t_sdpa:10.3f} {row['scat'] / t_sdpa:9.3f} | {err_ab:.1e}   {err_sdpa:.1e}"
                      f"{'' if good else f'  FAIL (tol {tol:g})'}")  # fmt: skip
            del kc, vc, sdpa_args
    print("  median by block size (all contexts, both batches): "
          + "; ".join(
              f"bs {bs}: scattered/identity "
              f"{statistics.median([r['scat'] / r['ident'] for r in rows if r['bs'] == bs]):.3f}x, "
              f"identity/SDPA {statistics.median([r['ident'] / r['sdpa'] for r in rows if r['bs'] == bs]):.3f}x"
              for bs in block_sizes
          ))  # fmt: skip
    sr = [r["scat"] / r["ident"] for r in rows]
    print(f"  scattered/identity (paged/contiguous, same kernel) over all {len(rows)} configurations: "
          f"{min(sr):.3f}-{max(sr):.3f}x (median {statistics.median(sr):.3f}x); outputs of (a) and (b) "
          f"{'equal' if ok else 'NOT equal'} within {tol:g}, SDPA within {tol:g} of (b)")  # fmt: skip
    return ok


def _paged_decode(q, k, v, cache, qsl, lens, table, scale, max_query_len, splits):
    from kvledger.model.attention import triton_kernels as kern

    return kern.paged_attention(q, k, v, cache, qsl, lens, table, scale, max_query_len, num_splits=splits)


def _sdpa_decode(q, kc, vc, scale):
    """q [b, H, d] over contiguous kc/vc [b, KV heads, ctx, d] -> [b, H * d]."""
    import torch.nn.functional as F

    b, heads, d = q.shape
    try:
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa
        rep = heads // kc.shape[1]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc.repeat_interleave(rep, 1), vc.repeat_interleave(rep, 1), scale=scale
        )
    return o.reshape(b, heads * d)


def _time_calls(fn, arg_list, dev, iters: int) -> float:
    """Seconds per call of fn over arg_list (one call per entry, in turn); on a GPU the calls
    are captured in one CUDA graph (no launch overhead) and replayed, timed by _time's events."""

    def run():
        for args in arg_list:
            out = fn(*args)
        return out

    if dev.type == "cuda":
        from kvledger.worker.cuda_graphs import capture

        graph = capture(run, dev)
        t = _time(graph.replay, dev, iters)
        del graph
    else:
        t = _time(run, dev, iters)
    return t / len(arg_list)


if __name__ == "__main__":
    raise SystemExit(main())
