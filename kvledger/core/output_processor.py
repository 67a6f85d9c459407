"""Tokens -> what a caller sees: logprob text, incremental text, stop strings, RequestOutputs.

The scheduler's ``update_from_output`` appends each sampled token and applies the token-level
stops; what needs the tokenizer happens here (vLLM v1's OutputProcessor): the logprobs'
``decoded_token``, the detokenized text (one ``IncrementalDetokenizer`` per sequence, each new
token decoded once), stop strings searched in the new text only, and the ``RequestOutput`` of
each user request (one sequence, or n > 1 forked ones), cumulative, DELTA or FINAL_ONLY.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.core.request import Request
from kvledger.logprobs import Logprob
from kvledger.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvledger.sampling_params import RequestOutputKind


@dataclass
class RequestGroup:
    """A user request: one sequence, or n > 1 forked sequences sharing a prompt."""

    request_id: str
    prompt: str | None
    seqs: list[Request]
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs

    def decode_logprobs(self, d: dict[int, Logprob]) -> None:
        """Fill each Logprob's ``decoded_token`` (the token's text alone, cached by id)."""
        tok = self.tokenizer
        if tok is None:
            return
        cache = self._token_text
        for t, lp in d.items():
            text = cache.get(t)
            if text is None:
                text = cache[t] = tok.decode([t])
            lp.decoded_token = text

    def process_token(
        self, req: Request, lp: dict[int, Logprob] | None, index: int = -1, last: bool = True
    ) -> str | None:
        """The new token's logprobs and text; returns the stop string it completed, if any
        (the caller finishes the request). ``index``: the token's place in the output;
        ``last``: no token after it this step (only the last one can have ended the request)."""
        token = req.output_token_ids[index]
        if lp is not None:
            self.decode_logprobs(lp)
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[token].logprob
        # Each token is detokenized once; stop strings are searched in the new text only.
        stop_terminated = last and req.is_finished and req.finish_reason == "stop"
        return req.detokenizer.update([token], stop_terminated)

    def process_tokens(self, req: Request, lps: list[dict[int, Logprob] | None]) -> str | None:
        """Several tokens appended in one step (speculative decoding: accepted drafts and the
        token after them), in order, as if each had come alone: at the first stop string the
        tokens after it are dropped, so the output is what decoding one by one would give."""
        m = len(lps)
        start = req.num_output_tokens - m
        for j, lp in enumerate(lps):
            stop = self.process_token(req, lp, start + j, j == m - 1)
            if stop is not None:
                drop = m - j - 1
                if drop:
                    del req.output_token_ids[-drop:]
                    del req.all_token_ids[-drop:]
                    req.num_new_tokens -= drop
                return stop
        return None

    @staticmethod
    def make_output(group: RequestGroup) -> RequestOutput:
        """The group's output now: cumulative, or (DELTA) only what is new since the last one.

        O(new tokens) per call for DELTA: no whole-output decode or copy.
        """
        first = group.seqs[0]
        if first.pooling_params is not None:
            from kvledger.pooling.requests import make_pooling_output

            return make_pooling_output(group)  # type: ignore[return-value]
        delta = first.sampling_params.output_kind is RequestOutputKind.DELTA
        completions = []
        for seq in group.seqs:
            p = seq.sampling_params
            finished = seq.is_finished
            if finished:
                seq.detokenizer.finish()
            if delta:
                start = seq.num_sent_tokens
                new = start < seq.num_output_tokens or (finished and not seq.finish_sent)
                if not (new or group.finished):  # the last output lists every sequence
                    continue
                seq.num_sent_tokens, seq.finish_sent = seq.num_output_tokens, finished
                token_ids = seq.output_token_ids[start:]
                lps = seq.logprobs[start:] if p.logprobs is not None else None
            else:
                token_ids = list(seq.output_token_ids)
                lps = list(seq.logprobs) if p.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.get_next_output_text(finished, delta),
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob if lps is not None else None,
                    logprobs=lps,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_lps = None
        if first.sampling_params.prompt_logprobs is not None and not (
            delta and group.prompt_logprobs_sent
        ):
            prompt_lps = [None, *first.prompt_logprobs]
            group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=first.prompt_token_ids,  # never mutated: shared, not copied
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=prompt_lps,
            metrics=RequestMetrics(
                arrival_time=first.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=first.first_token_time,
                last_token_time=first.last_token_time,
                finished_time=first.finished_time,
                num_preemptions=sum(s.num_preemptions for s in group.seqs),
                num_generation_tokens=sum(s.num_output_tokens for s in group.seqs),
            ),
        )

    def collect(
        self, groups: dict[str, RequestGroup], touched: set[str], stream: bool
    ) -> list[RequestOutput]:
        """Outputs of the touched groups (finished ones leave ``groups``); ``stream``: every
        updated group reports, not only finished ones (FINAL_ONLY still waits)."""
        outs = []
        for gid in touched:
            group = groups.get(gid)
            if group is None:
                continue
            if group.finished:
                del groups[gid]
            elif not stream or group.seqs[0].sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outs.append(self.make_output(group))
        return outs
