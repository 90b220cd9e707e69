"""``ServiceError`` -> gRPC status, once: the code is the error class's ``grpc_code`` and the details are the
very text REST sends in ``{"error": ...}``. Anything else is INTERNAL "internal error", logged here with its
traceback and never sent. A 503's ``Retry-After`` and a 401's ``WWW-Authenticate`` travel as trailing
metadata (lower-case keys, as gRPC requires)."""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from service.errors import ServiceError

log = logging.getLogger("service.grpc")

INTERNAL_MESSAGE = "internal error"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status code, details and trailing metadata that answer ``exc``."""
    if isinstance(exc, ServiceError):
        if exc.status >= 500 and exc.status not in (503, 504, 507):
            log.error("%s: %s", exc.code, exc.message)
        metadata = tuple((key.lower(), value) for key, value in exc.headers.items())
        return grpc.StatusCode[exc.grpc_code], exc.message, metadata
    log.error("unhandled %s in a gRPC call", type(exc).__name__, exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, ()


def message_of(exc: BaseException) -> str:
    """The text of ``exc`` for a stream's ``error_message`` (same rules as ``status_of``)."""
    return status_of(exc)[1]


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    code, details, metadata = status_of(exc)
    await context.abort(code, details, metadata)
    raise AssertionError("unreachable: abort raises")
