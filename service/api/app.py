"""The FastAPI application factory.

``create_app(settings)`` builds one self-contained app: its settings, registry, metrics (a private
Prometheus registry) and lifecycle hang off ``app.state``, nothing lives at module level, so tests and
benchmarks can run several apps in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.applications import Starlette

from service.metrics import Metrics
from service.settings import ServiceSettings

from . import health, kserve, metrics_route, models, predict
from .connection_balance import BalanceMiddleware
from .error_handlers import install_error_handlers
from .fast_path import InferFastPath
from .inference import InFlight
from .lifecycle import Lifecycle, WorkerRole, lifespan
from .schemas import BODY_MODELS

if TYPE_CHECKING:
    from service.registry import ModelRegistry

DESCRIPTION = (
    "ONNX model server for PyTorch-exported CNNs: graph fusion, ONNX Runtime (CUDA graphs on NVIDIA GPUs), "
    "dynamic batching, a simple /predict endpoint and the KServe V2 protocol (binary tensors included)."
)


class ServiceApp(FastAPI):
    """FastAPI with the infer fast path in front of its whole middleware stack.

    Starlette's stack (ServerErrorMiddleware, FastAPI's telemetry and body-limit middlewares, the
    exception middleware) wraps every request in several coroutines and send wrappers. The fast path
    renders its own errors, so binary and JSON infer requests skip all of it: about 0.065 ms less per
    request, measured ad hoc in-process on the CPU machine (0.50 against 0.56 ms for a whole request).
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """HTTP goes straight to the middleware stack, as Starlette does, past FastAPI's own layer: that
        layer checks on every request whether FastAPI's OpenTelemetry support is configured (this service
        reports through Prometheus and does not configure it): 17-20 us per request
        (bench/results/asgi-layer-2026-12-01-cpu.json).
        Everything else (the lifespan) takes FastAPI's path."""
        if scope["type"] == "http":
            await Starlette.__call__(self, scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> Any:
        stack = InferFastPath(super().build_middleware_stack())
        balancer = self.state.lifecycle.role.balancer
        return stack if balancer is None else BalanceMiddleware(stack, balancer)


def create_app(
    settings: ServiceSettings,
    registry: ModelRegistry | None = None,
    *,
    metrics: Metrics | None = None,
    role: WorkerRole | None = None,
) -> FastAPI:
    """Build the app. Without ``registry`` one is created on ``settings`` reporting to ``metrics``.
    ``role``: this process's part among several workers (default: the only server process)."""
    metrics = metrics if metrics is not None else Metrics()
    role = role or WorkerRole()
    if registry is None:
        from service.registry import ModelRegistry
        from service.runtime.loading import load_in_process
        from service.runtime.remote_engine import RemoteEngineLoader

        registry = ModelRegistry(
            settings,
            metrics=metrics,
            prepare_store=role.prepare_store,
            follow_store=role.follow_store,
            engine_loader=load_in_process
            if role.engine_host is None
            else RemoteEngineLoader(role.engine_host, in_flight=settings.engine_process_in_flight),
        )
    app = ServiceApp(
        title="onnx-cnn-serve",
        version=kserve.server_version(),
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.lifecycle = Lifecycle(registry, role)
    if role.balancer is not None:
        role.balancer.on_close = metrics.rebalanced.inc
    app.state.inflight = InFlight()
    install_error_handlers(app)
    for module in (health, predict, kserve, models, metrics_route):
        app.include_router(module.router)
    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Add the request-body models the routes read by hand (see ``schemas.json_body``) to OpenAPI."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODY_MODELS:
            doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(doc.pop("$defs", {}))
            components[model.__name__] = doc
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
