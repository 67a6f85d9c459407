"""The embedded default model: the real stories260K shipped in the package, so `kvledger
generate` on a fresh clone prints the text Hugging Face transformers generates from the same
weights; `kvledger-tiny` stays reachable by name."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.model.default import embedded_model_path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
           "tokenizer_config.json", "special_tokens_map.json")  # fmt: skip


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_embedded_files_are_the_trained_stories260k(stories_path):
    folder = embedded_model_path()
    assert "MIT" in (folder / "README.md").read_text() and "karpathy" in (
        folder / "README.md"
    ).read_text()
    for name in SHIPPED:
        assert _sha(folder / name) == _sha(stories_path / name), name


def test_pyproject_ships_the_folder_as_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"kvledger.model.default" = ["stories260k/*"]' in text


def test_generate_with_no_model_prints_what_transformers_generates(stories_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "generate", "--max-tokens", "24", "--json",
         "--num-kv-blocks", "64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)["outputs"][0]
    tok = AutoTokenizer.from_pretrained(str(stories_path))
    hf = AutoModelForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32)
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=24, do_sample=False)
    expected = out[0, ids.shape[1] :].tolist()
    assert ours["prompt"] == "Once upon a time"
    assert ours["completions"][0]["token_ids"] == expected
    text = ours["completions"][0]["text"]
    assert text == tok.decode(expected, skip_special_tokens=True)
    assert sum(w.isalpha() for w in text.split()) >= 10  # words, not byte soup


def test_kvledger_tiny_is_still_a_named_choice():
    from kvledger.llm import build_engine_config
    from kvledger.model.tiny import default_model_path

    assert build_engine_config("kvledger-tiny").model == str(default_model_path())
    assert build_engine_config().model == str(embedded_model_path())
