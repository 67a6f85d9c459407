"""The tiered prefix cache (issue 44): blocks the device pool evicts are kept in host memory and
on disk, loaded back exactly, and survive a restart; every fault is a miss, never wrong output.

The device pool is 12 blocks of 16 tokens, and each prompt is 101 tokens (6 full blocks), so
running six prompts one after another evicts every earlier prompt's blocks: a second pass can
only hit the lower tiers. Outputs are compared with an engine without tiers (greedy, float32:
the same tokens), and ``num_cached_tokens`` says where the prefix came from.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.cache import kv_block_file
from kvledger.cache.block_hash import hash_request_blocks
from kvledger.errors import ConfigError
from kvledger.llm import LLM
from kvledger.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FULL = 96  # a 101-token prompt's full blocks: what a tier hit can serve


def _prompts(n: int = 6, length: int = 101, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def _llm(path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 12)
    return LLM(str(path), block_size=16, calibrate_preemption=False, **kw)


def _run(llm: LLM, prompts, salt: str | None = None) -> tuple[list[list[int]], list[int]]:
    """One prompt at a time (so each pass evicts the previous prompts): tokens, cached tokens."""
    toks, cached = [], []
    for p in prompts:
        item = {"prompt_token_ids": p} if salt is None else {"prompt_token_ids": p, "cache_salt": salt}
        (o,) = llm.generate([item], GREEDY)
        toks.append(list(o.outputs[0].token_ids))
        cached.append(o.num_cached_tokens)
    return toks, cached


def _wait_files(directory: str, n: int, timeout: float = 20.0) -> list[str]:
    d = os.path.join(directory, "rank0")
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(f for f in os.listdir(d) if f.endswith(kv_block_file.SUFFIX))
        if len(files) >= n or time.monotonic() > deadline:
            return [os.path.join(d, f) for f in files]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def baseline(stories_path):
    """Tokens without any tier (and proof that the small pool alone never hits)."""
    llm = _llm(stories_path)
    toks, cached = _run(llm, _prompts() * 2)
    assert cached == [0] * 12
    return toks[:6]


def test_host_then_disk_after_restart_exact(stories_path, baseline, tmp_path):
    """Second pass from the host tier, then a new engine over the same directory from disk:
    the same tokens as recomputing, and the prefix counted as cached."""
    prompts = _prompts()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path), kv_offload_host_bytes="1MiB")
    toks, cached = _run(llm, prompts * 2)
    assert toks == baseline * 2
    assert cached == [0] * 6 + [FULL] * 6
    tiers = llm.engine.kv.tiers
    assert (tiers.hits["host"], tiers.hits["disk"]) == (36, 0)
    led = llm.engine.ledger()
    assert led.tiers["host"]["hits"] == 36 and led.tiers["disk"]["capacity_blocks"] > 0
    from kvledger.ledger.frame import totals

    assert totals(led, 512, 0)["tiers"] == led.tiers  # what the dashboard's tier cards read
    llm.engine.shutdown()  # flushes the device's cached blocks to disk and saves the index
    assert os.path.exists(os.path.join(tiers.spec.directory, kv_block_file.INDEX))

    again = _llm(stories_path, kv_offload_dir=str(tmp_path))  # no host tier: disk only
    assert not again.engine.kv.tiers.index_rebuilt
    toks, cached = _run(again, prompts)
    assert toks == baseline and cached == [FULL] * 6
    assert again.engine.kv.tiers.hits["disk"] == 36
    again.engine.shutdown()

    os.unlink(os.path.join(tiers.spec.directory, kv_block_file.INDEX))  # lost: rebuilt by a scan
    third = _llm(stories_path, kv_offload_dir=str(tmp_path))
    assert third.engine.kv.tiers.index_rebuilt
    toks, cached = _run(third, prompts[:2])
    assert toks == baseline[:2] and cached == [FULL] * 2


def test_int8_kv_chunked_prefill_random_model_exact(tmp_path_factory):
    """Quantised blocks (int8 codes + fp16 scales) round-trip through host and disk bit for bit:
    a random-weight model with int8 KV and 32-token prefill chunks gives the same tokens with
    its prefix loaded from a tier as recomputed."""
    from tests.model_factory import build_hf_model, tiny_config

    path = tmp_path_factory.mktemp("gqa")
    build_hf_model(tiny_config("llama_gqa"), path)
    kw = dict(kv_cache_dtype="int8", kv_sink_tokens=0, max_num_batched_tokens=32)
    prompts = _prompts(vocab=97, seed=1)
    base, cached = _run(_llm(path, **kw), prompts)
    assert cached == [0] * 6
    d = tmp_path_factory.mktemp("tiers")
    llm = _llm(path, kv_offload_dir=str(d), kv_offload_host_bytes=1 << 20, **kw)
    toks, cached = _run(llm, prompts * 2)
    assert toks == base * 2 and cached == [0] * 6 + [FULL] * 6
    llm.engine.shutdown()
    toks, cached = _run(_llm(path, kv_offload_dir=str(d), **kw), prompts)
    assert toks == base and cached == [FULL] * 6


def test_cache_salt_isolates_tenants_in_every_tier(stories_path, baseline, tmp_path):
    """A salted prompt's blocks are never served to another salt or to no salt, from the
    device, the host or the disk; the same salt hits."""
    prompts = _prompts()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path), kv_offload_host_bytes="1MiB")
    toks, cached = _run(llm, prompts, salt="tenant-a")
    assert toks == baseline and cached == [0] * 6
    for salt in (None, "tenant-b"):
        toks, cached = _run(llm, prompts, salt=salt)
        assert toks == baseline and cached == [0] * 6, salt
    toks, cached = _run(llm, prompts, salt="tenant-a")  # evicted to the tiers meanwhile
    assert toks == baseline and cached == [FULL] * 6
    llm.engine.shutdown()
    again = _llm(stories_path, kv_offload_dir=str(tmp_path))
    assert _run(again, prompts[:2], salt="tenant-c")[1] == [0, 0]
    assert _run(again, prompts[:2], salt="tenant-a")[1] == [FULL, FULL]


def test_corrupt_truncated_and_deleted_files_are_misses_logged_once(stories_path, baseline, tmp_path, caplog):
    """Files damaged under a running engine (a flipped payload byte, a truncated file, a
    deleted one) are recomputed, one warning per kind of damage."""
    prompts = _prompts()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path))  # disk only
    _run(llm, prompts)
    # prompts 1-4 at least were evicted by the later ones: wait for every one of their blocks (the
    # writer thread may still be behind, on a busy machine)
    evicted = {h for p in prompts[:4] for h in hash_request_blocks(p, 16)}
    deadline = time.monotonic() + 20.0
    while True:
        files = _wait_files(llm.engine.kv.tiers.spec.directory, 24)
        by_hash = {int(os.path.basename(f).split(".")[0], 16): f for f in files}
        if evicted <= by_hash.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert evicted <= by_hash.keys()
    first_blocks = [hash_request_blocks(p, 16)[0] for p in prompts[:3]]
    flip, cut, gone = (by_hash[h] for h in first_blocks)
    data = bytearray(Path(flip).read_bytes())
    data[-5] ^= 0xFF
    Path(flip).write_bytes(bytes(data))
    Path(cut).write_bytes(Path(cut).read_bytes()[:-100])
    os.unlink(gone)
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        toks, cached = _run(llm, prompts)
        toks2, cached2 = _run(llm, prompts[:3])
    assert toks == baseline and toks2 == baseline[:3]
    assert cached == [0, 0, 0] + [FULL] * 3  # the damaged first blocks: nothing after them is used
    warnings = [r.getMessage() for r in caplog.records if "kv offload" in r.getMessage()]
    assert len(warnings) == 2, warnings  # "rejected" (checksum, truncation) once, "missing" once
    assert any("checksum" in w or "payload" in w for w in warnings)
    assert any("missing" in w for w in warnings)
    assert cached2 == [FULL] * 3  # recomputed and stored again


def test_a_writer_killed_mid_write_leaves_nothing_the_next_start_reads(stories_path, baseline, tmp_path):
    """SIGKILL while a block file is being written: the next start ignores the partial temp file
    (and removes it, its writer being gone) and serves correct output."""
    prompts = _prompts()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path))
    _run(llm, prompts)
    llm.engine.shutdown()
    directory = llm.engine.kv.tiers.spec.directory
    victim = _wait_files(directory, 1)[0]
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "f = open(sys.argv[1] + '.tmp.' + str(os.getpid()), 'wb')\n"
        "f.write(data[: len(data) // 2]); f.flush()\n"
        "print('written', flush=True); time.sleep(60)\n"
    ), victim], stdout=subprocess.PIPE)  # fmt: skip
    assert child.stdout.readline().strip() == b"written"
    child.send_signal(signal.SIGKILL)
    child.wait()
    partial = f"{victim}.tmp.{child.pid}"
    assert os.path.getsize(partial) > 0
    os.unlink(os.path.join(directory, kv_block_file.INDEX))  # the crash lost the index too
    again = _llm(stories_path, kv_offload_dir=str(tmp_path))
    assert not os.path.exists(partial)
    toks, cached = _run(again, prompts)
    assert toks == baseline and cached == [FULL] * 6


_FAULT_CHILD = r"""
import json, logging, os, subprocess, sys
from kvledger.llm import LLM
from kvledger.sampling_params import SamplingParams
model, root, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
warnings = []
class H(logging.Handler):
    def emit(self, r):
        if "kv offload" in r.getMessage():
            warnings.append(r.getMessage())
