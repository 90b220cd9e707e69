"""Startup and shutdown of one app: the model manager's lifetime and the readiness it implies.

The manager starts in a background task so the HTTP server accepts connections at once: liveness is true
from the first moment, readiness only after every stored model is loaded and warmed (a fresh store may first
build and optimize the demo model). Readiness turns false the moment shutdown begins (the server calls
``begin_shutdown`` from its SIGTERM handler), before in-flight requests finish, so load balancers stop
sending new work while the last answers go out. Another listener of the same process (the server's gRPC
listener) hands its own drain to ``drain_before_stop``: the models stop only once it has finished too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI

from service.dataplane import DataPlane
from service.registry.version import ModelState

log = logging.getLogger("service.api")


class Lifecycle:
    """Readiness as every protocol sees it (``DataPlane.ready``), and the manager's start task."""

    def __init__(
        self, dataplane: DataPlane, *, serve_before_ready: bool = True, on_started: Callable[[], None] | None = None
    ) -> None:
        self.dataplane = dataplane
        self.serve_before_ready = serve_before_ready
        self.on_started = on_started
        self.start_task: asyncio.Task[None] | None = None
        self.draining: list[Awaitable[None]] = []

    @property
    def ready(self) -> bool:
        return self.dataplane.ready

    @property
    def shutting_down(self) -> bool:
        return self.dataplane.shutting_down

    def not_ready_reason(self) -> str:
        return self.dataplane.not_ready_reason()

    def begin_shutdown(self) -> None:
        self.dataplane.begin_shutdown()

    async def start_manager(self) -> None:
        manager = self.dataplane.manager
        try:
            await manager.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep serving liveness; readiness says why it is false
            self.dataplane.start_failed = type(exc).__name__
            log.exception("the model manager failed to start")
        finally:
            if self.on_started is not None:
                self.on_started()

    def served(self) -> str:
        """What this app serves, for the server's "ready" line: ``N model(s) served (a, b)``, then the versions
        that are not served and their state (a version that failed to load, an unloaded one)."""
        versions = list(self.dataplane.manager.table)
        ready = sorted({mv.name for mv in versions if mv.state is ModelState.READY})
        text = f"{len(ready)} model(s) served" + (f" ({_listed(ready)})" if ready else "")
        others = [f"{mv.name} v{mv.version} {mv.state.value.lower()}" for mv in versions
                  if mv.state is not ModelState.READY]
        return text + (f"; not served: {_listed(others)}" if others else "")

    def drain_before_stop(self, drained: Awaitable[None]) -> None:
        """Stop the models only after ``drained`` (another listener's in-flight calls) has finished."""
        self.draining.append(drained)

    async def wait_started(self) -> None:
        """Wait for the manager's startup (tests, tools); raise if it failed."""
        if self.start_task is not None:
            await asyncio.shield(self.start_task)
        if self.dataplane.start_failed is not None:
            raise RuntimeError(f"startup failed: {self.dataplane.start_failed}")


def _listed(items: list[str], limit: int = 10) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    lifecycle: Lifecycle = app.state.lifecycle
    lifecycle.dataplane.shutting_down = False
    lifecycle.start_task = asyncio.create_task(lifecycle.start_manager(), name="manager-start")
    if not lifecycle.serve_before_ready:
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
        for drained in lifecycle.draining:
            try:
                await drained
            except Exception:
                log.exception("draining a listener failed")
        lifecycle.draining.clear()
        await lifecycle.dataplane.manager.stop(app.state.settings.shutdown_grace_s)
        lifecycle.dataplane.images.close()
        await asyncio.to_thread(lifecycle.dataplane.shared_memory.close)  # CUDA regions: CUDA calls
