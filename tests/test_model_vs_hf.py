"""The model side against its oracle: Hugging Face transformers, float32, greedy.

Every supported architecture is built tiny with random weights, saved as safetensors, loaded
by kvledger and run through the paged cache with 4-token blocks allocated in shuffled order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_factory import PagedDriver, build_hf_model, tiny_config
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from kvledger.errors import ConfigError, UnsupportedArchitectureError
from kvledger.hf.tokenizer import load_tokenizer
from kvledger.kernels import native
from kvledger.model.attention import torch_backend
from kvledger.model.layers import Linear
from kvledger.model.loader import load_model
from kvledger.storage.kv_cache import HostKVPool, KVCachePool

STORIES = Path(__file__).resolve().parents[1].parent / "shared/models/stories260k"
KINDS = [
    "llama_mha", "llama_gqa", "llama_mqa", "llama3_rope", "qwen2", "qwen3", "mistral",
    # Issue 20: more families, RoPE scalings and sliding windows shorter than the test sequences.
    "mistral_window", "llama_linear", "llama_dynamic", "llama_yarn", "gemma2", "gemma3",
    "phi3", "mixtral", "qwen3_moe",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add synchronisation (and stall on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_hf_model(tiny_config(request.param), folder)
    hf.generation_config.eos_token_id = None  # compare full-length continuations
    hf.generation_config.pad_token_id = 0
    return hf, load_model(folder)


def _prompt(n: int, seed: int = 1, vocab: int = 97) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def test_prefill_logits_match_hf(tiny):
    hf, loaded = tiny
    prompt = _prompt(23)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = PagedDriver(loaded).step([("a", prompt)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("use_native", [True, False])
def test_paged_greedy_matches_hf_generate(tiny, use_native, monkeypatch):
    """Token-identical to HF generate over 30 steps; every step's logits agree too. With the
    native kernels (GEMMs, paged attention, RoPE, RMSNorm, SiLU) and with torch's only."""
    hf, loaded = tiny
    if not use_native:
        monkeypatch.setattr(native, "library", lambda: None)
        tied = [loaded.model.tied_head] if loaded.model.tied_head is not None else []
        for m in [*loaded.model.modules(), *tied]:
            if isinstance(m, Linear):
                monkeypatch.setattr(m, "small", None)
    elif native.library() is None:
        pytest.skip("native kernels unavailable here")
    prompt = _prompt(11, seed=2)
    ref_tokens, ref_logits = _hf_greedy(hf, prompt, 30)
    drv = PagedDriver(loaded, block_size=4, seed=7)
    logits = [drv.step([("a", prompt[:5])]), drv.step([("a", prompt[5:])])]  # chunked prefill
    tokens: list[int] = []
    step_logits = []
    for _ in range(30):
        step_logits.append(logits[-1][-1])
        tokens.append(int(step_logits[-1].argmax()))
        logits.append(drv.step([("a", [tokens[-1]])]))
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.stack(step_logits), ref_logits, atol=1e-4, rtol=1e-4)
    cfg = loaded.config
    if cfg.attn_softcap is None and not all(cfg.is_sliding(i) for i in range(cfg.num_layers)):
        # Full-attention layers keep the native decode; windowed / soft-capped ones use torch's.
        assert (loaded.model.attn_backend._plan.native_decode is not None) == use_native
    table = drv.tables["a"]
    assert len(table) >= 10 and table != sorted(table), "blocks must be many and non-contiguous"


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen3"])
@pytest.mark.parametrize("decode_path", ["native", "batched", "alone"])
def test_mixed_batch_matches_each_request_alone(kind, decode_path, tmp_path, monkeypatch):
    """One request prefills a chunk while two decode: same logits as running each alone,
    whether the decodes (and, native, the chunk's rows) go through the native paged kernels, a
    padded SDPA batch, or one by one."""
    if decode_path == "native":
        if native.library() is None:
            pytest.skip("native kernels unavailable here (no C compiler or no AVX2)")
    else:
        monkeypatch.setattr(native, "can_paged_decode", lambda *a: False)
        limit = float("inf") if decode_path == "batched" else 0.0
        monkeypatch.setattr(torch_backend, "_MAX_DECODE_PADDING", limit)
        monkeypatch.setattr(torch_backend, "_MAX_GROUP_BYTES", limit)
    build_hf_model(tiny_config(kind), tmp_path)
    loaded = load_model(tmp_path)
    prompts = {"a": _prompt(9, 1), "b": _prompt(14, 2), "c": _prompt(3, 3)}
    nxt = {"b": 5, "c": 6}

    alone = {}
    for rid, p in prompts.items():
        drv = PagedDriver(loaded, seed=hash(rid) % 100)
        if rid == "a":
            drv.step([(rid, p[:4])])
            alone[rid] = drv.step([(rid, p[4:])])
        else:
            drv.step([(rid, p)])
            alone[rid] = drv.step([(rid, [nxt[rid]])])

    drv = PagedDriver(loaded, seed=11)
    drv.step([("a", prompts["a"][:4]), ("b", prompts["b"]), ("c", prompts["c"])])
    mixed = drv.step([("b", [nxt["b"]]), ("a", prompts["a"][4:]), ("c", [nxt["c"]])])
    plan = loaded.model.attn_backend._plan
    assert (plan.native_decode is not None) == (decode_path == "native")
    assert len(plan.decode) == (1 if decode_path == "batched" else 0)
    # native: the chunk's 5 rows through the prefill kernel, beside the 2 decodes
    assert len(plan.chunks) == {"alone": 3, "batched": 1, "native": 0}[decode_path]
    if decode_path == "native":
        assert plan.native_decode.rows.tolist() == [0, 6]
        assert (plan.native_prefill.row0.tolist(), plan.native_prefill.nrows.tolist()) == ([1], [5])
        assert plan.native_prefill.seq_lens.tolist() == [9]
    else:
        assert plan.native_prefill is None
    torch.testing.assert_close(mixed[0:1], alone["b"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1:6], alone["a"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[6:7], alone["c"], atol=1e-5, rtol=1e-5)


def test_prefill_chunks_take_the_native_kernel_by_the_context_their_rows_read(tmp_path, monkeypatch):
    """A prefill chunk goes to the native kernel only while its rows read at most
    _NATIVE_PREFILL_MAX_READ context tokens in all: a short chunk late in a long prompt reads
    more than its length says. Either way the logits are those of per-request SDPA."""
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler or no AVX2)")
    build_hf_model(tiny_config("llama_gqa"), tmp_path)
    loaded = load_model(tmp_path)
    a, b = _prompt(43, 1), _prompt(15, 2)

    def run(bound):
        monkeypatch.setattr(torch_backend, "_NATIVE_PREFILL_MAX_READ", bound)
        monkeypatch.setattr(torch_backend, "_NATIVE_PREFILL_MAX_READ_SHORT", bound)
        drv = PagedDriver(loaded, seed=3)
        first = drv.step([("a", a[:40]), ("b", b[:12])])
        plan1 = loaded.model.attn_backend._plan
        second = drv.step([("a", a[40:]), ("b", b[12:])])
        return torch.cat([first, second]), plan1, loaded.model.attn_backend._plan

    sdpa, _, _ = run(0)
    mixed, plan1, plan2 = run(100)
    # step 1: a's 40 fresh rows read 820 tokens (SDPA), b's 12 read 78 (native)
    assert [(c.start, c.end) for c in plan1.chunks] == [(0, 40)]
    assert plan1.native_decode is None
    assert (plan1.native_prefill.row0.tolist(), plan1.native_prefill.nrows.tolist()) == ([40], [12])
    # step 2: a's 3 rows at positions 40-42 read 126 (SDPA, though only 3 tokens), b's 3 read 42
    assert [(c.start, c.end) for c in plan2.chunks] == [(0, 3)]
    assert (plan2.native_prefill.row0.tolist(), plan2.native_prefill.nrows.tolist()) == ([3], [3])
    assert plan2.native_prefill.seq_lens.tolist() == [15]
    torch.testing.assert_close(mixed, sdpa, atol=1e-5, rtol=1e-5)