logging.getLogger("kvledger").addHandler(H())
out = {}
for name, opts in (("full", "size=48k"), ("ro", "ro,size=48k")):
    d = os.path.join(root, name)
    os.makedirs(d)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", d], check=True)
    warnings.clear()
    llm = LLM(model, block_size=16, num_kv_blocks=12, calibrate_preemption=False,
              kv_offload_dir=d, kv_offload_disk_bytes=1 << 30)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    toks = []
    for p in prompts * 2:
        toks.append(list(llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids))
    llm.engine.shutdown()
    out[name] = {"tokens": toks, "warnings": list(warnings)}
print(json.dumps(out))
"""


def test_full_disk_and_read_only_directory_keep_serving(stories_path, baseline, tmp_path):
    """A real full filesystem (a 48 KiB tmpfs: ENOSPC at the third 21 KiB block) and a read-only one
    (EROFS), each mounted in a private mount namespace: the engine serves the same tokens and
    says so once."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", _FAULT_CHILD, str(stories_path), str(tmp_path),
         json.dumps(_prompts(3))],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name, errno_name in (("full", "ENOSPC"), ("ro", "EROFS")):
        assert out[name]["tokens"] == baseline[:3] * 2, name
        warnings = out[name]["warnings"]
        assert len(warnings) == 1 and errno_name in warnings[0], (name, warnings)


