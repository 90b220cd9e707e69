"""A request body of declared length received whole by the HTTP protocol and handed over in one piece.

Why: through uvicorn's httptools protocol a 600 KB inference body was copied five times before the decoder
saw it (uvloop's read, httptools' body callback, uvicorn's ``bytearray`` accumulation, ``bytes()`` of it in
each ASGI message, the route's join of about ten 64 KiB messages), and each 64 KiB paused and resumed the
socket: under callgrind, 3.0 M of the 4.5 M instructions of a lone request (bench/request_stages.py). The
body of an inference request (``INLINE_PATHS``) with a ``Content-Length`` of at most ``INLINE_BODY_MAX`` and
no ``Transfer-Encoding`` is instead taken by ``http_guard.HttpToolsGuard`` past the parser: the socket reads
it straight into one buffer of its length (``InlineReading``, served through ``transport.BufferedReads``;
only the part that came in the head's read is copied there). The KServe route decodes a read-only view of that
buffer (``service.api.bodies.read_body(view_ok=True)``); any other application gets one ``http.request``
message with the whole body; later ``receive`` calls are uvicorn's own (they wait for the disconnect).

Bounds, as uvicorn's own flow control: until the application first asks for the body, at most
``HIGH_WATER_LIMIT`` bytes are kept and reading is paused beyond; once it has asked, the body is read whole,
at most its declared length (<= ``INLINE_BODY_MAX``). A body the application answered without reading is
counted and dropped as it arrives (the guard's unread-body deadline still applies). Larger or chunked bodies
(model uploads) stream through the parser as before.
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any

import httptools
import numpy as np
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT

from service.api.bodies import INLINE_BODY

MIB = 1024 * 1024
READ_SIZE = 256 * 1024
"""The scratch buffer of a buffered read: uvloop's own read size."""
INLINE_BODY_MAX = 16 * MIB
"""Largest declared body taken whole (a batch of 27 of the demo model's 600 KB images); larger ones stream."""


INLINE_PATHS = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/infer|/predict")
"""Whose bodies are taken inline: the inference routes' (KServe V2 infer, /predict). Model uploads keep
streaming to their staging file as they arrive."""


def inline_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared length of a body to take whole, or None (no or zero length, chunked, or too large)."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length" and length is None:
            length = value
    if length is None or not length.strip().isdigit():
        return None
    n = int(length)
    return n if 0 < n <= INLINE_BODY_MAX else None


class InlineBody:
    """The body of one request cycle (uvicorn's ``RequestResponseCycle``), whose ``receive`` it replaces.

    Reads land in ``buffer`` (uninitialised memory of the declared length): straight from the socket where
    the protocol reads into ``window()``, else copied by ``add``. The application gets it as one ASGI message
    (``receive``: a copy, as ASGI's ``bytes``) or, through ``view``, as a read-only view (no copy)."""

    __slots__ = ("_cycle", "buffer", "delivered", "filled", "length", "wanted")

    def __init__(self, cycle: Any, length: int) -> None:
        self._cycle = weakref.ref(cycle)
        """Weak: the cycle holds this body (its ``receive``, its scope's extension), and a reference back made them
        garbage only Python's cyclic collector frees: the cycle, this buffer and the transport with an answer not
        yet sent outlived the connection (three rounds of clients that reset mid-answer grew the server by
        hundreds of MiB). The cycle outlives every use of its body: the application runs inside the cycle's
        ``run_asgi``, and the protocol keeps its current cycle while it feeds that cycle's body."""
        self.length = length
        self.buffer = memoryview(np.empty(length, np.uint8)).cast("B")
        self.filled = 0
        self.wanted = False
        """The application has asked for the body: read it whole, without pausing."""
        self.delivered = False
        cycle.receive = self.receive
        cycle.scope.setdefault("extensions", {})[INLINE_BODY] = self

    @property
    def cycle(self) -> Any:
        return self._cycle()

    @property
    def complete(self) -> bool:
        return self.filled == self.length

    @property
    def dropping(self) -> bool:
        """Answered without reading it: what still arrives is counted and dropped."""
        return bool(self.cycle.response_complete)

    def window(self) -> memoryview | None:
        """Where the next socket read may go (never past this body), None while dropping."""
        return None if self.dropping else self.buffer[self.filled:]

    def received(self, nbytes: int) -> None:
        """``nbytes`` were read into ``window()``."""
        self.filled += nbytes
        if not self.wanted and self.filled > HIGH_WATER_LIMIT and not self.complete and not self.dropping:
            self.cycle.flow.pause_reading()

    def add(self, data: bytes | memoryview) -> int:
        """Take what belongs to this body from ``data`` (copied); returns how many bytes that was (the rest is
        the next request's)."""
        taken = min(len(data), self.length - self.filled)
        if not self.dropping:
            self.buffer[self.filled:self.filled + taken] = memoryview(data)[:taken] if taken < len(data) else data
        self.received(taken)
        return taken

    async def _arrived(self) -> bool:
        """Wait until the whole body is here; False when the client went away or the answer is complete."""
        cycle = self.cycle
        if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
            cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        self.wanted = True
        while not self.complete and not cycle.disconnected and not cycle.response_complete:
            cycle.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        return not (cycle.disconnected or cycle.response_complete)

    async def receive(self) -> dict[str, Any]:
        """The ASGI receive of the cycle: the whole body once, then uvicorn's (disconnect or nothing)."""
        if self.delivered:
            return await type(self.cycle).receive(self.cycle)
        if not await self._arrived():
            return {"type": "http.disconnect"}
        self.delivered = True
        return {"type": "http.request", "body": bytes(self.buffer), "more_body": False}

    async def view(self) -> memoryview | None:
        """The whole body as a read-only view, without a copy; None when the client went away first. Once
        taken, ``receive`` goes on as after the last ASGI body message."""
        if self.delivered or not await self._arrived():
            return None
        self.delivered = True
        return self.buffer.toreadonly()