def test_native_prefill_bound_follows_the_measured_shapes():
    """Up to a fresh 1,024-token chunk's reads in any context; up to a fresh 2,048-token chunk's
    in contexts of at most 16,384 tokens; late chunks of longer prompts past that keep SDPA,
    where the kernel measured slower (32 rows at 32,768 tokens, float32)."""
    takes = torch_backend._native_prefill_takes
    assert takes(2048, 2048) and takes(512, 4096) and takes(64, 16384) and takes(16, 32768)
    assert not takes(32, 32768) and not takes(200, 16384) and not takes(600, 8192)
    assert not takes(2049, 2049) and not takes(65, 16385)


def test_longrope_long_prompt_uses_the_long_factors(tmp_path):
    """Past original_max_position_embeddings (48 here) LongRoPE switches to its long factors:
    a 60-token prompt (prefilled in one chunk, as HF does) and its continuation match HF's.
    (Chunk boundaries and decodes crossing the switch point go through the engine, which
    recomputes there as HF does: tests/test_model_families.py.)"""
    hf = build_hf_model(tiny_config("phi3"), tmp_path)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    loaded = load_model(tmp_path)
    prompt = _prompt(60, seed=4)
    ref_tokens, _ = _hf_greedy(hf, prompt, 8)
    assert PagedDriver(loaded, seed=3).greedy("a", prompt, 8) == ref_tokens
    short = PagedDriver(loaded).step([("a", prompt[:40])])
    with torch.no_grad():
        torch.testing.assert_close(short, hf(torch.tensor([prompt[:40]])).logits[0], atol=1e-4, rtol=1e-4)


