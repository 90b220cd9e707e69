"""Service error hierarchy.

Each class carries an HTTP status, the gRPC status code of the same meaning (``grpc_code``, a
``grpc.StatusCode`` name, so that nothing here imports grpc) and a stable machine-readable code. Only the
protocol layers turn them into answers: ``service.api`` into HTTP responses (body ``{"error": "..."}``),
``service.grpc`` into gRPC statuses with the same text; the optimizer, runtime and store raise them without
knowing about either protocol. Messages must never contain server paths or tracebacks: ``printable`` bounds text a
client or an uploaded model supplied, ``first_line`` reduces a library's exception to a line without
directories.
"""

from __future__ import annotations

import errno
import re

_DIRECTORY = re.compile(r"(/[^\s:]+/)([^/\s:]+)")


def printable(text: object, limit: int = 64) -> str:
    """Client- or model-supplied text for a message: at most ``limit`` characters, unprintables as '?'."""
    value = str(text)
    clean = "".join(ch if ch.isprintable() else "?" for ch in value[:limit])
    return clean + ("..." if len(value) > limit else "")


def first_line(error: BaseException | str, limit: int = 200) -> str:
    """The first line of an exception (or text), without directories: safe to log and to send."""
    if isinstance(error, ServiceError):
        text = error.message
    elif isinstance(error, BaseException):
        text = str(error) or type(error).__name__
    else:
        text = error
    text = text.strip()
    line = text.splitlines()[0] if text else "unknown error"
    return _DIRECTORY.sub(r"\2", line)[:limit]


class ServiceError(Exception):
    status: int = 500
    grpc_code: str = "INTERNAL"
    code: str = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequestError(ServiceError):
    status, grpc_code, code = 400, "INVALID_ARGUMENT", "bad_request"


class InvalidModelError(BadRequestError):
    """The uploaded file is not an acceptable ONNX model."""

    code = "invalid_model"


class InvalidInputError(BadRequestError):
    """An inference input does not match the model's signature."""

    code = "invalid_input"


class UnauthorizedError(ServiceError):
    status, grpc_code, code = 401, "UNAUTHENTICATED", "unauthorized"

    def __init__(self, message: str = "missing or wrong bearer token") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ForbiddenError(ServiceError):
    status, grpc_code, code = 403, "PERMISSION_DENIED", "forbidden"


class NotSupportedError(BadRequestError):
    """A protocol extension (or a part of one) this server does not implement: a clear 400 on REST,
    UNIMPLEMENTED on gRPC, never a bare "not found"."""

    grpc_code, code = "UNIMPLEMENTED", "not_supported"


class NotFoundError(ServiceError):
    status, grpc_code, code = 404, "NOT_FOUND", "not_found"


class ConflictError(ServiceError):
    status, grpc_code, code = 409, "FAILED_PRECONDITION", "conflict"


class PayloadTooLargeError(ServiceError):
    status, grpc_code, code = 413, "RESOURCE_EXHAUSTED", "payload_too_large"


class UnsupportedMediaTypeError(ServiceError):
    status, grpc_code, code = 415, "INVALID_ARGUMENT", "unsupported_media_type"


class UnprocessableError(ServiceError):
    """Well-formed but semantically unacceptable (e.g. the optimized graph failed verification)."""

    status, grpc_code, code = 422, "INVALID_ARGUMENT", "unprocessable"


class OptimizationError(UnprocessableError):
    code = "optimization_failed"


class VerificationError(OptimizationError):
    """The optimized graph does not compute the same function as the original."""

    code = "verification_failed"


class ModelNotReadyError(ServiceError):
    status, grpc_code, code = 503, "UNAVAILABLE", "model_not_ready"


class QueueFullError(ServiceError):
    status, grpc_code, code = 503, "UNAVAILABLE", "queue_full"

    def __init__(self, message: str = "server busy: the model's request queue is full", retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ShuttingDownError(ServiceError):
    status, grpc_code, code = 503, "UNAVAILABLE", "shutting_down"


class RequestTimeoutError(ServiceError):
    status, grpc_code, code = 504, "DEADLINE_EXCEEDED", "timeout"


class RequestBodyTimeoutError(ServiceError):
    """The client did not send its request body in time; the connection is closed after the answer."""

    status, grpc_code, code = 408, "DEADLINE_EXCEEDED", "body_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class InsufficientStorageError(ServiceError):
    status, grpc_code, code = 507, "RESOURCE_EXHAUSTED", "insufficient_storage"


class StoreNotWritableError(InsufficientStorageError):
    """The model store is mounted read-only or the server may not write to it."""

    code = "store_not_writable"


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def storage_error(exc: OSError, what: str = "the model") -> InsufficientStorageError | None:
    """The client-facing error for a failed write to the model store, naming the cause; None when ``exc`` is
    not a storage condition (a bug or a vanished file: the caller lets it propagate). ``what``: the thing
    being stored, for the message."""
    if exc.errno in _NO_SPACE:
        quota = " (disk quota exceeded)" if exc.errno == errno.EDQUOT else ""
        return InsufficientStorageError(f"not enough disk space to store {what}{quota}")
    if exc.errno == errno.EROFS:
        return StoreNotWritableError("the model store is read-only")
    if exc.errno in _NOT_WRITABLE:
        return StoreNotWritableError("the server may not write to the model store (permission denied)")
    return None


class EngineError(ServiceError):
    """The inference engine failed on a valid request (a server fault, reported without internals)."""

    status, grpc_code, code = 500, "INTERNAL", "engine_error"


class GpuFaultError(EngineError):
    """The GPU faulted (a sticky CUDA error: the process's CUDA context is lost for good). The server replaces the
    engine in a fresh process and runs the batch in flight again once; a client sees this only when that failed
    too, and may retry."""

    status, grpc_code, code = 503, "UNAVAILABLE", "gpu_fault"
