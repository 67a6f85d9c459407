"""Raw JSON text in, canonical JSON text out, as the characters arrive.

A streamed tool call's arguments must add up to exactly the arguments the non-streamed
response carries, which are ``json.dumps(json.loads(raw), ensure_ascii=False)`` of what the
model wrote. This re-spells the model's JSON the same way one character at a time: whitespace
outside strings dropped, ``", "`` and ``": "`` separators, string escapes re-encoded, numbers
re-printed once they end. It emits only what later characters cannot change. (A duplicated key,
which ``json.loads`` collapses, is the one thing it cannot foresee.)
"""

from __future__ import annotations

import json

_WS = " \t\n\r"
_NUMBER = "0123456789+-.eE"
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _enc(ch: str) -> str:
    """One decoded character as json.dumps(ensure_ascii=False) writes it inside a string."""
    return json.dumps(ch, ensure_ascii=False)[1:-1]


class JsonCanonicalizer:
    def __init__(self) -> None:
        self._in_str = False
        self._esc: str | None = None  # an escape being read, from its backslash
        self._high: int | None = None  # a \\uD8xx waiting for its low surrogate
        self._num = ""  # a number being read

    def feed(self, text: str) -> str:
        return "".join(self._char(c) for c in text)

    def flush(self) -> str:
        """The end of the value: a number still open is complete now."""
        return self._end_number()

    def _end_number(self) -> str:
        num, self._num = self._num, ""
        if not num:
            return ""
        try:
            return json.dumps(json.loads(num))
        except ValueError:
            return num

    def _char(self, c: str) -> str:
        if self._in_str:
            return self._string_char(c)
        if self._num:
            if c in _NUMBER:
                self._num += c
                return ""
            return self._end_number() + self._char(c)
        if c in _WS:
            return ""
        if c == '"':
            self._in_str = True
            return c
        if c == "-" or c.isdigit():
            self._num = c
            return ""
        if c == ",":
            return ", "
        if c == ":":
            return ": "
        return c

    def _string_char(self, c: str) -> str:
        out = ""
        if self._esc is None:
            if self._high is not None and c != "\\":
                out, self._high = _enc(chr(self._high)), None  # a lone high surrogate
            if c == "\\":
                self._esc = c
                return out
            if c == '"':
                self._in_str = False
                return out + c
            return out + _enc(c)
        self._esc += c
        esc = self._esc
        if esc[1] != "u":
            self._esc = None
            decoded = _SIMPLE_ESCAPES.get(esc[1], esc[1])
            return self._flush_high() + _enc(decoded)
        if len(esc) < 6:
            return ""
        self._esc = None
        try:
            code = int(esc[2:], 16)
        except ValueError:
            return self._flush_high() + esc
        if self._high is not None and 0xDC00 <= code < 0xE000:
            pair = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
            return _enc(chr(pair))
        out = self._flush_high()
        if 0xD800 <= code < 0xDC00:
            self._high = code
            return out
        return out + _enc(chr(code))

    def _flush_high(self) -> str:
        if self._high is None:
            return ""
        out, self._high = _enc(chr(self._high)), None
        return out