def test_unsupported_options_are_named(tmp_path):
    """Options kvledger does not implement are refused by name, not run wrongly."""
    from kvledger.hf.config import model_config_from_hf

    base = json.loads(tiny_config("gemma2").to_json_string())
    with pytest.raises(ConfigError, match="RoPE type 'mrope'"):
        model_config_from_hf({**base, "rope_parameters": {"rope_type": "mrope", "rope_theta": 1.0}})
    with pytest.raises(ConfigError, match="yarn rope scaling is missing factor"):
        model_config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 8}})
    with pytest.raises(ConfigError, match="hidden_act 'relu'"):
        model_config_from_hf({**base, "hidden_activation": "relu"})
    with pytest.raises(ConfigError, match="layer type"):
        model_config_from_hf({**base, "layer_types": ["chunked_attention"] * 3})
    with pytest.raises(UnsupportedArchitectureError, match="multimodal"):
        model_config_from_hf({**base, "architectures": ["Gemma3ForConditionalGeneration"]})
    moe = json.loads(tiny_config("mixtral").to_json_string())
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        model_config_from_hf({**moe, "num_experts_per_tok": None})


@pytest.mark.skipif(not STORIES.is_dir(), reason="shared stories260k test model not present")
def test_stories260k_greedy_matches_hf_and_readme():
    loaded = load_model(STORIES)
    assert loaded.dtype == torch.float32
    assert loaded.eos_token_ids == [1, 2]
    assert loaded.max_model_len == 512
    tok = load_tokenizer(STORIES)
    prompt = tok("Once upon a time")["input_ids"]
    assert prompt[0] == 1  # BOS added by the tokenizer
    out = PagedDriver(loaded, block_size=4, num_blocks=64).greedy(
        "s", prompt, 200, stop_ids=tuple(loaded.eos_token_ids)
    )
    hf = AutoModelForCausalLM.from_pretrained(STORIES)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False)
    assert out == ref[0, len(prompt) :].tolist()
    text = " ".join(tok.decode(out, skip_special_tokens=True).split())
    assert text.startswith(
        ", there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw a big, red ball. She wanted to play with it, but it was too high."
    )