def test_bad_offload_settings_are_clear_errors(stories_path, tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    cases = [
        (dict(kv_offload_host_bytes=-1), "kv_offload_host_bytes must be"),
        (dict(kv_offload_host_bytes="12G"), "ambiguous"),
        (dict(kv_offload_disk_bytes=1 << 20), "needs kv_offload_dir"),
        (dict(kv_offloading_backend="lmcache", kv_offloading_size=1), "only 'native'"),
        (dict(kv_offloading_size=-2.0), "kv_offloading_size must be"),
        (dict(kv_offload_dir=str(not_a_dir)), "kv_offload_dir .* cannot be created"),
        (dict(kv_offload_host_bytes=1 << 20, enable_prefix_caching=False), "needs prefix caching"),
        (dict(kv_transfer_config='{"kv_connector": "LMCacheConnectorV1"}'), "'LMCacheConnectorV1' is not available"),
        (dict(kv_transfer_config={"kv_connector": "OffloadingConnector"}), "needs num_cpu_blocks or cpu_bytes_to_use"),
        (dict(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_connector_extra_config":
                                  {"num_cpu_blocks": 8, "block_size": 24}}), "multiple of the engine's 16"),
        (dict(kv_transfer_config="{oops"), "kv_transfer_config is not valid JSON"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            _llm(stories_path, **kw)


def test_server_restart_serves_the_prefix_from_disk_and_cache_salt_isolates(stories_path, tmp_path):
    """`kvledger serve` with a disk tier, stopped (SIGTERM) and started again: the same prompt's
    prefix comes back from disk (usage.prompt_tokens_details.cached_tokens >= 95 % of it) with
    the same text; through the real openai client, another cache_salt shares nothing."""
    from tests.test_server import ServerProcess

    prompt = _prompts(1, 321, seed=7)[0]
    args = (str(stories_path), "--torch-threads", "1", "--num-kv-blocks", "64",
            "--kv-offload-dir", str(tmp_path / "kv"))  # fmt: skip

    def ask(srv, **extra):
        c = srv.client()
        r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, max_tokens=5,
                                 temperature=0, extra_body=extra or None)  # fmt: skip
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

    first = ServerProcess(*args, log_path=tmp_path / "first.log")
    try:
        first.wait_ready()
        text, cached = ask(first)
        assert cached == 0
        assert ask(first, cache_salt="tenant-a") == (text, 0)  # salted: not the unsalted blocks
    finally:
        first.stop()
    second = ServerProcess(*args, log_path=tmp_path / "second.log")
    try:
        second.wait_ready()
        again, cached = ask(second)
        assert again == text and cached >= 0.95 * len(prompt), cached
        assert ask(second, cache_salt="tenant-b") == (text, 0)
        assert ask(second, cache_salt="tenant-a")[1] >= 0.95 * len(prompt)  # its own, from disk
        blocks = 2 * (len(prompt) // 16)  # the unsalted and tenant-a prefixes, from disk
        assert second.ledger()["tiers"]["disk"]["hits"] == blocks
        m = second.metrics()
        assert m["vllm:external_prefix_cache_hits_total{engine=0}"] == 16 * blocks
        assert m["kvledger:kv_tier_hits_total{tier=disk}"] == blocks
        assert m["kvledger:kv_tier_transfer_bytes_total{direction=load,tier=disk}"] >= blocks * 20480
    finally:
        second.stop()


def test_tier_index_lru_pins_and_kv_events_carry_the_medium():
    """The scheduler side alone (no torch): the host tier evicts its least recently used entry
    that no load is reading; the disk budget deletes files LRU; BlockStored / BlockRemoved
    events name the medium (vLLM's field): CPU for host memory, DISK for files."""
    from kvledger.cache.kv_block_file import OffloadSpec
    from kvledger.cache.kv_events import BlockRemoved, BlockStored
    from kvledger.cache.kv_tier_messages import TierBlock, TierReport
    from kvledger.cache.kv_tiers import KVTiers

    tiers = KVTiers(OffloadSpec("fp", num_host_blocks=2, num_disk_blocks=2, block_bytes=64), 4)
    tiers.events = []
    blocks = [TierBlock(100 + i, None, (i, i, i, i)) for i in range(4)]
    tiers.on_evicted([(0, blocks[0]), (1, blocks[1])])
    stores, _, _ = tiers.take_ops()
    assert [(s.block_id, s.host_slot, s.to_disk) for s in stores] == [(0, 0, True), (1, 1, True)]
    assert [(type(e), e.medium) for e in tiers.events] == [(BlockStored, "CPU")] * 2
    tiers.on_report(TierReport(stores_done=[100, 101]))
    assert [e.medium for e in tiers.events[2:]] == ["DISK", "DISK"]
    # A load of block 100 pins it: the next store takes 101's slot although 100 is older.
    (hit,) = tiers.lookup([(100, (0, 0, 0, 0), None)], None)
    assert hit == (0, blocks[0])
    assert tiers.lookup([(100, (0, 0, 0, 9), None)], None) == []  # other tokens: a miss
    assert tiers.lookup([(100, (0, 0, 0, 0), "salt")], None) == []  # another salt: a miss
    tiers.start_load("r", [7], [hit])
    tiers.events.clear()
    tiers.on_evicted([(2, blocks[2])])
    (s,), _, deletes = tiers.take_ops()
    assert s.host_slot == 1 and 101 not in tiers.host and 100 in tiers.host
    # The disk holds 2 files: a third deletes the least recently used unpinned one (101).
    assert deletes == [101] and s.to_disk
    assert tiers.disk_pending == {102} and 100 in tiers.disk and 101 not in tiers.disk
    assert (BlockRemoved, "DISK") in [(type(e), e.medium) for e in tiers.events]
    tiers.end_load("r")
    assert not tiers.pins


def test_colliding_hashes_never_alias_across_tiers(stories_path, baseline, tmp_path, monkeypatch):
    """A block hash that ignores the tokens (every prompt's block i collides): the tiers find
    entries by hash but verify tokens, salt and parent, so outputs stay exact."""
    from kvledger.cache import block_hash

    monkeypatch.setitem(block_hash.HASH_FNS, "sha256", lambda parent, tokens, salt=None: hash((parent, salt)) & 0xFFFF)
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path), kv_offload_host_bytes="1MiB")
    toks, cached = _run(llm, _prompts() * 2)
    assert toks == baseline * 2
    assert sum(cached) < 6 * FULL  # the colliding entries hold other prompts' tokens


