"""Checkpoints as users have them: pytorch_model.bin (single and sharded), FP8 weights with
per-tensor and per-channel ``weight_scale`` (dequantised on load), quantization methods kvledger
cannot run (refused by name), and hub ids resolved offline from a hub cache built here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvledger.errors import ConfigError
from kvledger.model.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
META = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json")  # fmt: skip
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _meta(src: Path, dst: Path, **config_extra) -> dict:
    dst.mkdir(parents=True)
    for name in META:
        shutil.copy(src / name, dst / name)
    cfg = json.loads((src / "config.json").read_text()) | config_extra
    (dst / "config.json").write_text(json.dumps(cfg))
    return cfg


def _params(path: Path) -> dict[str, torch.Tensor]:
    m = load_model(path, pack_linear=False).model
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_pytorch_model_bin_single_and_sharded_load_the_same_weights(stories_path, tmp_path):
    sd = load_file(str(stories_path / "model.safetensors"))
    single = tmp_path / "bin"
    _meta(stories_path, single)
    torch.save(sd, single / "pytorch_model.bin")
    sharded = tmp_path / "bin-sharded"
    _meta(stories_path, sharded)
    names = sorted(sd)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}  # fmt: skip
    weight_map = {}
    for file, keys in halves.items():
        torch.save({k: sd[k] for k in keys}, sharded / file)
        weight_map |= dict.fromkeys(keys, file)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ref = _params(stories_path)
    for folder in (single, sharded):
        got = _params(folder)
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (folder.name, k)


def _fp8_checkpoint(stories_path: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(FP8 folder, float32 folder holding exactly the FP8 weights' dequantised values).
    Even layers get one scale per tensor, odd layers one per output channel."""
    sd = load_file(str(stories_path / "model.safetensors"))
    fp8, deq = {}, {}
    f8 = torch.float8_e4m3fn
    fmax = torch.finfo(f8).max
    for name, w in sd.items():
        parts = name.split(".")
        if parts[-1] == "weight" and parts[-2] in LINEARS:
            per_channel = int(parts[2]) % 2 == 1
            amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
            scale = (amax / fmax).clamp(min=1e-12).to(torch.float32)
            q = (w / scale).clamp(-fmax, fmax).to(f8)
            fp8[name] = q
            fp8[name.removesuffix("weight") + "weight_scale"] = scale if per_channel else scale.reshape(())
            deq[name] = q.to(torch.float32) * scale
        else:
            fp8[name] = deq[name] = w
    qdir, ddir = tmp_path / "fp8", tmp_path / "dequantised"
    _meta(stories_path, qdir, quantization_config={"quant_method": "fp8",
                                                   "activation_scheme": "dynamic"})  # fmt: skip
    save_file(fp8, str(qdir / "model.safetensors"))
    _meta(stories_path, ddir)
    save_file(deq, str(ddir / "model.safetensors"))
    return qdir, ddir


def test_fp8_weight_scales_are_dequantised_on_load(stories_path, tmp_path):
    qdir, ddir = _fp8_checkpoint(stories_path, tmp_path)
    got, ref, plain = _params(qdir), _params(ddir), _params(stories_path)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # the FP8 rounding is real (so the test would see scales being dropped), and small
    qkv = next(k for k in ref if k.endswith("qkv_proj.weight"))
    assert not torch.equal(got[qkv], plain[qkv])
    assert (got[qkv] - plain[qkv]).abs().max() < 0.1 * plain[qkv].abs().max()


