"""The one place logits are changed before sampling (vLLM's semantics and order).

Per row, in vLLM v1's order: ``allowed_token_ids`` (everything else -inf), ``bad_words`` (the
last token of a banned sequence whose prefix the output just produced), ``min_tokens`` (EOS
and stop token ids -inf until then), ``logit_bias`` (added), then the penalties:
``repetition_penalty`` over prompt + output (a positive logit divided by it, a negative one
multiplied, as transformers' RepetitionPenaltyLogitsProcessor), ``frequency_penalty`` x the
token's count in the output and ``presence_penalty`` if it occurs there (OpenAI's formula).
Temperature, top-k/p and min-p come after, in the sampler. Logprobs stay those of the raw
model distribution (vLLM's default ``raw_logprobs``).

Everything is vectorised over the rows that need it: index lists and per-request [vocab]
tensors kept across steps (the penalty counts grow by one token per step), never a Python
loop over the vocabulary. A future hook (a grammar's token bitmask) belongs in
``process_logits`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """Per-sequence tensors the processors keep between steps (on the Request)."""

    prompt_mask: torch.Tensor | None = None  # [vocab] bool: tokens of the prompt
    output_counts: torch.Tensor | None = None  # [vocab] float: occurrences in the output
    num_counted: int = 0  # output tokens already in output_counts
    allowed_mask: torch.Tensor | None = None  # [vocab] bool: True = NOT allowed


def needs_processing(seq) -> bool:
    """Whether a sequence's logits differ from the raw ones before temperature."""
    params: SamplingParams = seq.sampling_params
    return bool(
        params.allowed_token_ids is not None
        or seq.bad_words_token_ids
        or params.min_tokens
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
    )


def process_logits(logits: torch.Tensor, rows: list[int], seqs: list) -> None:
    """Apply every processor in place to ``logits[rows]``; ``seqs[j]`` is row ``rows[j]``'s
    Request (prompt/output token ids, eos ids, its SamplingState)."""
    vocab = logits.shape[1]
    neg_inf = float("-inf")
    # allowed_token_ids
    allowed = [(r, s) for r, s in zip(rows, seqs) if s.sampling_params.allowed_token_ids is not None]
    if allowed:
        masks = torch.stack([_state(s, vocab, "allowed").allowed_mask for _, s in allowed])
        idx = torch.tensor([r for r, _ in allowed])
        logits[idx] = logits[idx].masked_fill(masks, neg_inf)
    # bad_words and min_tokens: a few (row, token) pairs each
    ban_r: list[int] = []
    ban_t: list[int] = []
    for r, s in zip(rows, seqs):
        p = s.sampling_params
        out = s.output_token_ids
        for word in s.bad_words_token_ids or ():
            k = len(word) - 1
            if k <= len(out) and (k == 0 or out[-k:] == word[:-1]):
                ban_r.append(r)
                ban_t.append(word[-1])
        if len(out) < p.min_tokens:
            stops = list(p.stop_token_ids)
            if not p.ignore_eos:
                stops += s.eos_token_ids
            ban_r += [r] * len(stops)
            ban_t += stops
    if ban_r:
        logits[ban_r, ban_t] = neg_inf
    # logit_bias
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    for r, s in zip(rows, seqs):
        for t, v in (s.sampling_params.logit_bias or {}).items():
            bias_r.append(r)
            bias_t.append(t)
            bias_v.append(v)
    if bias_r:
        logits[bias_r, bias_t] += torch.tensor(bias_v, dtype=logits.dtype)
    # penalties
    pen = [
        (r, s)
        for r, s in zip(rows, seqs)
        if s.sampling_params.repetition_penalty != 1.0
        or s.sampling_params.presence_penalty
        or s.sampling_params.frequency_penalty
    ]
    if pen:
        idx = torch.tensor([r for r, _ in pen])
        states = [_state(s, vocab, "penalties") for _, s in pen]
        counts = torch.stack([st.output_counts for st in states])
        x = logits[idx]
        rep = torch.tensor([s.sampling_params.repetition_penalty for _, s in pen], dtype=x.dtype)
        if bool((rep != 1.0).any()):
            seen = torch.stack([st.prompt_mask for st in states]) | (counts > 0)
            rep = rep.unsqueeze(1).expand_as(x)
            penalised = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(seen, penalised, x)
        freq = torch.tensor([s.sampling_params.frequency_penalty for _, s in pen], dtype=x.dtype)
        pres = torch.tensor([s.sampling_params.presence_penalty for _, s in pen], dtype=x.dtype)
        x = x - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(x.dtype)
        logits[idx] = x


def _state(seq, vocab: int, what: str) -> SamplingState:
    """The sequence's SamplingState, brought up to date for ``what``."""
    st = seq.sampling_state
    if st is None:
        st = seq.sampling_state = SamplingState()
    if what == "allowed":
        if st.allowed_mask is None:
            st.allowed_mask = torch.ones(vocab, dtype=torch.bool)
            st.allowed_mask[list(seq.sampling_params.allowed_token_ids)] = False
        return st
    if st.output_counts is None:
        st.prompt_mask = torch.zeros(vocab, dtype=torch.bool)
        st.prompt_mask[torch.tensor(seq.prompt_token_ids, dtype=torch.long)] = True
        st.output_counts = torch.zeros(vocab)
    new = seq.output_token_ids[st.num_counted :]
    if new:
        st.output_counts.index_add_(
            0, torch.tensor(new, dtype=torch.long), torch.ones(len(new))
        )
        st.num_counted += len(new)
    return st
