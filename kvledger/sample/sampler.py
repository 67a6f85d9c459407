"""Logits -> tokens, with the per-request options of SamplingParams.

Logits are first changed by ``model.logits_processor.process_logits`` (penalties, biases,
masks; the one place for that) for the rows that ask for it. Greedy rows take the argmax
(exactly what HF's greedy search does). Random
rows are sampled with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which draws
from p exactly; a seeded request draws E from its own generator, so its tokens do not depend
on what else is in the batch. Logprobs are those of the raw model distribution (vLLM's
default ``raw_logprobs``), as vLLM's dicts: the sampled token (with its rank) and the top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.kernels import native
from kvledger.logprobs import Logprob
from kvledger.sample.logits_processor import needs_processing, process_logits
from kvledger.sampling_params import SamplingParams
from kvledger.structured.state import apply_bitmask, disallowed_rows, mask_threads


@dataclass
class SampleRequest:
    params: SamplingParams
    generator: torch.Generator | None
    seq: object | None = None  # the Request (token ids, eos ids) for the logits processors


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, vectorised over rows; returns probabilities."""
    temps = torch.tensor([max(p.temperature, 1e-5) for p in params], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        ranks = torch.arange(vocab).unsqueeze(0)
        mask = ranks >= k.unsqueeze(1)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
        probs_sorted = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        cum_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        mask |= cum_before >= top_p.unsqueeze(1)  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(
    logits: torch.Tensor,
    reqs: list[SampleRequest],
    default_generator: torch.Generator | None = None,
    bitmask: tuple[torch.Tensor, list[int]] | None = None,
) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """Sample one token per row of ``logits`` [N, vocab] (float32).

    ``bitmask``: the step's packed grammar mask and its constrained rows
    (kvledger.structured.state.fill_bitmask); their disallowed tokens get -inf in place
    before greedy and random sampling alike (and the logprobs are of the masked logits, as
    in vLLM).
    """
    n = logits.shape[0]
    lazy: list[int] = []  # greedy constrained rows without logprobs: masked only if needed
    if bitmask is not None:
        mask, rows = bitmask
        eager = []
        for i in rows:
            p = reqs[i].params
            (lazy if p.greedy and p.logprobs is None else eager).append(i)
        if eager:
            apply_bitmask(logits, (mask, eager))
    raw = logits
    proc_rows = [i for i, r in enumerate(reqs) if r.seq is not None and needs_processing(r.seq)]
    if proc_rows:  # penalties, biases, masks: on a copy, so that logprobs stay raw
        logits = logits.clone()
        process_logits(logits, proc_rows, [reqs[i].seq for i in proc_rows])
    tokens = _argmax(logits)
    if lazy:
        # The unmasked argmax is the masked one whenever the grammar allows it (masking only
        # lowers other tokens to -inf; ties keep the first index): mask and redo only the rows
        # whose argmax the grammar forbids. Penalties and biases keep -inf at -inf, so masking
        # after them equals masking before.
        bad = disallowed_rows(mask, lazy, tokens)
        if bad:
            fixed = native.masked_argmax(logits, mask, bad, mask_threads())  # all-zero words skipped
            if fixed is None:
                apply_bitmask(logits, (mask, bad))
                fixed = logits[bad].argmax(dim=-1)
            tokens[bad] = fixed
    rand_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rand_rows:
        probs = apply_filters(logits[rand_rows], [reqs[i].params for i in rand_rows])
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rand_rows) if reqs[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(
                generator=default_generator
            )
        for j, i in enumerate(rand_rows):
            if reqs[i].generator is not None:
                noise[j].exponential_(generator=reqs[i].generator)
        tokens[rand_rows] = _argmax(probs / noise)
    token_list = tokens.tolist()
    logprobs: list[dict[int, Logprob] | None] = [None] * n
    want: dict[int, list[int]] = {}  # number of alternatives -> rows
    for i, r in enumerate(reqs):
        if r.params.logprobs is not None:
            want.setdefault(r.params.logprobs, []).append(i)
    for k, rows in want.items():
        lp = raw[rows].log_softmax(dim=-1)
        for i, d in zip(rows, make_logprobs(lp, [token_list[i] for i in rows], k)):
            logprobs[i] = d
    return token_list, logprobs


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), by the native kernel where it runs: the same indices, a decode step's
    [56, 32000] logits in 0.11 ms instead of 1.57 (docs/measurements/cpu_kernels.md, the argmax
    section)."""
    out = native.argmax_rows(x)
    return x.argmax(dim=-1) if out is None else out


def make_logprobs(
    row_logprobs: torch.Tensor, token_ids: list[int], num_top: int
) -> list[dict[int, Logprob]]:
    """Per row: {chosen token: its Logprob (rank among the vocabulary), then the top
    ``num_top`` (-1: the whole vocabulary) by rank}, as vLLM returns them."""
    rows, vocab = row_logprobs.shape
    k = vocab if num_top < 0 else min(num_top, vocab)
    ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
    chosen = row_logprobs.gather(1, ids)
    ranks = ((row_logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in range(rows)]
    top_idx: list[list[int]] = [[] for _ in range(rows)]
    if k:
        vals, idx = row_logprobs.topk(k, dim=-1)
        top_vals, top_idx = vals.tolist(), idx.tolist()
    out = []
    for j, t in enumerate(token_ids):
        d = {t: Logprob(chosen_list[j], ranks[j])}
        for r, (i, v) in enumerate(zip(top_idx[j], top_vals[j]), start=1):
            if i != t:
                d[i] = Logprob(v, r)
        out.append(d)
    return out
