"""The real server (uvicorn + the gRPC listener, ``service.server.run``) on free loopback ports, in a thread of
the test process, around an in-process app: real sockets for the real clients (``tritonclient.http``,
``tritonclient.grpc`` sync, aio and streaming) without a subprocess per test module.

``ThreadedServer(settings)`` starts it (``port`` and ``grpc_port`` 0 pick free ports); ``url`` and
``grpc_target`` say where; ``app`` is the app, so a test can look at its dataplane; ``stop`` shuts down as a
SIGTERM would (listeners drain, then the models stop).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from service.api.app import create_app
from service.grpc.server import GrpcServer
from service.server.run import _Server, uvicorn_config
from service.settings import ServiceSettings


class ThreadedServer:
    def __init__(self, settings: ServiceSettings, timeout_s: float = 60.0) -> None:
        self.settings = settings
        self.app: Any = create_app(settings)
        self.grpc = GrpcServer(settings, self.app.state.dataplane) if settings.grpc_port is not None else None
        self.server = _Server(uvicorn_config(settings, self.app), self.app.state.lifecycle, announce=False,
                              grpc=self.grpc)
        self.thread = threading.Thread(target=self.server.run, name="threaded-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not (self.server.started and (self.grpc is None or self.grpc.port)):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the threaded server did not start")
            time.sleep(0.02)
        while not self.app.state.dataplane.ready:
            if time.monotonic() > deadline:
                raise RuntimeError("the threaded server did not get ready")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if settings.tls_cert_file is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.grpc_target = f"127.0.0.1:{self.grpc.port}" if self.grpc is not None else None

    @property
    def dataplane(self) -> Any:
        return self.app.state.dataplane

    def stop(self) -> None:
        self.app.state.lifecycle.begin_shutdown()
        self.server.should_exit = True
        self.thread.join(timeout=self.settings.shutdown_grace_s + 15)
