"""GGUF files (hf/gguf_file.py): stories260k written as llama.cpp's converter writes it (q/k rows
permuted, layer projections in Q8_0 or Q4_0), loaded by kvledger, against transformers running the
weights gguf-py dequantises from the same file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvledger.errors import ConfigError  # noqa: E402


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (q/k rows for llama.cpp's RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# K-quant blocks: bytes a block of 256 weights, and where its fp16 d (and dmin) sit
_K_BLOCKS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None)}


def random_k_quant(kind: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """K-quant blocks of random content (gguf-py cannot quantise to them; any bytes with finite d
    and dmin are a valid block): [rows, K / 256 x block bytes], the weights ~ +-0.1."""
    size, d_at, dmin_at = _K_BLOCKS[kind]
    rng = np.random.default_rng(seed + shape[0] * 7 + shape[1])
    rows, blocks = shape[0], shape[1] // 256
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    d = 3e-5 if kind == "Q6_K" else 4e-4 if kind == "Q4_K" else 2e-4
    raw[..., d_at : d_at + 2] = (rng.uniform(0.5, 1, (rows, blocks, 1)) * d).astype(np.float16).view(np.uint8)
    if dmin_at is not None:
        raw[..., dmin_at : dmin_at + 2] = (rng.uniform(0.5, 1, (rows, blocks, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * size)


def q4_k_m(i: int, proj: str) -> str:
    """Layer projections' types as llama.cpp's Q4_K_M mixes them (Q6_K for some attn_v / ffn_down,
    and the LM head), here with Q5_K too: layer 0's v and down Q6_K, layer 1's Q5_K, the rest Q4_K."""
    if proj in ("self_attn.v_proj", "mlp.down_proj") and int(i) < 2:
        return "Q6_K" if int(i) == 0 else "Q5_K"
    return "Q4_K"


def write_gguf(src: Path, out: Path, layer_type: str, embed_type: str = "Q8_0", vocab: bool = False) -> dict[str, np.ndarray]:
    """A Llama, Qwen2 or Qwen3 model folder (stories260k, or a random model) as a GGUF file, as
    llama.cpp's converter writes one; returns every tensor as gguf-py dequantises it, in HF layout
    and names (the oracle's weights). layer_type: the layer projections' type, or "Q4_K_M" for
    ``q4_k_m``'s mix. vocab: the tokenizer in the metadata too, as llama.cpp's converter writes a
    Llama tokenizer.json (gguf-py's LlamaHfVocab)."""
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = cfg["model_type"]
    permute = arch == "llama"  # only the Llama converter permutes q/k rows
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if vocab:
        from gguf.vocab import LlamaHfVocab

        tokens, scores, types = zip(*LlamaHfVocab(src).all_tokens())
        w.add_tokenizer_model("llama")
        w.add_token_list(list(tokens))
        w.add_token_scores(list(scores))
        w.add_token_types([int(t) for t in types])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}  # fmt: skip
    oracle = {}
    for hf, t in sd.items():
        t = t.astype(np.float32)
        if hf in names:
            name, kind = names[hf], embed_type if hf.endswith("embed_tokens.weight") else "F32"
            if hf == "lm_head.weight" and layer_type == "Q4_K_M":  # as llama.cpp's Q4_K_M
                kind = "Q6_K"
        else:
            i, rest, leaf = hf.split(".")[2], ".".join(hf.split(".")[3:-1]), hf.split(".")[-1]  # leaf: weight / bias
            name = f"blk.{i}.{layer[rest]}.{leaf}"
            kind = q4_k_m(i, rest) if layer_type == "Q4_K_M" else layer_type
            kind = kind if t.ndim == 2 and t.shape[1] % (256 if kind in _K_BLOCKS else 32) == 0 else "F32"
            if permute and rest == "self_attn.q_proj":
                t = _permute(t, heads)
            elif permute and rest == "self_attn.k_proj":
                t = _permute(t, kv)
        qt = gguf.GGMLQuantizationType[kind]
        data = t if kind == "F32" else random_k_quant(kind, t.shape) if kind in _K_BLOCKS else gguf.quants.quantize(t, qt)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
        back = t if kind == "F32" else gguf.quants.dequantize(data, qt).reshape(t.shape)
        if permute and name.endswith(("attn_q.weight", "attn_k.weight")):
            h = heads if "attn_q" in name else kv
            back = back.reshape(h, back.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
        oracle[hf] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return oracle


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """Materialised GGUF folders under tmp_path (the compiled kernels stay in the real cache)."""
    import kvledger.hf.gguf_file as gf

    real = gf.gguf_folder

    def folder(path, tokenizer=None):
        monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
        try:
            return real(path, tokenizer)
        finally:
            monkeypatch.delenv("KVLEDGER_CACHE_DIR")

    monkeypatch.setattr(gf, "gguf_folder", folder)
    return tmp_path


@pytest.mark.parametrize("layer_type", ["Q4_0", "Q8_0"])
def test_a_gguf_file_runs_as_transformers_runs_its_dequantised_weights(stories_path, gguf_cache, layer_type, caplog):
    from test_engine_exact import hf_greedy
    from transformers import AutoModelForCausalLM

    from kvledger import LLM, SamplingParams

    path = gguf_cache / "stories.gguf"
    oracle = write_gguf(stories_path, path, layer_type)
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(oracle[name]).reshape(p.shape))
    with caplog.at_level("WARNING", logger="kvledger"):
        llm = LLM(str(path), tokenizer=str(stories_path), calibrate_preemption=False)
    # the warning names what is held as floats: the embedding (a gathered table), not a projection
    held = [r.getMessage() for r in caplog.records if "held dequantised" in r.getMessage()]
    assert len(held) == 1 and "1 tensor(s)" in held[0] and "token_embd.weight (Q8_0)" in held[0], held
    lin = llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert lin.quant is not None and lin.quant.bits == (4 if layer_type == "Q4_0" else 8)
    assert llm.engine.executor.worker.model.model.layers[0].mlp.down_proj.quant is None  # F32 in the file
    tok = llm.get_tokenizer()
    for prompt in ["Once upon a time", "The little dog"]:
        ids = tok.encode(prompt)
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(hf, ids, 32), prompt


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_gguf_files_run_as_transformers_runs_their_dequantised_weights(tmp_path, stories_path, gguf_cache, kind):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorms, head_dim apart from hidden / heads) as
    llama.cpp's converter writes them: architecture named, no q/k row permutation, biases and
    norms as their own tensors; Q8_0 projections where 32 divides their rows (the rest F32)."""
    from model_factory import build_hf_model, tiny_config
    from test_engine_exact import hf_greedy

    from kvledger import LLM, SamplingParams

    cfg = tiny_config(kind)
    cfg.vocab_size = 512  # stories260k's tokenizer names the tokens
    hf = build_hf_model(cfg, tmp_path / kind)
    path = gguf_cache / f"{kind}.gguf"
    oracle = write_gguf(tmp_path / kind, path, "Q8_0")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(oracle[name]).reshape(p.shape))
    llm = LLM(str(path), tokenizer=str(stories_path), block_size=4, calibrate_preemption=False)
    attn = llm.engine.executor.worker.model.model.layers[0].self_attn
    assert attn.qkv_proj.quant is not None and attn.qkv_proj.quant.bits == 8
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 13)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), (kind, p)


def test_bad_gguf_files_are_refused_by_name(stories_path, gguf_cache):
    from kvledger import LLM

    path = gguf_cache / "stories.gguf"
    write_gguf(stories_path, path, "Q8_0")
    with pytest.raises(ConfigError, match="tokenizer could not be read.*tokenizer="):
        LLM(str(path), calibrate_preemption=False)  # no tokenizer in its metadata
    cut = gguf_cache / "cut" / "cut.gguf"
    cut.parent.mkdir()
    cut.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ConfigError, match="cut.gguf is not a readable GGUF file"):
        LLM(str(cut.parent), tokenizer=str(stories_path), calibrate_preemption=False)
    other = gguf_cache / "other.gguf"
    w = gguf.GGUFWriter(str(other), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'mamba' is not supported"):
        LLM(str(other), tokenizer=str(stories_path), calibrate_preemption=False)


@pytest.mark.parametrize("layer_type", ["Q4_0", "Q8_0"])
def test_gguf_groups_take_the_int8_activation_kernel_with_the_references_tokens(
    stories_path, gguf_cache, layer_type, monkeypatch
):
    """A bf16 engine holds a GGUF file's Q4_0 / Q8_0 projections as W4A8 / grouped-W8A8 tiles
    (llama.cpp's Q4_0 x Q8_0 and Q8_0 x Q8_0); in float32 with those kernels forced, the native
    engine's tokens are the torch reference's (quant_q4.reference_gemm)."""
    from kvledger import LLM, SamplingParams
    from kvledger.kernels import native
    from kvledger.model.quant_q4 import Q4Weight

    path = gguf_cache / "stories.gguf"
    write_gguf(stories_path, path, layer_type)
    bits = 4 if layer_type == "Q4_0" else 8
    bf16 = LLM(str(path), tokenizer=str(stories_path), dtype="bfloat16", calibrate_preemption=False)
    lin = bf16.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(lin.quant, Q4Weight) and lin.quant.bits == bits
    ids = bf16.get_tokenizer().encode("Once upon a time")
    sp = SamplingParams(temperature=0, max_tokens=24)
    monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", "int8")

    def tokens():
        llm = LLM(str(path), tokenizer=str(stories_path), calibrate_preemption=False)
        assert isinstance(llm.engine.executor.worker.model.model.layers[0].self_attn.qkv_proj.quant, Q4Weight)
        return llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0].token_ids

    fast = tokens()
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert tokens() == fast
    finally:
        monkeypatch.delenv("KVLEDGER_NATIVE")
        native.library.cache_clear()


def test_the_tokenizer_comes_from_the_files_metadata_as_llamacpp_reads_it(stories_path, gguf_cache):
    """A file with its tokenizer in the metadata (as llama.cpp's converter writes stories260k's)
    runs without a tokenizer folder: its token ids are the original tokenizer's, text beginning
    with spaces too (llama.cpp puts a space before the text; transformers' own conversion does not
    when the text starts with one), and so are the engine's outputs."""
    from transformers import AutoTokenizer

    from kvledger import LLM, SamplingParams

    path = gguf_cache / "with_vocab.gguf"
    write_gguf(stories_path, path, "Q8_0", vocab=True)
    llm = LLM(str(path), calibrate_preemption=False)
    mine, theirs = llm.get_tokenizer(), AutoTokenizer.from_pretrained(str(stories_path))
    texts = ["Once upon a time, Lily's dog ran.", "  two leading spaces", " one", "tabs\tand\nnew lines\n\n",
             "digits 1234 and héllo wörld ☃", ""]  # fmt: skip
    for t in texts:
        assert mine.encode(t) == theirs.encode(t), t
        assert mine.decode(mine.encode(t), skip_special_tokens=True) == theirs.decode(theirs.encode(t), skip_special_tokens=True)
    sp = SamplingParams(temperature=0, max_tokens=24)
    got = [o.outputs[0].text for o in llm.generate(texts[:3], sp, use_tqdm=False)]
    ref = LLM(str(path), tokenizer=str(stories_path), calibrate_preemption=False)
    assert got == [o.outputs[0].text for o in ref.generate(texts[:3], sp, use_tqdm=False)]


@pytest.mark.parametrize("layer_type", ["Q4_K", "Q4_K_M"])
def test_a_k_quant_file_runs_natively_with_its_exact_values(tmp_path, stories_path, gguf_cache, monkeypatch, layer_type):
    """K-quant layer projections (a random-weight Llama whose rows are whole 256-weight blocks):
    Q4_K, and Q4_K_M's mix with Q6_K and Q5_K pieces. float32 runs the dequantised weights as
    transformers runs them; a bf16 engine holds them as tiles whose values are gguf-py's
    dequantisation exactly (a qkv whose v differs in type as a split of two tile sets); and the
    native kernels' tokens are the torch reference's, in the native layer and in the modules."""
    from test_engine_exact import hf_greedy
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvledger import LLM, SamplingParams
    from kvledger.kernels import native
    from kvledger.model.quant_q4 import Q4Split, Q4Weight
    from tests.model_factory import build_hf_model

    src = tmp_path / "src"
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    build_hf_model(cfg, src)
    path = gguf_cache / "k.gguf"
    oracle = write_gguf(src, path, layer_type, embed_type="F32")
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(oracle[name]).reshape(p.shape))
    ids = [1, 45, 300, 7, 99, 12, 410]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tokens(**kw):
        llm = LLM(str(path), tokenizer=str(stories_path), calibrate_preemption=False, **kw)
        return llm, llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0].token_ids

    _, plain = tokens()
    assert plain == hf_greedy(hf, ids, 16)
    bf16, _ = tokens(dtype="bfloat16")
    layers = bf16.engine.executor.worker.model.model.layers
    for i, layer in enumerate(layers):
        qkv = layer.self_attn.qkv_proj.quant
        want = torch.cat([torch.from_numpy(oracle[f"model.layers.{i}.self_attn.{p}_proj.weight"]) for p in "qkv"])
        assert torch.equal(qkv.dequantize(), want)
        down = torch.from_numpy(oracle[f"model.layers.{i}.mlp.down_proj.weight"])
        assert torch.equal(layer.mlp.down_proj.quant.dequantize(), down)
        if layer_type == "Q4_K_M" and i < 2:  # q, k Q4_K; v Q6_K (layer 0) or Q5_K (layer 1)
            assert isinstance(qkv, Q4Split) and [p.kquant for p in qkv.parts] == ["Q4_K", "Q6_K" if i == 0 else "Q5_K"]
        else:
            assert isinstance(qkv, Q4Weight) and qkv.kquant == "Q4_K"
    if layer_type == "Q4_K_M":  # the untied LM head in Q6_K, as llama.cpp's Q4_K_M holds it
        head = bf16.engine.executor.worker.model.lm_head.quant
        assert head.kquant == "Q6_K" and torch.equal(head.dequantize(), torch.from_numpy(oracle["lm_head.weight"]))
    monkeypatch.setenv("KVLEDGER_INT4_ACTIVATIONS", "int8")
    _, fast = tokens()
    monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "0")
    assert tokens()[1] == fast
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert tokens()[1] == fast
    finally:
        monkeypatch.delenv("KVLEDGER_NATIVE")
        native.library.cache_clear()


