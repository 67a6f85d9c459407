"""The live dashboard: ``GET /dashboard`` (one static page) and ``GET /dashboard/data`` (JSON).

Kept apart from the API routes: ``mount_dashboard`` is the whole hook into the app. A frame is
captured by the engine between steps (the named query ``dashboard_frame``), so the block map,
the totals and the request table describe one instant; only list copies happen there, the map's
cells are built in a worker thread. Frames are plain JSON (and the raw pool state plain lists),
so they cross the boundary to an engine core process unchanged. A sampler keeps the last minutes of a cheap time series (KV
usage, queues, generated tokens, preemptions) from the server's start, whether or not a page is
open. The API key rules are those of ``/v1/*``; a browser cannot send a header when it
navigates, so the dashboard also takes the key as ``?key=`` once: it answers with an HttpOnly,
SameSite=Strict cookie (a MAC of the key, never the key) and a redirect to the bare URL, and the
page and its data requests are then authenticated by the cookie. The cookie opens the dashboard
only, never the API. The access log redacts the key (``server/access_log.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from kvledger.errors import EngineDeadError
from kvledger.ledger.block_map import build_block_map
from kvledger.ledger.frame import SeriesHistory
from kvledger.server.page import render_page
from kvledger.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("kvledger.server")

SAMPLE_INTERVAL_S = 0.5
HISTORY_S = 300  # the charts' window: the last five minutes
# Everything the page needs is inline; the browser may fetch nothing but this server's JSON.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:"
)


def _unauthorized(message: str) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type="invalid_request_error", code="invalid_api_key")
    )
    return JSONResponse(body.model_dump(), status_code=401)


COOKIE = "kvledger_dashboard"


def _cookie_token(api_key: str, secret: bytes) -> str:
    """What the dashboard's cookie holds: a MAC of the key under a per-process secret, so the
    key itself is never stored by the browser and a restart invalidates every cookie."""
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


def _check_key(request: Request, api_key: str | None, secret: bytes) -> JSONResponse | None:
    if api_key is None:
        return None
    cookie = request.cookies.get(COOKIE)
    if cookie is not None and hmac.compare_digest(cookie.encode(), _cookie_token(api_key, secret).encode()):
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode()):
        return None
    query = request.query_params.get("key")
    if query is not None and hmac.compare_digest(query.encode(), api_key.encode()):
        return None
    given = auth or query is not None or cookie is not None
    msg = "incorrect API key" if given else "missing API key"
    return _unauthorized(f"{msg}: open /dashboard?key=<key>, or send 'Authorization: Bearer <key>'")


def mount_dashboard(
    app: FastAPI, aengine: Any, model_name: str, api_key: str | None
) -> None:
    """Add the dashboard's routes and its sampler to ``app``."""
    history = SeriesHistory(maxlen=int(HISTORY_S / SAMPLE_INTERVAL_S))
    reference_bpt = aengine.info.reference_bytes_per_token
    router = APIRouter()

    secret = secrets.token_bytes(32)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request):
        denied = _check_key(request, api_key, secret)
        if denied is not None:
            return denied
        if api_key is not None and "key" in request.query_params:
            # Opened with ?key=: trade it for a cookie and drop it from the address bar (and
            # from the history, bookmarks and Referer headers that would keep it).
            redirect = RedirectResponse(str(request.url.remove_query_params("key")), status_code=303)
            redirect.set_cookie(
                COOKIE, _cookie_token(api_key, secret), httponly=True, samesite="strict",
                path=request.scope.get("root_path", "") + "/dashboard",
                secure=request.url.scheme == "https",
            )  # fmt: skip
            return redirect
        return HTMLResponse(
            render_page(),
            headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"},
        )

    @router.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request, since: float | None = None):
        denied = _check_key(request, api_key, secret)
        if denied is not None:
            return denied
        frame, pool = await aengine.query("dashboard_frame", reference_bpt)
        frame["block_map"] = await asyncio.to_thread(build_block_map, pool)
        frame["ledger"]["model"] = model_name
        frame["ledger"]["max_model_len"] = aengine.info.max_model_len
        return JSONResponse(
            {"mode": "live", "model": model_name, "frame": frame, "series": history.since(since)},
            headers={"Cache-Control": "no-store"},
        )

    app.include_router(router)

    async def sample() -> None:
        while True:
            try:
                history.add(await aengine.query("series_point"))
            except EngineDeadError:
                return
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any):
        async with inner(a) as state:
            task = asyncio.create_task(sample())
            try:
                yield state
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                    await task

    app.router.lifespan_context = lifespan