def test_fp8_checkpoint_generates_what_transformers_generates_from_its_values(stories_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvledger import LLM, SamplingParams

    qdir, ddir = _fp8_checkpoint(stories_path, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(ddir))
    hf = AutoModelForCausalLM.from_pretrained(str(ddir), dtype=torch.float32)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :].tolist()
    llm = LLM(str(qdir), num_kv_blocks=32)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20))
    assert out[0].outputs[0].token_ids == expected
    assert len(out[0].outputs[0].text.split()) >= 8


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "compressed-tensors", "bits": 4}, "compressed-tensors"),
        ({"quant_method": "bitsandbytes", "bits": 4}, "bitsandbytes"),
        ({"quant_method": "gptq", "bits": 8}, "gptq checkpoints of 8 bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "gptq group_size 48"),
        ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "awq version 'exllama'"),
    ],
)
def test_quantization_methods_we_cannot_run_are_refused_by_name(stories_path, tmp_path, qc, match):
    folder = tmp_path / qc["quant_method"]
    _meta(stories_path, folder, quantization_config=qc)
    shutil.copy(stories_path / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(ConfigError, match=match):
        load_model(folder)


def test_fp8_tensor_without_a_scale_is_refused(stories_path, tmp_path):
    sd = load_file(str(stories_path / "model.safetensors"))
    key = next(k for k in sd if k.endswith("q_proj.weight"))
    sd[key] = sd[key].to(torch.float8_e4m3fn)
    folder = tmp_path / "noscale"
    _meta(stories_path, folder, quantization_config={"quant_method": "fp8"})
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="weight_scale"):
        load_model(folder)
    (folder / "config.json").write_text((stories_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="quantization_config"):
        load_model(folder)


def _hub_cache(stories_path: Path, cache: Path, repo: str) -> dict[str, str]:
    """A Hugging Face hub cache as huggingface_hub lays it out: refs name commits, snapshots
    hold the files. 'main' is stories260k; tag 'v1' is the same model as pytorch_model.bin."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commits = {"main": "a" * 40, "v1": "b" * 40}
    for ref, commit in commits.items():
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        for name in META:
            shutil.copy(stories_path / name, snap / name)
        if ref == "main":
            shutil.copy(stories_path / "model.safetensors", snap / "model.safetensors")
        else:
            torch.save(load_file(str(stories_path / "model.safetensors")), snap / "pytorch_model.bin")
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return {ref: str(root / "snapshots" / c) for ref, c in commits.items()}


def test_hub_ids_resolve_offline_from_the_cache(stories_path, tmp_path, monkeypatch):
    import huggingface_hub.constants as hfc

    from kvledger.llm import build_engine_config

    repo = "kvledger-test/stories260k"
    snaps = _hub_cache(stories_path, tmp_path / "hub", repo)
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    cfg = build_engine_config(repo, download_dir=str(tmp_path / "hub"))
    assert cfg.model == snaps["main"]
    cfg = build_engine_config(repo, download_dir=str(tmp_path / "hub"), revision="v1")
    assert cfg.model == snaps["v1"]
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        build_engine_config("kvledger-test/absent", download_dir=str(tmp_path / "hub"))


def test_generate_from_a_hub_id_with_hf_hub_offline(stories_path, tmp_path):
    """The user's path: `kvledger generate ORG/NAME --revision --download-dir` with
    HF_HUB_OFFLINE=1 runs the cached .bin snapshot and prints what the folder itself gives."""
    repo = "kvledger-test/stories260k"
    _hub_cache(stories_path, tmp_path / "hub", repo)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty")}
    common = ["--max-tokens", "12", "--json", "--num-kv-blocks", "32"]
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "generate", repo, "--revision", "v1",
         "--download-dir", str(tmp_path / "hub"), *common],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    hub = json.loads(r.stdout)["outputs"][0]["completions"][0]["token_ids"]
    from kvledger import LLM, SamplingParams

    folder = LLM(str(stories_path), num_kv_blocks=32).generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=12)
    )[0].outputs[0].token_ids
    assert hub == folder and len(hub) == 12
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "generate", "kvledger-test/absent", *common],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "kvledger-test/absent" in r.stderr and "HF_HUB_OFFLINE" in r.stderr


def _damage(stories_path: Path, dst: Path, case: str) -> str:
    """A copy of the model folder with one file damaged; returns that file's name."""
    shutil.copytree(stories_path, dst)
    if case.startswith("sharded"):  # the single file split into an index and two shards
        sd = load_file(dst / "model.safetensors")
        names = sorted(sd)
        half = len(names) // 2
        save_file({n: sd[n] for n in names[:half]}, dst / "model-00001-of-00002.safetensors")
        save_file({n: sd[n] for n in names[half:]}, dst / "model-00002-of-00002.safetensors")
        wm = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        (dst / "model.safetensors").unlink()
    damage = {
        "safetensors truncated": ("model.safetensors", lambda b: b[: len(b) // 2]),
        "safetensors empty": ("model.safetensors", lambda b: b""),
        "safetensors garbage": ("model.safetensors", lambda b: b"\x00not a tensor file\xff" * 8),
        "sharded shard truncated": ("model-00002-of-00002.safetensors", lambda b: b[: len(b) - 100]),
        "sharded index not json": ("model.safetensors.index.json", lambda b: b[:20]),
        "config truncated": ("config.json", lambda b: b[: len(b) // 2]),
        "generation config not json": ("generation_config.json", lambda b: b"{bad"),
        "tokenizer.json truncated": ("tokenizer.json", lambda b: b[: len(b) // 2]),
        "tokenizer_config not utf-8": ("tokenizer_config.json", lambda b: b"\xff\xfe{"),
        "special_tokens_map truncated": ("special_tokens_map.json", lambda b: b[:5]),
    }
    name, fn = damage[case]
    (dst / name).write_bytes(fn((dst / name).read_bytes()))
    return name


DAMAGE_CASES = [
    "safetensors truncated", "safetensors empty", "safetensors garbage", "sharded shard truncated",
    "sharded index not json", "config truncated", "generation config not json",
    "tokenizer.json truncated", "tokenizer_config not utf-8", "special_tokens_map truncated",
]  # fmt: skip


@pytest.mark.parametrize("case", DAMAGE_CASES)
def test_a_damaged_file_is_one_error_naming_it(stories_path, tmp_path, capsys, case):
    """LLM() raises ConfigError naming the damaged file; `kvledger generate` prints one error
    line naming it (the CLI in process: the same code path as the console script)."""
    from kvledger import LLM
    from kvledger.cli import main

    folder = tmp_path / "m"
    name = _damage(stories_path, folder, case)
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        LLM(str(folder))
    capsys.readouterr()
    assert main(["generate", str(folder), "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and err[0].startswith("kvledger: error:"), err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_truncated_weights_give_no_traceback_in_the_console_commands(stories_path, tmp_path, command):
    folder = tmp_path / "m"
    _damage(stories_path, folder, "safetensors truncated")
    args = ["--max-tokens", "2"] if command == "generate" else ["--port", "0"]
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", command, str(folder), *args],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert errors and "model.safetensors" in errors[-1], r.stderr[-2000:]
