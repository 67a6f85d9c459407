"""Incremental detokenization: each sequence's tokens are decoded once, as they arrive.

Decoding the whole output at every step costs O(n) per token (O(n^2) per request). Here a
per-sequence detokenizer is fed each new token once and appends the text it adds:

* with a fast tokenizer, the ``tokenizers`` library's ``DecodeStream``, primed with the end of
  the prompt so that the first generated token keeps the space that belongs to it
  (" saw" after "They", not "saw"); it holds back partial UTF-8 characters (byte fallback,
  byte-level BPE) until they are complete;
* otherwise a sliding-window decode (the prefix/read offsets of HF's ``TextStreamer`` and
  vLLM's slow path), which only ever decodes a few tokens.

Either way ``prompt + output_text == tokenizer.decode(prompt_ids + output_ids)`` (special
tokens aside). Stop strings are searched only in the newly added text plus the overlap a stop
string can span, and streams get the text the stop-string holdback lets out (vLLM's
``stop_buffer_length``), so the chunks of a stream always add up to the final text.
"""

from __future__ import annotations

import io

from kvledger.sampling_params import SamplingParams

_PRIME_TOKENS = 6  # prompt tokens replayed into a new stream: enough for any leading-space rule
_WINDOW = 6  # tokens of context the slow path decodes before the unread ones


