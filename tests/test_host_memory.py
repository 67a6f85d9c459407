"""Host memory: the CPU KV pool is mapped lazily unless asked (`kvledger serve` maps it at
start-up), and a CPU engine's steps reuse their activation memory instead of faulting it in."""

import argparse
import ctypes
import os
import subprocess
import sys

import pytest
import torch

from kvledger import LLM
from kvledger.commands import serve
from kvledger.storage import host_memory
from kvledger.storage.kv_cache import KVCachePool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and glibc malloc")


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of t's pages in memory (mincore over exactly its range; the kernel may merge its
    mapping with neighbouring ones, so the mapping's own Rss would count theirs)."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = t.data_ptr() // page * page
    hi = t.data_ptr() + t.numel() * t.element_size()
    n = -(-(hi - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(lo), hi - lo, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) * page


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_populate_maps_every_page_of_the_pool_and_leaves_zeros(fmt):
    pool = KVCachePool(2, 512, 16, 4, 64, torch.float32, kv_cache_dtype=fmt)  # 16 / 4.4 MiB
    assert pool.num_bytes >= 4 << 20
    before = _resident_bytes(pool.data)
    assert before < pool.num_bytes // 2, "a fresh pool is mapped as it is written"
    pool.populate()
    assert _resident_bytes(pool.data) >= pool.num_bytes
    assert not pool.data.any()


def test_an_engine_maps_its_pool_only_when_asked(stories_path):
    kw = dict(kv_cache_memory=64 << 20, max_model_len=256, calibrate_preemption=False)
    lazy = LLM(stories_path, **kw).llm_engine
    eager = LLM(stories_path, populate_kv_cache=True, **kw).llm_engine
    lazy_pool, eager_pool = lazy.executor.worker.kv_pool, eager.executor.worker.kv_pool
    assert _resident_bytes(lazy_pool.data) < lazy_pool.num_bytes // 2
    assert _resident_bytes(eager_pool.data) >= eager_pool.num_bytes


def test_serve_populates_by_default_and_the_flag_turns_it_off():
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).populate_kv_cache is True
    assert parser.parse_args(["serve", "--no-populate-kv-cache"]).populate_kv_cache is False


_STEADY_PREFILL = """
import random, resource, sys
from kvledger import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=64 << 20, max_model_len=256,
          populate_kv_cache=True, calibrate_preemption=False)
random.seed(0)
sp = SamplingParams(max_tokens=1, temperature=0.0)
def step():  # one prefill step of 14 x 146 tokens
    llm.generate([{"prompt_token_ids": [random.randrange(5, 500) for _ in range(146)]}
                  for _ in range(14)], sp, use_tqdm=False)
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_cpu_engine_steps_without_faulting_its_activations_in_again(stories_path):
    """glibc unmaps freed blocks above its mmap threshold, so each step's activations used to be
    page-faulted in again (5,060 minor faults in this step with KVLEDGER_MALLOPT=0, 15 with
    it on, when written); the engine keeps them (host_memory.keep_freed_memory)."""
    env = {k: v for k, v in os.environ.items() if k != "KVLEDGER_MALLOPT"}
    out = subprocess.run(
        [sys.executable, "-c", _STEADY_PREFILL, str(stories_path)],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    faults = int(out.stdout.split()[-1])
    assert faults < 1000, f"{faults} page faults in a steady prefill step"


def _advised_huge(*tensors: torch.Tensor) -> list[bool]:
    """Whether the mapping holding each tensor's first byte is advised MADV_HUGEPAGE (smaps'
    VmFlags "hg")."""
    maps, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                cur = [lo, hi, False]
                maps.append(cur)
            elif head == "VmFlags:":
                cur[2] = "hg" in line.split()[1:]
    return [any(lo <= t.data_ptr() < hi and hg for lo, hi, hg in maps) for t in tensors]


thp = pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="no THP in this kernel")


@thp
def test_small_weights_are_carved_one_after_another_from_huge_page_memory():
    a = host_memory.weight_zeros((1000,), torch.uint8)
    b = host_memory.weight_zeros((300, 7), torch.float32)
    assert not a.any() and not b.any()
    assert b.data_ptr() % 64 == 0 and b.data_ptr() >= a.data_ptr() + 1000, "aligned, after a"
    big = host_memory.weight_zeros((3 << 20,), torch.uint8)  # its own mapping, as zeros()
    assert big.data_ptr() % host_memory.HUGE_PAGE == 0
    assert _advised_huge(a, b, big) == [True, True, True]
    assert _advised_huge(host_memory.zeros((1000,), torch.uint8)) == [False], "zeros() keeps small ones on the heap"


@thp
def test_a_weight_that_does_not_fit_the_chunk_starts_a_new_one():
    size = 3 << 19  # 1.5 MiB: 21 fit a 32 MiB chunk
    ws = [host_memory.weight_zeros((size,), torch.uint8) for _ in range(host_memory.WEIGHT_CHUNK // size + 2)]
    spans = sorted((w.data_ptr(), w.data_ptr() + size) for w in ws)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), "no two overlap"
    assert any(w.data_ptr() % host_memory.HUGE_PAGE == 0 for w in ws[1:]), "more than a chunk: a new one, 2 MiB-aligned"
    ws[-1].fill_(1)
    assert not ws[-2].any()


@thp
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_every_weight_a_decode_step_streams_is_in_huge_page_memory(stories_path, quantization):
    """stories260k's projections are a few KiB to 100 KiB: without the shared chunks each would
    sit on 4 KiB pages (host_memory.weight_zeros)."""
    from kvledger.model.quant_int8 import Int8Weight
    from kvledger.model.quant_q4 import Q4Weight

    llm = LLM(stories_path, dtype="bfloat16", quantization=quantization, kv_cache_memory=16 << 20,
              calibrate_preemption=False)  # fmt: skip
    streamed = []
    for m in llm.llm_engine.executor.worker.runner.model.modules():
        q = getattr(m, "quant", None)
        if isinstance(q, Q4Weight):
            streamed += [q.q, q.scale]
        elif isinstance(q, Int8Weight):
            streamed.append(q.q)
        if getattr(m, "small", None) is not None:
            streamed.append(m.small.data)
    assert len(streamed) >= 14
    assert all(_advised_huge(*streamed))


_LOAD_THEN_TRIM = """
import ctypes, sys
from kvledger import LLM
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
llm = LLM(sys.argv[1], dtype="bfloat16", quantization="int4", kv_cache_memory=8 << 20, calibrate_preemption=False)
before = rss()
ctypes.CDLL(None).malloc_trim(0)
print(before - rss())
"""


def test_a_model_loaded_and_quantised_leaves_no_freed_memory_in_the_heap(tmp_path):
    """Loading a 27 MB checkpoint and quantising it frees its float tensors, but glibc (with
    keep_freed_memory's thresholds) keeps them in the heap: the worker returns them once the model
    is loaded (host_memory.return_freed_memory), so a trim afterwards finds little to give back."""
    from transformers import LlamaConfig

    from tests.model_factory import build_hf_model

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)  # fmt: skip
    build_hf_model(config, tmp_path, dtype=torch.bfloat16)
    out = subprocess.run([sys.executable, "-c", _LOAD_THEN_TRIM, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    returned = int(out.stdout.split()[-1])
    assert returned < 4 << 20, f"{returned / 2**20:.1f} MiB of freed memory was still resident after the load"