def test_vllm_offloading_connector_config_maps_onto_the_host_tier(stories_path, baseline):
    """vLLM's --kv-transfer-config with OffloadingConnector and num_cpu_blocks: a host tier of
    that many blocks, serving the second pass."""
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"num_cpu_blocks": 40}}  # fmt: skip
    llm = _llm(stories_path, kv_transfer_config=cfg)
    tiers = llm.engine.kv.tiers
    assert tiers.spec.num_host_blocks == 40 and not tiers.has_disk
    toks, cached = _run(llm, _prompts() * 2)
    assert toks == baseline * 2 and cached[6:] == [FULL] * 6


def test_abort_while_loading_gives_the_blocks_back_and_the_load_never_lands(stories_path, baseline, tmp_path):
    """A request aborted while its prefix is read from disk: its blocks return at once, other
    requests take them, and the read that finishes later is dropped (not copied over them).
    The loader thread is held busy so the request is surely still loading when aborted."""
    import threading

    prompts = _prompts()
    first = _llm(stories_path, kv_offload_dir=str(tmp_path))
    _run(first, prompts)
    first.engine.shutdown()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path))
    eng, gate = llm.engine, threading.Event()
    busy = eng.executor.worker.tiers.loader.submit(gate.wait, 30)
    eng.add_request(prompts[0], GREEDY, request_id="gone")
    eng.step()
    (req, _, hit) = eng.scheduler.tier_loading.requests["gone"]
    assert len(hit.loads) == 6 and req.status.value == "waiting_for_remote_kvs"
    assert eng.kv.num_used_blocks == 6
    eng.abort_request("gone")
    assert eng.kv.num_used_blocks == 0 and not eng.scheduler.tier_loading
    # The freed blocks go to other prompts (recomputed: their disk reads queue behind the gate).
    eng.add_request(prompts[1], GREEDY, request_id="next")
    eng.step()
    gate.set()
    busy.result()
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [list(o.outputs[0].token_ids) for o in outs] == [baseline[1]]
    toks, cached = _run(llm, prompts[:1])  # the aborted prompt, loaded for real this time
    assert toks == baseline[:1] and cached == [FULL]


