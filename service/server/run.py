"""Run the app on uvicorn, and the KServe V2 gRPC service beside it, until a signal stops them; returns the
exit code.

Both listeners share one event loop (uvicorn's) and one dataplane: the gRPC server (``service.grpc``) starts
once the HTTP listener is up, on ``grpc_port`` of the same host (``grpc_port`` None: no gRPC). The HTTP port is
bound before the application starts (``bound_socket``), as the supervisor does with workers; a port that cannot
be bound stops the server with status 1 and one line naming it and its setting (``cannot_listen``; gRPC's:
``GrpcBindError``). SIGTERM/SIGINT: readiness turns false at once
(``Lifecycle.begin_shutdown`` in the signal handler), both listeners stop accepting, in-flight requests and
calls get up to ``shutdown_grace_s`` to finish (at the same time), then the model manager stops. A clean,
signal-driven shutdown exits 0. After binding, one line ``listening on http://HOST:PORT`` (``https`` with
TLS), then ``listening on grpc://HOST:PORT``, go to stdout with the real ports, so ``--port 0`` and
``SERVICE_GRPC_PORT=0`` work for tests and scripts; a line ``ready: N model(s) served (...)`` goes to the
log (stderr) once every stored model is loaded, after those. With ``workers`` > 1 the supervisor
(``server.supervisor``) reserves both ports, runs one such server per worker process and logs the "ready"
line itself once every worker serves.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from service.api.app import create_app
from service.api.lifecycle import Lifecycle
from service.grpc.server import GrpcBindError, GrpcServer, display_host
from service.runtime.engine_process.devices import Device
from service.server.balance import BalanceMiddleware, ConnectionBalancer
from service.server.http_guard import GuardedConfig
from service.server.process import configure_process
from service.server.transport import ServedProtocol
from service.settings import ServiceSettings

log = logging.getLogger("service.server")

KEEP_ALIVE_S = 5
PORT_HINT = "set SERVICE_PORT (or --port) to a free port (0: any free one)"
"""What a server that cannot bind its HTTP port tells the operator (gRPC's: ``service.grpc.server.PORT_HINT``)."""


def bound_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port``, not listening yet (the server listens once it has started), with
    SO_REUSEADDR as asyncio's own servers; ``reuse_port``: SO_REUSEPORT too (workers sharing one port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def cannot_listen(host: str, port: int, exc: OSError) -> str:
    """The line of a server whose HTTP port cannot be bound: the address, why, and the setting to change."""
    return f"cannot listen on {display_host(host)}:{port}: {exc.strerror or exc}; {PORT_HINT}"


class _Server(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, lifecycle: Lifecycle, *, announce: bool = True, grpc: GrpcServer | None = None
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.announce = announce
        self.grpc = grpc
        self.failed = False
        self._ready_line: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.lifecycle.begin_shutdown()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.announce and self.started and getattr(self, "servers", None):
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            scheme = "https" if self.config.ssl_certfile else "http"
            print(f"listening on {scheme}://{display_host(host)}:{port}", flush=True)
        if self.started and self.grpc is not None:
            try:
                await self.grpc.start()
            except GrpcBindError as exc:
                log.error("%s", exc)
                self.failed = self.should_exit = True
                return
            if self.announce:
                print(f"listening on {self.grpc.url}{' (TLS)' if self.grpc.tls else ''}", flush=True)
        if self.announce and self.started:
            self._ready_line = asyncio.ensure_future(self._log_ready())

    async def _log_ready(self) -> None:
        """The "ready" log line once every stored model is loaded: after the "listening" lines, by order."""
        try:
            await self.lifecycle.wait_started()
        except RuntimeError:  # the manager failed to start: it logged why, readiness stays false
            return
        if not self.lifecycle.shutting_down:
            log.info("ready: %s", self.lifecycle.served())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """gRPC stops accepting and drains while HTTP does; the models stop after both (``Lifecycle``)."""
        if self._ready_line is not None:
            self._ready_line.cancel()
        if self.grpc is not None:
            grace = self.config.timeout_graceful_shutdown or 0.0
            self.lifecycle.drain_before_stop(asyncio.ensure_future(self.grpc.stop(grace)))
        await super().shutdown(sockets=sockets)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        with self.capture_signals():
            await self._serve(sockets)
            # uvicorn re-raises a caught SIGTERM after a graceful shutdown (exit status -15); we have
            # finished cleanly, so say so with status 0.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()


def uvicorn_config(
    settings: ServiceSettings, app: object, on_refused: Callable[[str], None] | None = None
) -> uvicorn.Config:
    """``on_refused``: counts what the HTTP layer refuses (``service.server.http_guard``), by reason."""
    return GuardedConfig(
        app,
        on_refused=on_refused,
        http=ServedProtocol,
        ws="none",  # no WebSocket routes: an Upgrade request is served as plain HTTP, under the same limits
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=KEEP_ALIVE_S,
        server_header=False,
        proxy_headers=False,
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
    )


def serve_single(settings: ServiceSettings, device: Device | None = None) -> int:
    """One server process with its engines in this process; its port is bound before anything starts. On a GPU
    (``device``), a GPU fault moves the engines to an engine process started then (``server.engines.StandbyEngine``,
    ``registry.recovery``)."""
    from service.metrics import Metrics
    from service.registry.manager import ModelManager
    from service.runtime.device import probe_in_background
    from service.server.engines import StandbyEngine

    configure_process(settings)
    try:
        sock = bound_socket(settings.host, settings.port)
    except OSError as exc:
        log.error("%s", cannot_listen(settings.host, settings.port, exc))
        return 1
    ordinal = None if device is None else device.ordinal
    if ordinal is not None:
        probe_in_background(ordinal)  # the CUDA context while the store is prepared (demo model, optimizer)
    standby = StandbyEngine(settings, device) if device is not None and ordinal is not None else None
    metrics = Metrics()
    manager = ModelManager(settings, metrics=metrics, relocate=standby.loader if standby is not None else None)
    try:
        with sock:
            return run_server(settings, create_app(settings, manager, metrics=metrics), sockets=[sock])
    finally:
        if standby is not None:
            standby.stop()


def run_server(
    settings: ServiceSettings,
    app: Any,
    *,
    sockets: list[socket.socket],
    announce: bool = True,
    balancer: ConnectionBalancer | None = None,
    grpc_reuse_port: bool = False,
) -> int:
    """Run ``app`` on uvicorn on the bound ``sockets`` until a signal stops it, with gRPC on
    ``settings.grpc_port`` unless it is None (``grpc_reuse_port``: a worker sharing the supervisor's reserved
    port). ``balancer``: this worker's share of the kept-alive HTTP connections."""
    served = app if balancer is None else BalanceMiddleware(app, balancer)
    grpc = None if settings.grpc_port is None else GrpcServer(settings, app.state.dataplane, reuse_port=grpc_reuse_port)
    config = uvicorn_config(settings, served, on_refused=app.state.metrics.refused_connection)
    server = _Server(config, app.state.lifecycle, announce=announce, grpc=grpc)
    if balancer is not None:
        balancer.on_close = app.state.metrics.rebalanced.inc
        balancer.bind(lambda: len(server.server_state.connections))
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:  # uvicorn exits this way when the application cannot start
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if balancer is not None:
            balancer.forget()
    return 0 if server.started and not server.failed else 1
