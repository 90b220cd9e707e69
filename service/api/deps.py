"""Per-request access to the app's state. Plain functions rather than FastAPI ``Depends``: the inference
routes are hot and these are one attribute lookup each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

if TYPE_CHECKING:
    from service.dataplane import DataPlane
    from service.metrics import Metrics
    from service.settings import ServiceSettings

    from .lifecycle import Lifecycle


def dataplane_of(request: Request) -> DataPlane:
    return request.app.state.dataplane


def settings_of(request: Request) -> ServiceSettings:
    return request.app.state.settings


def metrics_of(request: Request) -> Metrics:
    return request.app.state.metrics


def lifecycle_of(request: Request) -> Lifecycle:
    return request.app.state.lifecycle
