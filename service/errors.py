"""Service error hierarchy.

Each class carries an HTTP status and a stable machine-readable code. Only ``service.api`` turns them
into HTTP responses (body ``{"error": "..."}``); the optimizer, runtime and store raise them without
knowing about HTTP. Messages must never contain server paths or tracebacks.
"""

from __future__ import annotations


class ServiceError(Exception):
    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequestError(ServiceError):
    status, code = 400, "bad_request"


class InvalidModelError(BadRequestError):
    """The uploaded file is not an acceptable ONNX model."""

    code = "invalid_model"


class InvalidInputError(BadRequestError):
    """An inference input does not match the model's signature."""

    code = "invalid_input"


class UnauthorizedError(ServiceError):
    status, code = 401, "unauthorized"

    def __init__(self, message: str = "missing or wrong bearer token") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ForbiddenError(ServiceError):
    status, code = 403, "forbidden"


class NotFoundError(ServiceError):
    status, code = 404, "not_found"


class ConflictError(ServiceError):
    status, code = 409, "conflict"


class PayloadTooLargeError(ServiceError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaTypeError(ServiceError):
    status, code = 415, "unsupported_media_type"


class UnprocessableError(ServiceError):
    """Well-formed but semantically unacceptable (e.g. the optimized graph failed verification)."""

    status, code = 422, "unprocessable"


class OptimizationError(UnprocessableError):
    code = "optimization_failed"


class VerificationError(OptimizationError):
    """The optimized graph does not compute the same function as the original."""

    code = "verification_failed"


class ModelNotReadyError(ServiceError):
    status, code = 503, "model_not_ready"


class QueueFullError(ServiceError):
    status, code = 503, "queue_full"

    def __init__(self, message: str = "server busy: the model's request queue is full", retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ShuttingDownError(ServiceError):
    status, code = 503, "shutting_down"


class RequestTimeoutError(ServiceError):
    status, code = 504, "timeout"


class InsufficientStorageError(ServiceError):
    status, code = 507, "insufficient_storage"


class EngineError(ServiceError):
    """The inference engine failed on a valid request (a server fault, reported without internals)."""

    status, code = 500, "engine_error"
