"""One socket write per response: uvicorn's HTTP protocol with its writes gathered per event-loop step.

Why: uvicorn writes a response's status line and headers with one ``transport.write`` and its body with
another, so every answer costs two ``send`` calls, and a waiting client is woken by the head alone and
then again by the body. py-spy put 15-20 % of the event loop's time inside those two writes for a lone
600 KB KServe request on the CPU machine. Gathered, that request took 1.770 against 1.827 ms (median of 5
alternating rounds; bench/results/http-overhead-2026-12-01-cpu-gather.json, variant ``service_no_gather``).

How: the protocol's transport is wrapped in ``GatheredWrites``, which keeps the writes made during one step
of the event loop and hands them to the real transport together (``writelines``) at the end of that
step. A response written in one step (every ``Response`` of ours: head and body are sent without
suspending in between) leaves in one system call. Nothing waits for a timer: the gathered writes go out
before the loop polls the sockets again. ``close`` sends what is gathered first. Flow control is
uvicorn's own: the real transport pauses the protocol when its buffer fills, as before.

The protocol underneath is ``http_guard``'s: uvicorn's (httptools where installed, else h11) with the
request-head limits and deadlines.
"""

from __future__ import annotations

import asyncio
from typing import Any

from service.server.http_guard import GuardedProtocol


class GatheredWrites:
    """A transport proxy: ``write``s of one event-loop step reach the real transport as one ``writelines``."""

    __slots__ = ("_loop", "_pending", "_scheduled", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        # keep bytes as they are; copy a mutable buffer, which its owner may change after this call returns
        self._pending.append(data if isinstance(data, bytes) else bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what was gathered to the real transport (dropped if it is already closing)."""
        self._scheduled = False
        if not self._pending:
            return
        parts, self._pending = self._pending, []
        if self._transport.is_closing():
            return
        if len(parts) == 1:
            self._transport.write(parts[0])
        else:
            self._transport.writelines(parts)

    def get_write_buffer_size(self) -> int:
        return sum(len(p) for p in self._pending) + self._transport.get_write_buffer_size()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class Gathering:
    """Mixin in front of a uvicorn HTTP protocol: its transport is wrapped in ``GatheredWrites``."""

    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(GatheredWrites(transport, self.loop))  # type: ignore[arg-type, misc]


class GatheredWritesProtocol(Gathering, GuardedProtocol):  # type: ignore[valid-type, misc]
    """uvicorn's HTTP protocol (httptools where installed), guarded, writing through ``GatheredWrites``."""


class BufferedReads(asyncio.BufferedProtocol):
    """The served protocol as the event loop sees it: a buffered protocol, so that reads of a request body the
    protocol takes whole land in that body's buffer (``inline_body``), never in a ``bytes`` of the loop's.

    A proxy, because uvloop reads into a protocol's buffer only when the protocol is not an
    ``asyncio.Protocol``, and uvicorn's protocols are. Every call the transport makes is handed to the
    ``GatheredWritesProtocol`` inside, which uvicorn tracks and shuts down as its connection."""

    __slots__ = ("inner",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = GatheredWritesProtocol(*args, **kwargs)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.inner.get_buffer(sizehint)  # type: ignore[no-any-return]

    def buffer_updated(self, nbytes: int) -> None:
        self.inner.buffer_updated(nbytes)


ServedProtocol: type[asyncio.BaseProtocol] = (
    BufferedReads if hasattr(GatheredWritesProtocol, "get_buffer") else GatheredWritesProtocol
)
"""What uvicorn serves HTTP with: buffered reads over httptools, else (h11) the protocol as it is."""