class _Scratch(threading.local):
    """One scratch buffer per thread, shared by every connection its event loop serves.

    Safe because a read is done before the next begins: the loop calls ``get_buffer``, reads into it and calls
    ``buffer_updated`` in one step of its thread, and the guard's ``_received`` is done with the bytes when it
    returns (llhttp keeps none; what the protocol keeps of them, URL, fields, body, it copies). A buffer per
    connection cost 256 KiB each: 1,000 connections trickling a head grew the server by 257 MiB."""

    def __init__(self) -> None:
        self.buffer = bytearray(READ_SIZE)
        self.view = memoryview(self.buffer)


_SCRATCH = _Scratch()


class InlineReading:
    """What ``http_guard.HttpToolsGuard`` mixes in to take bodies inline, read as an ``asyncio.BufferedProtocol``:
    reads of an inline body land in its buffer, the others in the thread's scratch buffer (``_Scratch``) handed
    to the guard's ``_received`` (heads, and bodies the parser takes). Uses the guard's and uvicorn's protocol
    attributes."""

    _refused: bool
    _behind: int | None
    parser: Any

    def _init_inline(self) -> None:
        self._inline: InlineBody | None = None
        """The body being taken past the parser, if any."""
        self._into_inline = False

    def _take_inline(self, cycle: Any, headers: list[tuple[bytes, bytes]]) -> None:
        """A new request's head is complete: take its body inline if it is an inference request's
        (``INLINE_PATHS``) and its length qualifies (``inline_length``)."""
        if INLINE_PATHS.fullmatch(cycle.scope["path"]) is None:
            return
        length = inline_length(headers)
        if length is not None:
            self._inline = InlineBody(cycle, length)

    def on_body(self, body: bytes) -> None:
        if self._inline is not None:  # the head's end was not found in its read: the parser met the body
            self._inline.add(body)
        else:
            super().on_body(body)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._inline = None
        super().on_message_complete()  # type: ignore[misc]

    def _receive_body(self, data: bytes | bytearray | memoryview) -> int:
        inline = self._inline
        if inline is None:
            return super()._receive_body(data)  # type: ignore[misc,no-any-return]
        taken = inline.add(data)
        self._inline_received(inline)
        return taken

    def _inline_received(self, inline: InlineBody) -> None:
        if inline.complete:  # the parser, still waiting for this body, is replaced by a fresh one
            self.on_message_complete()
            if self._behind is not None:  # the connection's last request (not kept alive): nothing more is parsed
                return
            self.parser = httptools.HttpRequestParser(self)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's

    def get_buffer(self, sizehint: int) -> memoryview:
        window = None if self._inline is None or self._refused else self._inline.window()
        self._into_inline = window is not None
        return window if window is not None else _SCRATCH.view

    def buffer_updated(self, nbytes: int) -> None:
        inline = self._inline
        if self._into_inline and inline is not None:
            inline.received(nbytes)
            self._inline_received(inline)
            self._sync_timers()  # type: ignore[attr-defined]
        else:
            self._received(_SCRATCH.buffer, nbytes)  # type: ignore[attr-defined]
