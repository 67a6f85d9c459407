"""kvledger's reranking (a cross-encoder on the pooling runner) vs transformers' batched
``AutoModelForSequenceClassification``, one run, same folder, same token ids (issue 45).

The model: the ``bench-30m`` random-weight Llama (31.4M params) as a one-label
LlamaForSequenceClassification (its ``score`` row is the LM head's row of one token, as a
reranker shipped as a causal LM would be served), float32, CPU. The workload: ``--queries``
queries of ``--query-len`` tokens, each against ``--docs`` documents of 32-224 tokens (a
reranking call each): the prompt is BOS + query + document. transformers runs each query's
documents in batches of ``--batch-size``, right-padded (it pools the last non-pad token);
kvledger gets all pairs in one ``LLM.classify`` call (one label: the sigmoid, as ``score``),
its prefix cache sharing each query's full blocks. Scores are compared pair by pair.

    python -m benchmarks.rerank
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.common import BENCH_OUT, ensure_model, print_header


def build_reranker(src: Path, token: int = 5) -> Path:
    """bench-30m as a one-label classifier whose score row is lm_head[token] (cached)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

    dst = BENCH_OUT / "models" / f"{src.name}-rerank"
    if (dst / "config.json").is_file():
        return dst
    lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = lm.config
    cfg.num_labels, cfg.architectures = 1, ["LlamaForSequenceClassification"]
    cls = LlamaForSequenceClassification(cfg).eval()
    cls.model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():
        cls.score.weight.copy_(lm.lm_head.weight[token : token + 1])
    cls.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def workload(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(a.seed)
    prompts = []
    for _ in range(a.queries):
        query = [rng.randrange(3, 32000) for _ in range(a.query_len)]
        for _ in range(a.docs):
            prompts.append([1, *query, *(rng.randrange(3, 32000) for _ in range(rng.randint(32, 224)))])
    return prompts


def run_hf(path: Path, prompts: list[list[int]], a: argparse.Namespace) -> tuple[float, list[float]]:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    model.config.pad_token_id = 0
    scores: list[float] = []
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), a.batch_size):
            batch = prompts[i : i + a.batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
            mask = (ids != 0).long()
            scores += model(input_ids=ids, attention_mask=mask).logits[:, 0].sigmoid().tolist()
    return time.perf_counter() - t, scores


def run_kvledger(path: Path, prompts: list[list[int]]) -> tuple[float, list[float], int]:
    from kvledger import LLM

    llm = LLM(str(path), runner="pooling", calibrate_preemption=False)
    t = time.perf_counter()
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    wall = time.perf_counter() - t
    hits = llm.ledger().prefix_cache_hits
    llm.llm_engine.shutdown()
    return wall, [o.outputs.probs[0] for o in outs], hits


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvledger rerank vs transformers batched classification")
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--docs", type=int, default=32, help="documents per query")
    ap.add_argument("--query-len", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=16, help="transformers' batch")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print_header("rerank: kvledger LLM.classify (cross-encoder) vs transformers, bench-30m, float32")
    path = build_reranker(ensure_model("bench-30m"))
    prompts = workload(a)
    tokens = sum(map(len, prompts))
    print(f"workload: {a.queries} queries x {a.docs} documents = {len(prompts)} pairs, {tokens} tokens")
    hf_s, hf_scores = run_hf(path, prompts, a)
    kv_s, kv_scores, hits = run_kvledger(path, prompts)
    diff = max(abs(x - y) for x, y in zip(hf_scores, kv_scores))
    rows = [("transformers", hf_s), ("kvledger", kv_s)]
    for name, s in rows:
        print(f"{name:>12}: {s:7.2f} s  {len(prompts) / s:8.1f} pairs/s  {tokens / s:9.0f} prompt tok/s")
    print(f"ratio kvledger / transformers (pairs/s) = {hf_s / kv_s:.2f}x; "
          f"kvledger prefix-cache hit tokens {hits}; max |score diff| {diff:.2e}")  # fmt: skip
    out = BENCH_OUT / "rerank"
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(
        {"pairs": len(prompts), "tokens": tokens, "hf_s": hf_s, "kvledger_s": kv_s, "prefix_hits": hits,
         "max_abs_diff": diff}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