def test_prompt_logprobs_requests_compute_every_position(stories_path, tmp_path):
    """A request asking for prompt logprobs needs every prompt row: no tier load for it, and
    its prompt logprobs are those of an engine without tiers."""
    prompts = _prompts(3)
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)

    def logprobs(llm):
        out = []
        for p in prompts * 2:
            (o,) = llm.generate([{"prompt_token_ids": p}], sp)
            assert o.num_cached_tokens == 0
            out.append([sorted((t, round(lp.logprob, 5)) for t, lp in d.items()) for d in o.prompt_logprobs[1:]])
        return out

    plain = logprobs(_llm(stories_path, num_kv_blocks=8))
    tiered = _llm(stories_path, num_kv_blocks=8, kv_offload_dir=str(tmp_path), kv_offload_host_bytes="1MiB")
    assert logprobs(tiered) == plain
    assert tiered.engine.kv.tiers.hits["host"] == 0


def test_external_prefix_cache_counters_count_each_request_once(stories_path, tmp_path):
    """vLLM's external prefix-cache series: queries are the prompt tokens past the device hit,
    hits the tokens a tier served, each request counted once (not at every step it waits)."""
    prompts = _prompts()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path), kv_offload_host_bytes="1MiB")
    _run(llm, prompts * 2)
    t = llm.engine.kv.tiers.flat_stats()
    assert t["query_tokens"] == 12 * 101 and t["hit_tokens"] == 6 * FULL
    assert t["host_hits"] == 36 and t["traffic_host_load_bytes"] == 36 * 20480


