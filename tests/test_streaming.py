"""The SSE loop's rule for what makes a chunk (kvledger.server.streaming._advance)."""

from kvledger.outputs import CompletionOutput
from kvledger.server.streaming import _advance, _Delta


def _out(text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, ids, None, None, finish)


def test_tokens_whose_text_is_held_back_still_make_a_chunk():
    """vLLM's server sends a chunk for every output with new tokens, with empty text while a
    partial character or a forming stop string is held back; a client counting chunks, or
    timing the gaps between them, sees the same stream from kvledger."""
    d = _Delta()
    assert _advance(d, _out("", [7])) == ("", 0, False)  # held back: an empty chunk
    assert _advance(d, _out(" girl", [8])) == (" girl", 0, False)
    assert _advance(d, _out("", [])) is None  # nothing new at all: no chunk
    assert _advance(d, _out("", [9], "stop")) == ("", 5, True)  # offsets count the text sent
    assert _advance(d, _out("z", [1])) is None  # nothing after the finishing chunk
