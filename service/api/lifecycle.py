"""Startup and shutdown of one app: the registry's lifetime and the readiness flag.

The registry starts in a background task so the HTTP server accepts connections at once: liveness is
true from the first moment, readiness only after every stored model is loaded and warmed (a fresh store
may first build and optimize the demo model). Readiness turns false the moment shutdown begins (the
server calls ``begin_shutdown`` from its SIGTERM handler), before in-flight requests finish, so load
balancers stop sending new work while the last answers go out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    from service.registry import ModelRegistry
    from service.runtime.engine_host import HostAddress

    from .connection_balance import ConnectionBalancer

log = logging.getLogger("service.api")


@dataclasses.dataclass(frozen=True)
class WorkerRole:
    """How one server process takes part when several share the port (``service.api.workers``).

    ``prepare_store``: this process cleans the store and installs the demo model (the first worker's
    first start only). ``follow_store``: pick up other workers' uploads and deletes. ``serve_before_ready``:
    accept connections while models load (liveness answers, readiness says "loading"); the later workers
    accept only once loaded, so a shared port never routes to a worker that cannot serve.
    ``on_started``: called once the registry's startup has finished (successfully or not).
    ``engine_host``: where the engine process listens, when the workers share one (else engines are local).
    ``balancer``: evens out kept-alive connections over the workers (``service.api.connection_balance``).
    """

    prepare_store: bool = True
    follow_store: bool = False
    serve_before_ready: bool = True
    on_started: Callable[[], None] | None = None
    engine_host: HostAddress | None = None
    balancer: ConnectionBalancer | None = None


class Lifecycle:
    """Readiness as the API sees it: the registry is ready and no shutdown has begun."""

    def __init__(self, registry: ModelRegistry, role: WorkerRole | None = None) -> None:
        self.registry = registry
        self.role = role or WorkerRole()
        self.shutting_down = False
        self.start_failed: str | None = None
        self.start_task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return not self.shutting_down and self.start_failed is None and bool(self.registry.ready)

    def not_ready_reason(self) -> str:
        if self.shutting_down:
            return "shutting down"
        if self.start_failed is not None:
            return f"startup failed: {self.start_failed}"
        return "loading models"

    def begin_shutdown(self) -> None:
        self.shutting_down = True

    async def start_registry(self) -> None:
        try:
            await self.registry.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep serving liveness; readiness says why it is false
            self.start_failed = type(exc).__name__
            log.exception("model registry failed to start")
        else:
            log.info("model registry ready: %d model(s)", len(self.registry.names()))
        finally:
            if self.role.on_started is not None:
                self.role.on_started()

    async def wait_started(self) -> None:
        """Wait for the registry's startup (tests, tools); raise if it failed."""
        if self.start_task is not None:
            await asyncio.shield(self.start_task)
        if self.start_failed is not None:
            raise RuntimeError(f"registry startup failed: {self.start_failed}")


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    lifecycle: Lifecycle = app.state.lifecycle
    lifecycle.shutting_down = False
    lifecycle.start_task = asyncio.create_task(lifecycle.start_registry(), name="registry-start")
    if not lifecycle.role.serve_before_ready:
        await asyncio.shield(lifecycle.start_task)  # uvicorn accepts connections only after this returns
    try:
        yield
    finally:
        lifecycle.begin_shutdown()
        task = lifecycle.start_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await lifecycle.registry.stop(app.state.settings.shutdown_grace_s)