def test_int8_kv_sinks_survive_a_restart(tmp_path_factory):
    """Quantised KV keeps each request's first kv_sink_tokens in full precision (the overlay),
    which a prefix hit takes from the worker's sink cache. The disk tier keeps the sinks of
    every prompt's first block beside it, so after a restart a loaded prefix reads the same
    full-precision sinks as a recompute: the same tokens, and no sink-cache miss."""
    from tests.model_factory import build_hf_model, tiny_config

    path = tmp_path_factory.mktemp("gqa-sinks")
    build_hf_model(tiny_config("llama_gqa"), path)
    kw = dict(kv_cache_dtype="int8", kv_sink_tokens=4)
    prompts = _prompts(3, vocab=97, seed=2)
    base, _ = _run(_llm(path, **kw), prompts)
    d = tmp_path_factory.mktemp("tiers-sinks")
    first = _llm(path, kv_offload_dir=str(d), **kw)
    assert _run(first, prompts)[0] == base
    first.engine.shutdown()
    again = _llm(path, kv_offload_dir=str(d), **kw)
    toks, cached = _run(again, prompts)
    assert cached == [FULL] * 3
    assert again.engine.executor.stats().sink_cache_misses == 0
    assert toks == base


def test_int8_kv_sinks_come_back_with_a_host_tier_hit(tmp_path_factory):
    """The same with the host tier, after the overlay's own sink cache dropped the entries
    (here: emptied): the host tier's copy of the sinks comes back with the prefix."""
    from tests.model_factory import build_hf_model, tiny_config

    path = tmp_path_factory.mktemp("gqa-host-sinks")
    build_hf_model(tiny_config("llama_gqa"), path)
    kw = dict(kv_cache_dtype="int8", kv_sink_tokens=4)
    prompts, others = _prompts(3, vocab=97, seed=3), _prompts(3, vocab=97, seed=4)
    base, _ = _run(_llm(path, **kw), prompts)
    llm = _llm(path, kv_offload_host_bytes=1 << 20, **kw)
    assert _run(llm, prompts)[0] == base
    _run(llm, others)  # evicts the prompts' blocks (and their sinks) into the host tier
    overlay = llm.engine.executor.worker.runner.overlay
    overlay.sink_cache.clear()
    toks, cached = _run(llm, prompts)
    assert cached == [FULL] * 3 and overlay.sink_cache_misses == 0
    assert toks == base


def test_reset_prefix_cache_clears_the_host_tier_and_with_reset_connector_the_disk(
    stories_path, baseline, tmp_path
):
    """reset_prefix_cache() forgets the device's and the host tier's blocks (vLLM's reset clears
    its CPU offload cache too); the disk tier serves the next pass. reset_connector=True also
    deletes the disk tier's files and index: the pass after it is recomputed."""
    prompts = _prompts()
    llm = _llm(stories_path, kv_offload_dir=str(tmp_path), kv_offload_host_bytes="1MiB")
    _run(llm, prompts)
    tiers = llm.engine.kv.tiers
    directory = tiers.spec.directory
    _wait_files(directory, 24)
    assert len(tiers.host) >= 24
    assert llm.reset_prefix_cache()
    assert not tiers.host and len(tiers.free_slots) == tiers.spec.num_host_blocks
    toks, cached = _run(llm, prompts)
    # The first four prompts were evicted to disk; the last two were only on the device.
    assert toks == baseline and cached == [FULL] * 4 + [0] * 2
    assert tiers.hits["host"] == 0 and tiers.hits["disk"] == 24
    assert llm.reset_prefix_cache(reset_connector=True)
    assert not tiers.host and not tiers.disk
    deadline = time.monotonic() + 20
    while _wait_files(directory, 0, timeout=0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker's writer thread deletes them
    assert _wait_files(directory, 0, timeout=0) == []
    assert json.loads(Path(directory, kv_block_file.INDEX).read_text())["blocks"] == []
    toks, cached = _run(llm, prompts)
    assert toks == baseline and cached == [0] * 6
