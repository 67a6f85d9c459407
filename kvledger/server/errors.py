"""OpenAI's error JSON for every failure: APIError for what a handler refuses, and the
exception handlers that turn validation errors, KVLedgerError, a dead engine and bugs into it.
Anthropic's routes (/v1/messages...) get the same errors in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), which its SDK reads."""

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


ANTHROPIC_ROUTES = "/v1/messages"
# Anthropic's error types by HTTP status (its API's documented list); other statuses: api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic_path(scope_path: str, root_path: str = "") -> bool:
    return scope_path.removeprefix(root_path).startswith(ANTHROPIC_ROUTES)


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_for(
    scope_path: str,
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    root_path: str = "",
) -> JSONResponse:
    """The error in the shape the route's API uses: Anthropic's or OpenAI's."""
    if is_anthropic_path(scope_path, root_path):
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    return error_response(status, message, type, param, code)


def install_error_handlers(app: FastAPI) -> None:
    """Input errors are 400s; a 500 means a bug in kvledger."""

    def reply(request: Request, status: int, message: str, type: str = "invalid_request_error",
              param: str | None = None, code: str | None = None) -> JSONResponse:  # fmt: skip
        scope = request.scope
        return error_for(scope["path"], status, message, type, param, code, scope.get("root_path", ""))

    @app.exception_handler(APIError)
    async def _api_error(r: Request, e: APIError) -> JSONResponse:
        return reply(r, e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(KVLedgerError)
    async def _kvledger_error(r: Request, e: KVLedgerError) -> JSONResponse:
        return reply(r, 400, str(e), param=getattr(e, "param", None))

    @app.exception_handler(RecursionError)
    async def _too_deep(r: Request, e: RecursionError) -> JSONResponse:
        return reply(r, 400, "the body is nested too deeply")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(r: Request, e: EngineDeadError) -> JSONResponse:
        return reply(r, 503, str(e), type="server_error", code="engine_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation(r: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return reply(r, 400, f"the body is not valid JSON: {first.get('msg', '')}")
        return reply(r, 400, validation_message(errors), param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(r: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return reply(r, e.status_code, str(e.detail), type=kind)

    @app.exception_handler(Exception)
    async def _bug(r: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return reply(r, 500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one line naming each bad field (the first five)."""
    msgs = []
    for err in errors[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        msgs.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(msgs)
