"""The gRPC listener of one server process: a ``grpc.aio`` server on the event loop that runs uvicorn.

``service.server.run`` starts it once the HTTP listener is up (and stops it first on shutdown, so its
in-flight calls drain while REST's do, before the models stop). Options:

* ``grpc.max_receive_message_length``: ``max_request_mb``, REST's body limit (a larger message is refused by
  gRPC itself with RESOURCE_EXHAUSTED); sending is not capped, as REST's responses are not: an answer is as
  large as the outputs of a request the limits accepted.
* ``grpc.so_reuseport``: gRPC sets SO_REUSEPORT by default, which would let this server silently share a port
  another server already listens on. One process binds without it (a port in use fails the start); the
  workers of several (``reuse_port``) share the port the supervisor reserved (``server.supervisor``), the way
  their HTTP sockets do.
* TLS: ``tls_cert_file`` / ``tls_key_file`` (both or neither) give ``grpc.ssl_server_credentials``.
"""

from __future__ import annotations

import logging

import grpc

from service.dataplane import DataPlane
from service.settings import ServiceSettings

from .messages import pb_grpc
from .servicer import Servicer

log = logging.getLogger("service.grpc")

MIB = 1024 * 1024


PORT_HINT = "set SERVICE_GRPC_PORT to a free port (0: any free one) or to off (no gRPC)"
"""What a server that cannot bind its gRPC port tells the operator (a second server on one host needs it)."""


class GrpcBindError(OSError):
    """The gRPC port could not be bound (in use, or not an address of this host)."""


def display_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class GrpcServer:
    """``start`` binds and serves until ``stop``; ``port`` is the bound port once started."""

    def __init__(self, settings: ServiceSettings, dataplane: DataPlane, *, reuse_port: bool = False) -> None:
        if settings.grpc_port is None:
            raise ValueError("gRPC is off (grpc_port is None)")
        self.settings = settings
        self.dataplane = dataplane
        self.reuse_port = reuse_port
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def tls(self) -> bool:
        return self.settings.tls_cert_file is not None

    @property
    def url(self) -> str:
        return f"grpc://{display_host(self.settings.host)}:{self.port}"

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.settings.max_request_mb * MIB),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
        ]

    async def start(self) -> int:
        """Bind ``host:grpc_port`` and serve; the bound port (``grpc_port`` 0 picks a free one)."""
        server = grpc.aio.server(options=self.options())
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(self.dataplane), server)
        address = f"{display_host(self.settings.host)}:{self.settings.grpc_port}"
        try:
            if self.tls:
                port = server.add_secure_port(address, self._credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc reports a failed bind this way
            raise GrpcBindError(f"cannot listen for gRPC on {address}: the port is in use or the address is not "
                                f"this host's; {PORT_HINT}") from exc
        if port == 0:
            raise GrpcBindError(f"cannot listen for gRPC on {address}; {PORT_HINT}")
        await server.start()
        self._server, self.port = server, port
        return port

    def _credentials(self) -> grpc.ServerCredentials:
        settings = self.settings
        assert settings.tls_cert_file is not None and settings.tls_key_file is not None
        key, chain = settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes()
        return grpc.ssl_server_credentials([(key, chain)])

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once; calls in progress get ``grace_s``, then they are cancelled."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