def test_sharded_safetensors(tmp_path):
    hf = build_hf_model(tiny_config("llama_gqa"), tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    prompt = _prompt(7)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = PagedDriver(load_model(tmp_path)).step([("a", prompt)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_unsupported_architecture_is_named(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50)).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "unsupported architecture GPT2LMHeadModel" in msg
    assert "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)
    tiny_config("llama_mha").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_model(tmp_path)


def test_old_style_rope_keys_and_explicit_dtypes(tmp_path):
    """Pre-transformers-5 configs keep rope_theta/rope_scaling at top level: same model."""
    hf = build_hf_model(tiny_config("llama3_rope"), tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    cfg_path.write_text(json.dumps(cfg))
    loaded = load_model(tmp_path, max_model_len=64)
    assert loaded.config.rope_scaling is not None and loaded.config.rope_theta == 500000.0
    assert loaded.max_model_len == 64
    prompt = _prompt(40)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(PagedDriver(loaded).step([("a", prompt)]), ref, atol=1e-4, rtol=1e-4)
    assert load_model(tmp_path, dtype="float16").model.dtype == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        load_model(tmp_path, dtype="int8")
    with pytest.raises(ConfigError, match="max_model_len"):
        load_model(tmp_path, max_model_len=10_000)


def test_bf16_model_runs_and_agrees_on_first_token(tmp_path):
    hf = build_hf_model(tiny_config("qwen2"), tmp_path, dtype=torch.bfloat16)
    loaded = load_model(tmp_path)  # "auto" picks the checkpoint's bfloat16
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    prompt = _prompt(12)
    drv = PagedDriver(loaded)
    logits = drv.step([("a", prompt)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert drv.pool.data.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert int(logits[-1].argmax()) == int(ref.argmax())
    assert torch.isfinite(drv.step([("a", [int(logits[-1].argmax())])])).all()


def test_copy_blocks_and_swap_round_trip():
    """COW copies and swaps move whole blocks, every layer, K and V, and nothing else."""
    pool = KVCachePool(
        num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    pool.data.copy_(torch.randn_like(pool.data))
    before = pool.data.clone()
    pool.copy_blocks([(0, 3), (1, 4)])
    assert torch.equal(pool.data[:, :, 3], before[:, :, 0])
    assert torch.equal(pool.data[:, :, 4], before[:, :, 1])
    assert torch.equal(pool.data[:, :, [0, 1, 2, 5]], before[:, :, [0, 1, 2, 5]])

    host = HostKVPool(3, pool)
    assert host.data.shape[2] == 3 and host.data.device.type == "cpu"
    host.swap_out([(5, 2), (3, 0)])
    assert torch.equal(host.data[:, :, 2], pool.data[:, :, 5])
    assert torch.equal(host.data[:, :, 0], pool.data[:, :, 3])
    saved = pool.data.clone()
    pool.data.zero_()
    host.swap_in([(2, 1), (0, 5)])
    assert torch.equal(pool.data[:, :, 1], saved[:, :, 5])
    assert torch.equal(pool.data[:, :, 5], saved[:, :, 3])
    assert pool.data[:, :, [0, 2, 3, 4]].abs().sum() == 0
    assert pool.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4
    assert pool.num_bytes == pool.data.numel() * 4


def test_layer_cache_write_then_read_through_block_table():
    pool = KVCachePool(
        num_layers=1, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32
    )
    layer = pool.layer(0)
    k, v = torch.randn(6, 2, 3), torch.randn(6, 2, 3)
    table = [3, 1]  # tokens 0-3 in block 3, tokens 4-5 in block 1
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(6)])
    layer.write(k, v, slots)
    kc, vc = layer.read(torch.tensor(table))
    assert torch.equal(kc.flatten(0, 1)[:6], k) and torch.equal(vc.flatten(0, 1)[:6], v)


def test_packed_linears_cover_every_matmul_and_match_plain_ones(tmp_path):
    """CPU float32 loads pack every matmul weight (a tied LM head too) for oneDNN; packed and
    plain products agree to float32 rounding, bias included. bfloat16 is packed where oneDNN
    runs bf16 natively and takes the native few-row GEMM; float16 stays unpacked."""
    from kvledger.model.layers import _onednn_bf16, can_pack_linear

    cfg = tiny_config("qwen2")  # q/k/v biases
    cfg.tie_word_embeddings = True
    build_hf_model(cfg, tmp_path)
    if not can_pack_linear(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN")
    packed = load_model(tmp_path)
    plain = load_model(tmp_path, pack_linear=False)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert packed.model.lm_head is None and packed.model.tied_head.packed is not None
    assert "tied_head.weight" not in packed.model.state_dict()
    assert all(m.packed is None for m in plain.model.modules() if isinstance(m, Linear))
    x = torch.randn(7, cfg.hidden_size)
    qkv = packed.model.model.layers[0].self_attn.qkv_proj
    ref = plain.model.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None
    # Both fast copies made: the plain weight is dropped (shape and dtype kept for accounting),
    # the tied head's too: the embedding then reads its rows from the head's native copy.
    embed = packed.model.model.embed_tokens
    if qkv.native_small:
        assert qkv.weight.is_meta and qkv.weight.shape == ref.weight.shape
        assert packed.model.tied_head.weight.is_meta and embed.rows_from is packed.model.tied_head.small
    assert packed.model.tied_head.weight is embed.weight
    ids = torch.tensor([[0, 5, cfg.vocab_size - 1], [7, 7, 1]])
    assert torch.equal(embed(ids), plain.model.model.embed_tokens(ids))
    for rows in (x, torch.cat([x] * 10)):  # the native few-row GEMM, then oneDNN
        want = torch.nn.functional.linear(rows, ref.weight, ref.bias)
        torch.testing.assert_close(qkv(rows), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.model.compute_logits(x), plain.model.compute_logits(x), atol=1e-5, rtol=1e-5)
    bf16_model = load_model(tmp_path, dtype="bfloat16").model
    ref16_model = load_model(tmp_path, dtype="bfloat16", pack_linear=False).model
    assert torch.equal(bf16_model.model.embed_tokens(ids), ref16_model.model.embed_tokens(ids))
    bf16 = bf16_model.model.layers[0].self_attn.qkv_proj
    ref16 = ref16_model.model.layers[0].self_attn.qkv_proj
    assert (bf16.packed is not None) == _onednn_bf16()
    assert bf16.native_small == (native.library() is not None)
    xb = x.bfloat16()
    for rows in (xb[:3], torch.cat([xb] * 10)):  # the native few-row GEMM, then oneDNN / torch
        want = torch.nn.functional.linear(rows, ref16.weight, ref16.bias)
        torch.testing.assert_close(bf16(rows), want, atol=2e-2, rtol=2e-2)
    assert load_model(tmp_path, dtype="float16").model.model.layers[0].mlp.down_proj.packed is None
    assert not can_pack_linear(torch.float16, torch.device("cpu"))


def test_decode_groups_bound_padding_and_bytes(monkeypatch):
    """Decodes are grouped by context length: a group's padded context stays within the
    padding factor and its gathered K/V within the byte cap; a singleton is attended alone."""
    from kvledger.model.attention.metadata import AttentionMetadata

    def meta(seq_lens, query_lens):
        n = len(seq_lens)
        z = torch.zeros(n, dtype=torch.long)
        return AttentionMetadata(z, z, z, z, 16, 1, max(seq_lens), query_lens, seq_lens)

    # Lengths 20..640 in mixed order; a 5-token prefill chunk is never grouped.
    lens = [600, 20, 640, 30, 300, 32, 310, 17]
    qls = [1, 1, 1, 1, 1, 1, 1, 5]
    groups = torch_backend._decode_groups(meta(lens, qls), bytes_per_token=1024)
    grouped = [i for g in groups for i in g]
    assert 7 not in grouped and len(grouped) == len(set(grouped))
    for g in groups:
        assert len(g) > 1
        padded = -(-max(lens[i] for i in g) // 16) * 16
        assert len(g) * padded <= torch_backend._MAX_DECODE_PADDING * sum(lens[i] for i in g)
        assert len(g) * padded * 1024 <= torch_backend._MAX_GROUP_BYTES
    assert sorted(map(sorted, groups)) == [[0, 2], [1, 3, 5], [4, 6]]
    # A byte cap that fits two 640-token contexts but not three splits equal lengths.
    monkeypatch.setattr(torch_backend, "_MAX_GROUP_BYTES", 2 * 640 * 1024)
    groups = torch_backend._decode_groups(meta([640] * 5, [1] * 5), bytes_per_token=1024)
    assert [len(g) for g in groups] == [2, 2]  # the fifth is attended alone
