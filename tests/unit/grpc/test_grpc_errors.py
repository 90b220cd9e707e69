"""The one mapping of service errors to gRPC statuses (``grpc_code`` on the classes, ``service.grpc.errors``)."""

from __future__ import annotations

import grpc
import pytest

from service import errors
from service.grpc.errors import INTERNAL_MESSAGE, status_of


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


EXPECTED = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            409: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
            408: "DEADLINE_EXCEEDED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
            507: "RESOURCE_EXHAUSTED"}


@pytest.mark.parametrize("cls", [errors.ServiceError, *_subclasses(errors.ServiceError)], ids=lambda c: c.__name__)
def test_every_error_class_has_the_grpc_code_of_its_http_status(cls: type) -> None:
    want = "UNIMPLEMENTED" if issubclass(cls, errors.NotSupportedError) else EXPECTED[cls.status]
    assert cls.grpc_code == want
    assert isinstance(grpc.StatusCode[cls.grpc_code], grpc.StatusCode)


def test_status_carries_rests_text_and_headers() -> None:
    code, details, metadata = status_of(errors.QueueFullError())
    assert code is grpc.StatusCode.UNAVAILABLE
    assert details == "server busy: the model's request queue is full"
    assert metadata == (("retry-after", "1"),)
    code, details, metadata = status_of(errors.UnauthorizedError("wrong bearer token"))
    assert (code, details, metadata) == (grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token",
                                         (("www-authenticate", "Bearer"),))


def test_anything_else_is_internal_with_a_fixed_text() -> None:
    code, details, metadata = status_of(RuntimeError("/srv/secret/path exploded"))
    assert (code, details, metadata) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, ())
