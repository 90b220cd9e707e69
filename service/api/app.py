"""The FastAPI application factory.

``create_app(settings)`` builds one self-contained app: its settings, model manager, dataplane, metrics (a
private Prometheus registry) and lifecycle hang off ``app.state``; nothing lives at module level, so tests and
benchmarks can run several apps in one process. The server (``service.server``) decides the process topology
and passes in a manager built for it; the app itself only answers requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.applications import Starlette

from service.dataplane import DataPlane, server_version
from service.metrics import Metrics
from service.registry.manager import ModelManager
from service.settings import ServiceSettings
from service.shared_memory.table import SharedMemory

from . import extensions, health, management, metrics_route, predict, shm, v2
from .docs import install_docs
from .errors import install_error_handlers
from .fast_path import InferFastPath
from .lifecycle import Lifecycle, lifespan
from .schemas import BODY_MODELS

DESCRIPTION = (
    "ONNX model server for PyTorch-exported CNNs: graph fusion, ONNX Runtime (CUDA graphs on NVIDIA GPUs), "
    "dynamic batching, a simple /predict endpoint and the KServe V2 protocol (binary tensors included)."
)


class ServiceApp(FastAPI):
    """FastAPI with the infer fast path in front of its whole middleware stack.

    Starlette's stack (ServerErrorMiddleware, FastAPI's middlewares, the exception middleware) wraps every
    request in several coroutines and send wrappers. The fast path renders its own errors, so binary and JSON
    infer requests skip all of it: about 0.065 ms less per request, measured ad hoc in-process on the CPU
    machine (0.50 against 0.56 ms for a whole request).
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """HTTP goes straight to the middleware stack, as Starlette does, past FastAPI's own layer: that layer
        checks on every request whether FastAPI's OpenTelemetry support is configured (this service reports
        through Prometheus and does not configure it): 17-20 us per request
        (bench/results/asgi-layer-2026-12-01-cpu.json). Everything else (the lifespan) takes FastAPI's path."""
        if scope["type"] == "http":
            await Starlette.__call__(self, scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> Any:
        return InferFastPath(super().build_middleware_stack())


def create_app(
    settings: ServiceSettings,
    manager: ModelManager | None = None,
    *,
    metrics: Metrics | None = None,
    serve_before_ready: bool = True,
    on_started: Callable[[], None] | None = None,
    shared_memory: SharedMemory | None = None,
) -> FastAPI:
    """Build the app. Without ``manager`` one is made on ``settings`` (engines in this process) reporting to
    ``metrics``. ``serve_before_ready``: accept connections while the models load (readiness says "loading");
    ``on_started``: called once the manager's startup has finished, successfully or not; ``shared_memory``: the
    shared-memory regions (default: this process's own, CUDA ones opened here)."""
    metrics = metrics if metrics is not None else Metrics()
    if manager is None:
        manager = ModelManager(settings, metrics=metrics)
    dataplane = DataPlane(manager, metrics, shared_memory=shared_memory)
    app = ServiceApp(title="onnx-cnn-serve", version=server_version(), description=DESCRIPTION, lifespan=lifespan,
                     docs_url=None, redoc_url=None)  # install_docs serves both pages without a CDN
    app.state.settings = settings
    app.state.manager = manager
    app.state.dataplane = dataplane
    app.state.metrics = metrics
    app.state.lifecycle = Lifecycle(dataplane, serve_before_ready=serve_before_ready, on_started=on_started)
    app.state.inflight = dataplane.inflight  # shared with gRPC: "alone" means alone on both protocols
    install_error_handlers(app)
    # extensions before v2: /v2/models/stats is not the metadata of a model named "stats"
    for module in (health, predict, extensions, shm, v2, management, metrics_route):
        app.include_router(module.router)
    _document_bodies(app)
    install_docs(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Add the request-body models the routes read by hand (see ``schemas.json_body``) to OpenAPI."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODY_MODELS:
            doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(doc.pop("$defs", {}))
            components[model.__name__] = doc
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
