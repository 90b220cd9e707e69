"""Run the app on uvicorn: ``serve(settings) -> exit code``.

SIGTERM/SIGINT: readiness turns false at once (``Lifecycle.begin_shutdown`` in the signal handler), the
listening socket closes, in-flight requests get up to ``shutdown_grace_s`` to finish, then the registry
stops. A clean, signal-driven shutdown exits 0. After binding, one line ``listening on http://HOST:PORT``
goes to stdout with the real port, so ``--port 0`` works for tests and scripts. With ``workers`` > 1 the
supervisor in ``service.api.workers`` binds the port and runs one such server per worker process.
"""

from __future__ import annotations

import importlib
import logging
import socket
import sys
from types import FrameType
from typing import Any

import uvicorn

from service.heap import keep_freed_memory
from service.settings import ServiceSettings

from .app import create_app
from .gathered_writes import GatheredWritesProtocol
from .lifecycle import Lifecycle

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, *, announce: bool = True) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.announce = announce

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.lifecycle.begin_shutdown()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.announce and self.started and getattr(self, "servers", None):
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"listening on http://{shown}:{port}", flush=True)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        with self.capture_signals():
            await self._serve(sockets)
            # uvicorn re-raises a caught SIGTERM after a graceful shutdown (exit status -15); we have
            # finished cleanly, so say so with status 0.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()


def uvicorn_config(settings: ServiceSettings, app: object) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        http=GatheredWritesProtocol if settings.http_gather_writes else "auto",
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=5,
        server_header=False,
        proxy_headers=False,
    )


def configure_process(settings: ServiceSettings) -> None:
    """Logging, the GIL switch interval, the heap thresholds and uvicorn's body buffer of a server process."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1e3)
    keep_freed_memory(settings.heap_keep_mb)
    set_body_buffer(settings.http_body_buffer_kb * 1024)


_UVICORN_HTTP_MODULES = ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl")


def set_body_buffer(limit: int) -> list[str]:
    """Let uvicorn buffer up to ``limit`` bytes of a request body before it pauses reading the socket.

    Why: uvicorn pauses the socket whenever more than 64 KiB of body wait for the app and resumes it when
    the app takes them, so an image tensor costs several pause/resume round trips through the event loop.
    A bare uvicorn app on the CPU machine with 8 requests in flight spent 0.33 against 0.44 ms of CPU per
    600 KB request and 3.3 against 4.8 ms per 4.8 MB one (16 MiB against 64 KiB; bench/results/server-cpu-
    2026-11-30-cpu.json). Our own server there showed no difference beyond noise (its event loop spends
    more elsewhere, and the CPU provider's threads share the two cores), nor did one request at a time
    (bench/results/http-overhead-2026-11-30-body-buffer-ab.json); the GPU host is where to measure it next.
    uvicorn has no option for it, so the module constant its protocols read is set (returns the modules
    changed). The app still reads every body as it arrives and refuses it beyond ``max_request_mb``.
    """
    changed = []
    for name in _UVICORN_HTTP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # httptools is optional in uvicorn
            continue
        if hasattr(module, "HIGH_WATER_LIMIT"):
            module.HIGH_WATER_LIMIT = limit
            changed.append(name)
    return changed


def serve(settings: ServiceSettings) -> int:
    if settings.workers > 1:
        from .workers import serve_workers

        return serve_workers(settings)
    configure_process(settings)
    return run_server(settings, create_app(settings))


def run_server(
    settings: ServiceSettings, app: Any, *, sockets: list[socket.socket] | None = None, announce: bool = True
) -> int:
    """Run ``app`` on uvicorn until a signal stops it (on ``sockets`` when given, else bind host:port)."""
    server = _Server(uvicorn_config(settings, app), app.state.lifecycle, announce=announce)
    balancer = app.state.lifecycle.role.balancer
    if balancer is not None:
        balancer.bind(lambda: len(server.server_state.connections))
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind or start
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if balancer is not None:
            balancer.forget()
    return 0 if server.started else 1