@pytest.mark.parametrize(("layer_type", "dtype"), [("Q4_0", "float32"), ("Q8_0", "bfloat16"), ("Q4_K", "bfloat16"),
                                                   ("Q4_K", "float32"), ("Q4_K_M", "bfloat16")])
def test_plan_counts_a_gguf_files_weights_as_the_engine_holds_them(tmp_path, stories_path, gguf_cache, layer_type, dtype):
    """`kvledger plan --model file.gguf` gives the weight bytes the live engine reports, to the
    byte: projections kept as group-wise weights or tiles, the rest in the model dtype."""
    import json
    import subprocess
    import sys

    from kvledger import LLM

    src = stories_path
    if layer_type.startswith("Q4_K"):  # rows of whole 256-weight blocks
        from transformers import LlamaConfig

        from tests.model_factory import build_hf_model

        src = tmp_path / "src"
        build_hf_model(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2), src)  # fmt: skip
    path = gguf_cache / "m.gguf"
    write_gguf(src, path, layer_type)
    env = {**os.environ, "KVLEDGER_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "kvledger", "plan", "--model", str(path), "--dtype", dtype, "--device-memory", "64MiB",
         "--memory-fraction", "1", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)["weight_bytes"]
    live = LLM(str(path), tokenizer=str(stories_path), dtype=dtype, calibrate_preemption=False)
    assert planned == live.engine.executor.worker.ready.weight_bytes
