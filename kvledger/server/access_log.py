"""Credentials never reach the access log: uvicorn logs each request's path with its query
string, and `/dashboard?key=sk-...` (a browser cannot send a header when it navigates) would
write the API key into every log line and every log shipper behind it."""

from __future__ import annotations

import logging
import re

# Query parameters that carry a credential, by the names clients use.
# A query name is a credential when it is one of these words, alone or after a prefix joined by
# "_", "-" or "." (api_key, x-api-key, refresh_token, client_secret, auth.token), or apikey /
# accesstoken: not "monkey" or "tokens_per_s".
_NAMES = r"(?:[\w.-]*[_.-])?(?:key|apikey|token|accesstoken|secret|password|passwd|pwd|auth|authorization|credentials?|sig|signature|session)"
_SECRET = re.compile(rf"([?&]{_NAMES}=)[^&#\s]*", re.I)


def redact(url: str) -> str:
    """The URL with every credential-like query value replaced by ``***``."""
    return _SECRET.sub(r"\1***", url)


class RedactCredentials(logging.Filter):
    """On ``uvicorn.access``: its record's args are (client, method, path?query, http, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact(args[2]), *args[3:])
        return True


def install() -> None:
    """Once uvicorn has configured its loggers (its Config does on construction)."""
    log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactCredentials) for f in log.filters):
        log.addFilter(RedactCredentials())
