"""A small Llama trained for a minute or two on synthetic copy-with-edits tasks, and the
copy-heavy workload it serves (benchmarks/spec_decode.py ``--workload copy``)::

    python -m benchmarks.copy_model            # builds <cache dir>/models/copy-llama-v1 once
    python -m benchmarks.copy_model --force    # rebuild (same seed: the same weights on this machine)

A task quotes a "document" and asks for it back with one word replaced::

    <s> Document: d1 d2 ... dn \\n Replace: a -> b \\n Rewrite: d1 ... b ... dn </s>

The document is ``n`` distinct tokens of stories260k's tokenizer (its real BPE vocabulary of
512, so the folder is a real HF Llama with a real tokenizer), ``a`` one of them, ``b`` a token
not in it. The answer overlaps the prompt except at the edit: what prompt-lookup speculation
was made for (issue 43 asks >= 2.5x there). Why this model rather than stories260k: stories260k
cannot copy a quoted text, so no workload on it overlaps its prompt. Why random distinct tokens
rather than prose: a two-minute model learns an induction head (copy what followed the current
token in the document) but not a language; distinct tokens make the copy unambiguous.

The model: 2 layers x 128, 4 heads of 32, tied embeddings, float32, trained with AdamW on
fresh random tasks of 16-48 tokens (no data set), loss on the rewrite only; the workload's
documents are 32-48 tokens (see LO, HI). Training prints the exact-answer
rate on held-out tasks at the end (written to the folder's ``training.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
NAME = "copy-llama-v1"
SEED = 0
BOS, EOS = 1, 2
FIRST_ID = 3  # ids below are <unk>, <s>, </s>
# Document lengths of training and of the workload (32..HI): a two-layer model trained for
# minutes copies at the lengths it saw (~75 % of tokens at 16-64 after 500 steps), not longer
# ones (5 % at 100-160), so the workload stays inside the trained range.
LO, HI = 16, 48


def default_path() -> Path:
    from kvledger import envs

    return Path(envs.KVLEDGER_CACHE_DIR) / "models" / NAME


def _markers() -> dict[str, list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(STORIES / "tokenizer.json"))

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    return {"doc": enc("Document:"), "rep": enc("\nReplace:"), "arrow": enc(" ->"), "rw": enc("\nRewrite:")}


def make_task(rng: random.Random, n: int, marks: dict[str, list[int]], vocab: int = 512):
    """(prompt ids, answer ids incl. EOS): the document, the edit, the rewritten document."""
    ids = rng.sample(range(FIRST_ID, vocab), n + 1)
    doc, b = ids[:n], ids[n]
    a_pos = rng.randrange(n)
    a = doc[a_pos]
    prompt = [BOS, *marks["doc"], *doc, *marks["rep"], a, *marks["arrow"], b, *marks["rw"]]
    answer = [b if t == a else t for t in doc] + [EOS]
    return prompt, answer


def copy_prompts(num: int, seed: int = 1234, lo: int = 32, hi: int = HI):
    """The benchmark's workload: ``num`` tasks (held out from training: another seed)."""
    rng, marks = random.Random(seed), _markers()
    return [make_task(rng, rng.randint(lo, hi), marks) for _ in range(num)]


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=BOS,
        eos_token_id=EOS, torch_dtype="float32",
    )  # fmt: skip


def train(out: Path, steps: int, batch: int, threads: int, lo: int = LO, hi: int = HI) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(threads)
    rng, marks = random.Random(SEED), _markers()
    model = LlamaForCausalLM(_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    t0, log = time.perf_counter(), []
    model.train()
    for step in range(steps):
        tasks = [make_task(rng, rng.randint(lo, hi), marks) for _ in range(batch)]
        length = max(len(p) + len(a) for p, a in tasks)
        ids = torch.full((batch, length), EOS, dtype=torch.long)
        labels = torch.full((batch, length), -100, dtype=torch.long)
        for i, (p, a) in enumerate(tasks):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            log.append((step, round(loss.item(), 4), round(time.perf_counter() - t0, 1)))
            print(f"step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / f, out / f)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    exact = _exact_rate(model, copy_prompts(20, seed=99))
    info = {"steps": steps, "batch": batch, "threads": threads, "train_seconds": round(train_s, 1),
            "loss_log": log, "held_out_exact_answers": exact}  # fmt: skip
    (out / "training.json").write_text(json.dumps(info, indent=1))
    return info


def _exact_rate(model, tasks) -> float:
    """Held-out tasks whose greedy answer (HF generate) is exactly the right rewrite."""
    import torch

    ok = 0
    with torch.no_grad():
        for p, a in tasks:
            out = model.generate(torch.tensor([p]), max_new_tokens=len(a), do_sample=False)
            ok += out[0, len(p) :].tolist() == a
    return ok / len(tasks)


def ensure(path: Path | None = None, force: bool = False, **kw) -> Path:
    path = path or default_path()
    if force or not (path / "model.safetensors").is_file():
        train(path, **kw)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help=f"folder (default <cache>/models/{NAME})")
    ap.add_argument("--steps", type=int, default=3000, help="training steps")
    ap.add_argument("--batch", type=int, default=16, help="tasks per step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--force", action="store_true", help="retrain even if the folder exists")
    a = ap.parse_args()
    path = ensure(a.out, a.force, steps=a.steps, batch=a.batch, threads=a.threads)
    print(f"{path}: {json.loads((path / 'training.json').read_text())['held_out_exact_answers']:.0%} "
          "of 20 held-out tasks answered exactly (greedy)")


if __name__ == "__main__":
    main()
