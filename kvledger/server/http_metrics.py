"""Per-endpoint HTTP metrics under the names vLLM's server exports through
prometheus-fastapi-instrumentator: ``http_requests_total{handler, method, status}`` (status
grouped as 2xx / 4xx / 5xx) and ``http_request_duration_seconds{handler, method}``, so a
dashboard built on vLLM's per-route panels reads kvledger's unchanged.

``handler`` is the route's path template (``/v1/completions``), "none" for a path no route serves
(the instrumentator's grouping of untemplated paths). The duration runs to the response's last
byte: for a stream, its whole length. An ASGI middleware, so 401s from the key guard and 413s
from the body limit are counted too.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The instrumentator's default latency buckets (vLLM keeps them).
_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)


class HTTPMetrics:
    def __init__(self, app: ASGIApp, registry, routes=None) -> None:
        self.app = app
        self.routes = routes  # the application's routes (read at each request: mounted later)
        self.requests = Counter(
            "http_requests", "Total number of requests by method, status and handler.",
            ["method", "status", "handler"], registry=registry,
        )  # fmt: skip
        self.duration = Histogram(
            "http_request_duration_seconds", "Latency with only few buckets by handler.",
            ["method", "handler"], buckets=_BUCKETS, registry=registry,
        )  # fmt: skip

    def _handler(self, scope: Scope) -> str:
        for route in self.routes() if self.routes else ():
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path", "none")
        return "none"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            handler, method = self._handler(scope), scope["method"]
            self.requests.labels(method, f"{status[0] // 100}xx", handler).inc()
            self.duration.labels(method, handler).observe(time.perf_counter() - t0)
