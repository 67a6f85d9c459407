"""OpenAI's error JSON for every failure: APIError for what a handler refuses, and the
exception handlers that turn validation errors, KVLedgerError, a dead engine and bugs into it."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvledger.errors import EngineDeadError, KVLedgerError
from kvledger.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("kvledger.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Input errors are 400s; a 500 means a bug in kvledger."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(KVLedgerError)
    async def _kvledger_error(_: Request, e: KVLedgerError) -> JSONResponse:
        return error_response(400, str(e), param=getattr(e, "param", None))

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, e: RecursionError) -> JSONResponse:
        return error_response(400, "the body is nested too deeply")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, str(e), type="server_error", code="engine_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}")
        msgs = []
        for err in errors[:5]:
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            msgs.append(f"{where}: {err.get('msg', 'invalid')}")
        return error_response(400, "; ".join(msgs), param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(e.status_code, str(e.detail), type=kind)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
