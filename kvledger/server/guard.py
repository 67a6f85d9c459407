"""The ASGI guard in front of the app: API keys on /v1/* and on the unversioned pooling routes
(/classify, /score, /rerank, /v2/rerank, /pooling: vLLM leaves them open, kvledger does not),
then the body-size limit, before any parsing. The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients, vLLM) or as
``x-api-key: <key>`` (Anthropic's clients)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvledger.server.errors import error_for

KEYED_PREFIXES = ("/v1", "/v2/", "/classify", "/score", "/rerank", "/pooling")


class Guard:
    """ASGI middleware: the API key on /v1/*, then the body-size limit, before any parsing."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes

    def _key_ok(self, key: bytes) -> bool:
        ok = False
        for k in self.api_keys:  # compare with every key: the time says nothing about which
            ok |= hmac.compare_digest(key, k)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.api_keys and path.startswith(KEYED_PREFIXES) and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            scheme, _, key = auth.partition(b" ")
            x_key = headers.get(b"x-api-key")
            bearer_ok = scheme.lower() == b"bearer" and self._key_ok(key.strip())
            if not bearer_ok and not (x_key is not None and self._key_ok(x_key.strip())):
                msg = "missing API key" if not auth and x_key is None else "incorrect API key"
                resp = error_for(
                    path, 401, f"{msg}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key",
                )  # fmt: skip
                await resp(scope, receive, send)
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            too_big = error_for(
                path,
                413,
                f"request body is larger than the server's limit of {self.max_body_bytes} bytes",
                code="request_too_large",
            )
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await too_big(scope, receive, send)
                return
            # Read the body here (within the limit) and replay it to the app.
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_body_bytes:
                    await too_big(scope, receive, send)
                    return
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # later calls report the disconnect

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)