class IncrementalDetokenizer:
    """Text bookkeeping shared by every backend; on its own (no tokenizer) it yields no text."""

    def __init__(self, params: SamplingParams) -> None:
        # The text so far. A str attribute grown with += is copied whole on every token (CPython
        # appends in place only to local variables), O(n) per token at long outputs; a StringIO
        # appends in amortised O(1) and reads a tail in O(tail), so only a cumulative or final
        # output pays for the whole text.
        self._text = io.StringIO()
        self._len = 0
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.num_output_tokens = 0
        # While unfinished a stream withholds the chars a stop string might still claim.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self._sent_chars = 0  # what get_next_output_text(delta=True) has handed out
        self._done = False  # finished, or cut at a stop string: no more text

    @staticmethod
    def new(tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """The best detokenizer this tokenizer allows (None: token ids only, no text)."""
        if tokenizer is None:
            return IncrementalDetokenizer(params)
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is not None:
            try:
                from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
            except ImportError:
                backend = None
        if backend is not None:
            return FastIncrementalDetokenizer(tokenizer, backend, prompt_token_ids, params)
        return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, params)

    # -- backends override these two ------------------------------------------------------------
    def decode_next(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the very end)."""
        return ""

    # -- the per-step update -----------------------------------------------------------------------
    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append the text of ``new_token_ids``; return the stop string they completed, if any.

        ``stop_terminated``: the last token already ended the request (EOS or a stop token id);
        as in vLLM its text is left out unless ``include_stop_str_in_output``.
        """
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            new_token_ids = new_token_ids[:-1]
            self.num_output_tokens += 1
        check_from = self._len
        for t in new_token_ids:
            self._append(self.decode_next(t))
            self.num_output_tokens += 1
            if self.num_output_tokens <= self.min_tokens:
                check_from = self._len  # text before min_tokens never stops
        if not self.stop or self._len == check_from:
            return None
        return self._check_stop_strings(check_from)

    def finish(self) -> None:
        """The sequence ended: let out any held-back bytes (none after a stop string)."""
        if not self._done:
            self._done = True
            self._append(self.flush())

    @property
    def output_text(self) -> str:
        """The whole text so far (a copy: O(length))."""
        return self._text.getvalue()

    def _append(self, piece: str) -> None:
        # The stream's position is always the end (_len): writes, _tail's read() and the stop
        # cut's truncate all leave it there, so appending needs no seek.
        if piece:
            self._text.write(piece)
            self._len += len(piece)

    def _tail(self, start: int) -> str:
        """The text from character ``start`` on, in O(len - start)."""
        self._text.seek(start)
        return self._text.read()

    def _check_stop_strings(self, check_from: int) -> str | None:
        # Only the new text, plus the chars before it that a stop string can span.
        start = max(0, check_from - max(len(s) for s in self.stop) + 1)
        window, hits = self._tail(start), []
        for s in self.stop:
            i = window.find(s, max(0, check_from - len(s) + 1) - start)
            if i >= 0:
                hits.append((start + i, s))
        if not hits:
            return None
        pos, stop = min(hits)  # the earliest match wins
        self._done = True
        self._len = pos + (len(stop) if self.include_stop_str_in_output else 0)
        self._text.seek(self._len)
        self._text.truncate()
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text so far, or (``delta``) what is new since the last call."""
        buf = 0 if finished else self.stop_buffer_length
        end = self._len - buf
        if not delta:
            return self.output_text[:end] if buf else self.output_text
        start = self._sent_chars
        if start >= end:
            return ""
        self._sent_chars = end
        return self._tail(start)[: end - start]


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """``tokenizers.decoders.DecodeStream`` over the fast tokenizer's backend."""

    def __init__(self, tokenizer, backend, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(params)
        self.backend = backend
        self.skip_special_tokens = params.skip_special_tokens
        prime = list(prompt_token_ids[-_PRIME_TOKENS:])
        self.stream = _primed_stream(backend, prime, self.skip_special_tokens)
        self._ids = prime  # context for flush()
        self._pending = 0  # tokens fed since the stream last produced text
        # vLLM: without spaces between special tokens, consecutive added tokens are joined raw.
        self.added_token_ids: dict[int, str] | None = None
        self._last_special = False
        if not (self.skip_special_tokens or params.spaces_between_special_tokens):
            added = {t: tok.content for t, tok in tokenizer.added_tokens_decoder.items()}
            self.added_token_ids = added or None

    def decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        try:
            piece = self.stream.step(self.backend, token_id)
        except Exception:  # a token id the decoder cannot place: restart the stream after it
            self.stream = _primed_stream(
                self.backend, self._ids[-_PRIME_TOKENS:], self.skip_special_tokens
            )
            piece = None
        if self.added_token_ids is not None:
            special = self.added_token_ids.get(token_id)
            if special is not None and self._last_special:
                piece = special
            self._last_special = special is not None
        if piece is None:
            self._pending += 1
            return ""
        self._pending = 0
        return piece

    def flush(self) -> str:
        if not self._pending:
            return ""
        ctx = self._ids[-(self._pending + _WINDOW) : -self._pending]
        skip = self.skip_special_tokens
        whole = self.backend.decode(ctx + self._ids[-self._pending :], skip_special_tokens=skip)
        before = self.backend.decode(ctx, skip_special_tokens=skip)
        self._pending = 0
        return whole[len(before) :] if whole.startswith(before) else whole


def _primed_stream(backend, ids: list[int], skip_special_tokens: bool):
    """A DecodeStream that has seen ``ids`` (their text is not output)."""
    from tokenizers.decoders import DecodeStream

    try:
        return DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no prefill argument, so replay the ids
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for t in ids:
            stream.step(backend, t)
        return stream


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Any tokenizer with ``decode``: decode a short window and keep what it adds."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(params)
        self.tokenizer = tokenizer
        self.kwargs = {
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
        }
        self._ids = list(prompt_token_ids[-_WINDOW:])
        self._prefix = 0  # start of the context window in _ids
        self._read = len(self._ids)  # tokens before this have produced their text

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids, **self.kwargs)
        except TypeError:  # a tokenizer without spaces_between_special_tokens
            return self.tokenizer.decode(ids, skip_special_tokens=self.kwargs["skip_special_tokens"])

    def decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""  # nothing yet, or an incomplete character: wait for more tokens
        new = text[len(prefix) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 4 * _WINDOW:  # keep the list short: only the window is ever read
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new

    def flush(self) -> str:
        return self._advance(final=True) if self._read < len(self._ids) else ""
