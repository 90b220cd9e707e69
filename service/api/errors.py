"""One place that turns exceptions into ``{"error": "..."}`` responses.

``ServiceError`` carries its own status, message and headers (Retry-After, WWW-Authenticate); FastAPI's
validation errors become a 422 naming the field; Starlette's 404/405 keep their status; anything else is
a 500 with a fixed message, logged here with its traceback and never sent to the client.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from service.errors import ServiceError

from .codecs import json_response

log = logging.getLogger("service.api")

# Not a real HTTP status: nginx's "client closed request". Nobody reads it; it keeps logs/metrics honest.
CLIENT_CLOSED = 499


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": message}, status, headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    errors = exc.errors()
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "request"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = len(errors) - 3
    return "invalid request: " + "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


async def _service_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    if exc.status >= 500 and exc.status not in (503, 504, 507):
        log.error("%s: %s", exc.code, exc.message)
    return error_response(exc.status, exc.message, exc.headers)


async def _request_validation(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, _validation_message(exc))


async def _http_exception(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    if exc.status_code == 404 and message == "Not Found":
        message = "not found"
    elif exc.status_code == 405:
        message = "method not allowed"
    return error_response(exc.status_code, message, dict(exc.headers or {}))


async def _client_disconnect(_: Request, exc: Exception) -> Response:
    return error_response(CLIENT_CLOSED, "client disconnected")


async def _unexpected(request: Request, exc: Exception) -> Response:
    # uvicorn logs the traceback itself (Starlette re-raises after this handler has answered).
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
    return error_response(500, "internal error")


async def exception_response(request: Request, exc: Exception) -> Response:
    """The response the installed handlers give for ``exc`` (for code that runs outside FastAPI's routing)."""
    for kind, handler in _HANDLERS:
        if isinstance(exc, kind):
            if handler is _unexpected:
                log.error("unhandled exception", exc_info=exc)
            return await handler(request, exc)
    raise AssertionError("unreachable: Exception is the last entry")


_HANDLERS = (
    (ServiceError, _service_error),
    (RequestValidationError, _request_validation),
    (StarletteHTTPException, _http_exception),
    (ClientDisconnect, _client_disconnect),
    (Exception, _unexpected),
)


def install_error_handlers(app: FastAPI) -> None:
    for kind, handler in _HANDLERS:
        app.add_exception_handler(kind, handler)
