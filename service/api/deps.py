"""Per-request access to the app's state, and the checks every route shares (names, versions).

Plain functions rather than FastAPI ``Depends``: the inference routes are hot and these are one
attribute lookup each.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from starlette.requests import Request

from service.errors import BadRequestError
from service.settings import ServiceSettings
from service.validation import validate_model_name

if TYPE_CHECKING:
    from service.metrics import Metrics
    from service.registry import ModelRegistry, ModelVersion

    from .lifecycle import Lifecycle

_VERSION_RE = re.compile(r"^[1-9][0-9]{0,17}$")


def registry_of(request: Request) -> ModelRegistry:
    return request.app.state.registry


def settings_of(request: Request) -> ServiceSettings:
    return request.app.state.settings


def metrics_of(request: Request) -> Metrics:
    return request.app.state.metrics


def lifecycle_of(request: Request) -> Lifecycle:
    return request.app.state.lifecycle


def check_name(name: str) -> str:
    """The registry's name rule (``service.validation``), applied before any lookup so that odd names
    (``..``, NUL, slashes, Unicode look-alikes) never reach the store, logs or metric labels."""
    return validate_model_name(name)


def parse_version(text: str | None) -> int | None:
    if text is None:
        return None
    if not _VERSION_RE.fullmatch(text):
        raise BadRequestError("model version must be a positive integer")
    return int(text)


def resolve(request: Request, name: str | None, version: int | None) -> ModelVersion:
    """The model version a request addresses; the only model when no name is given."""
    registry = registry_of(request)
    if name is None:
        only = registry.only_model()
        return only if version is None or version == only.version else registry.get(only.name, version)
    return registry.get(check_name(name), version)
