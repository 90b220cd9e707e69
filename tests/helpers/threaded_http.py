"""The real app behind the real HTTP protocol on a loopback socket, served from a thread of the test process.

For tests of the HTTP layer that need a given parser (httptools or h11) or shortened deadlines
(``HeadLimits``): ``uvicorn.Server`` runs the app of ``create_app(settings)`` exactly as ``service.server.run``
configures it, on its own event loop in a thread; only the protocol class, its limits and the keep-alive
timeout are the test's. Tests of the shipped constants use a real server subprocess (``live_server``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from service.api.app import create_app
from service.server.http_guard import H11Guard, HeadLimits, HttpToolsGuard
from service.server.run import uvicorn_config
from service.server.transport import Gathering
from service.settings import ServiceSettings


class HttpToolsProtocol(Gathering, HttpToolsGuard):
    """The server's protocol on httptools."""


class H11Protocol(Gathering, H11Guard):
    """The server's protocol on h11 (what the server runs where httptools is not installed)."""


PROTOCOLS: dict[str, type] = {"httptools": HttpToolsProtocol, "h11": H11Protocol}


@dataclasses.dataclass
class Threaded:
    host: str
    port: int
    app: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def connect(self, timeout: float = 10.0) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@contextlib.contextmanager
def serving(
    settings: ServiceSettings, parser: str, *, limits: HeadLimits | None = None, keep_alive_s: float | None = None
) -> Iterator[Threaded]:
    app = create_app(settings)
    config = uvicorn_config(settings, app, on_refused=app.state.metrics.refused_connection)
    config.http = PROTOCOLS[parser]  # type: ignore[assignment]
    config.head_limits = limits or HeadLimits()
    if keep_alive_s is not None:
        config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the threaded server did not start")
        time.sleep(0.02)
    try:
        yield Threaded("127.0.0.1", sock.getsockname()[1], app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
