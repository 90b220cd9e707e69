"""Request heads under limits and a deadline, and every refusal of the HTTP layer answered as JSON.

Why: uvicorn's HTTP protocols put no bound on a request head. Through httptools (llhttp) the server took
10,000 header fields, and one 64 MiB header value, which httptools gathers by repeated concatenation
(quadratic), took 5.4 s, grew the server by 158 MiB and delayed its liveness answers to 2.6 s
(bench/results/hostile-heads-2026-12-01-cpu-before.json). Nothing bounded how long a head may take either:
uvicorn's keep-alive timer stops at the first byte, so a head trickled at 1 byte/s held its connection as long
as the client liked. And uvicorn answers what its parser refuses (smuggling attempts, malformed request
lines) with a text/plain 400 of its own, unlike every other error of the server.

Limits (constants, not settings: no client of an inference server comes near them; a proxy in front that
needs more is misconfigured):

* ``MAX_HEAD_BYTES`` 64 KiB for the request line and header fields together -> 431. Bytes past the budget are
  never handed to the parser, so an unfinished head costs at most the budget plus one socket read.
* ``MAX_HEADER_FIELDS`` 100 -> 431 (nginx and Node allow a similar head size; 100 is Go's and Apache's order).
* ``MAX_URL_BYTES`` 8 KiB for the request target -> 414 (Apache's and nginx's default line size).
* ``HEAD_TIMEOUT_S`` 10 s from the first read of an unfinished head to its end -> 408. A connection with
  nothing in progress must send its next byte within uvicorn's keep-alive timeout: uvicorn arms that timer
  after a response only, and any byte stops it, so here it is armed as well when a connection opens and
  once a body that arrived after its answer has ended.
* ``UNREAD_BODY_TIMEOUT_S`` 10 s: when the application answered without reading the whole body (401, 413,
  415, ...), the rest must arrive within this, or the connection is closed. The deadline of a body the
  application reads is ``service.api.bodies``'s: only the route knows how long its body may take.

A refusal is a JSON ``{"error": ...}`` with ``Connection: close`` where a response can still be written, and
the connection is closed (after at most ``LINGER_S`` of dropping what the client still sends). Where an
earlier request of the connection is still being answered (pipelining), that answer is finished first and
nothing is written for the refused one. ``on_refused`` counts each refusal by reason
(``service_connections_refused_total{reason}``).

How: one guard over either of uvicorn's parsers: ``HttpToolsGuard`` where httptools is installed (uvicorn's
choice too), ``H11Guard`` otherwise; ``GuardedProtocol`` is the one in use, and ``GuardedConfig`` brings it
its limits and the counting callback (uvicorn builds each protocol from its config). ``data_received`` hands the parser
at most the head budget that is left while a head is being read; the parser's own events count the fields
and the URL and say when a head is complete. A head that starts in the same read as the end of the previous
request (a pipelining client) is counted from the next read, so it may hold one read (at most 256 KiB)
more than the budget: still bounded. Nothing behind a request that ends its connection is parsed (``_behind``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import logging
import re
from collections.abc import Callable
from typing import Any

import h11
import orjson
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn[standard] brings httptools; without it uvicorn uses h11
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - exercised by tests/security/test_http_limits.py in a subprocess
    httptools = None
    HttpToolsProtocol = None

log = logging.getLogger("service.http")

KIB = 1024
MAX_HEAD_BYTES = 64 * KIB
MAX_HEADER_FIELDS = 100
MAX_URL_BYTES = 8 * KIB
HEAD_TIMEOUT_S = 10.0
UNREAD_BODY_TIMEOUT_S = 10.0
LINGER_S = 2.0
"""After a refusal the server stops sending (FIN) and drops what still arrives for up to this long before it
closes: closing with unread bytes would send a reset, and a client still sending would lose the answer."""


@dataclasses.dataclass(frozen=True)
class HeadLimits:
    """The limits one server applies (the module's constants; tests shorten the deadlines)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    max_header_fields: int = MAX_HEADER_FIELDS
    max_url_bytes: int = MAX_URL_BYTES
    head_timeout_s: float = HEAD_TIMEOUT_S
    unread_body_timeout_s: float = UNREAD_BODY_TIMEOUT_S


class GuardedConfig(uvicorn.Config):
    """uvicorn's configuration plus the guard's: its limits and the callback that counts each refusal by
    reason (under a plain ``uvicorn.Config`` the guard applies the default limits and counts nothing)."""

    def __init__(
        self, app: Any, *, head_limits: HeadLimits = HeadLimits(), on_refused: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.head_limits = head_limits
        self.on_refused = on_refused


@dataclasses.dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    """A ``service.metrics.REFUSAL_REASONS`` label."""
    message: str


def head_too_large(limits: HeadLimits) -> Refusal:
    return Refusal(431, "head_size", "the request head (request line and header fields) is larger than "
                   f"{limits.max_head_bytes // KIB} KiB")


def too_many_fields(limits: HeadLimits) -> Refusal:
    return Refusal(431, "header_fields", f"the request has more than {limits.max_header_fields} header fields")


def url_too_long(limits: HeadLimits) -> Refusal:
    return Refusal(414, "url_length", f"the request target is longer than {limits.max_url_bytes // KIB} KiB")


def head_timeout(limits: HeadLimits) -> Refusal:
    return Refusal(408, "head_timeout", f"the request head did not arrive within {limits.head_timeout_s:g} s")


_NOT_PLAIN = re.compile(r"[^A-Za-z0-9 ,.'-]+")


def malformed(parser_message: str = "") -> Refusal:
    """400 with the parser's reason, cut before any bytes it quotes (h11 appends them after a colon)."""
    detail = _NOT_PLAIN.sub(" ", parser_message.split(":", 1)[0]).strip()[:100]
    return Refusal(400, "malformed", "malformed HTTP request" + (f": {detail}" if detail else ""))


NOT_CHUNKED = Refusal(400, "malformed", "malformed HTTP request: only Transfer-Encoding chunked is supported")
LENGTH_AND_CHUNKED = Refusal(
    400, "malformed", "malformed HTTP request: Transfer-Encoding and Content-Length together (request smuggling)"
)
"""Refused by both parsers alike (llhttp refuses the second itself; h11 would take either).
RFC 9112 section 6.1 lets a server reject both; a proxy in front that reads the other one could be
smuggled a second request."""


def response_bytes(refusal: Refusal, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 response carrying ``{"error": message}`` that closes the connection."""
    body = orjson.dumps({"error": refusal.message})
    phrase = http.HTTPStatus(refusal.status).phrase.encode()
    lines = [b"HTTP/1.1 %d %s\r\n" % (refusal.status, phrase)]
    lines += [b"%s: %s\r\n" % (name, value) for name, value in default_headers]
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(lines) + body


def _head_end(data: bytes | bytearray | memoryview, start: int, stop: int) -> int:
    """Where the head that ``data[start:stop]`` holds ends (just past its blank line), else ``stop``."""
    if isinstance(data, (bytes, bytearray)):
        end = data.find(b"\r\n\r\n", start, stop)
        if end != -1:
            return end + 4
    return stop


class _Guard:
    """What both parsers share: the head budget and deadline, the idle timer of a fresh connection, the
    deadline of a body nobody reads, and writing refusals. Mixed in front of a uvicorn protocol, whose
    attributes (``transport``, ``loop``, ``cycle``, ``flow``, ``server_state``, keep-alive timer) it uses."""

    limits: HeadLimits
    transport: Any
    loop: asyncio.AbstractEventLoop
    cycle: Any
    flow: Any
    server_state: Any
    client: Any
    timeout_keep_alive: float
    timeout_keep_alive_task: asyncio.TimerHandle | None

    def _init_guard(self, config: uvicorn.Config) -> None:
        guarded = isinstance(config, GuardedConfig)
        self.limits = config.head_limits if guarded else HeadLimits()
        self._on_refused = config.on_refused if guarded else None
        self._head_bytes = 0
        """Bytes of the head being read that were handed to the parser."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._unread_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._refused = False
        """Set once the connection is refused: nothing more is parsed, what arrives is dropped."""
        self._behind: int | None = None
        """Bytes dropped unparsed behind the last request (``keep_alive`` false; None before it). h11 stops itself."""

    # ------------------------------------------------------------------ what each parser says
    def _reading_head(self) -> bool:
        """No request body is being received: what arrives belongs to a head."""
        raise NotImplementedError

    def _head_pending(self) -> bool:
        """A head has begun and the parser has not seen its end."""
        raise NotImplementedError

    def _unread_body(self) -> bool:
        """The response is complete while the request's body is still arriving."""
        raise NotImplementedError

    def _idle(self) -> bool:
        """Nothing is in progress: no head begun, no body arriving, no response being written."""
        raise NotImplementedError

    def _feed(self, data: bytes | memoryview) -> bool:
        """Hand ``data`` to the parser; False once the connection is refused or closing."""
        raise NotImplementedError

    def _head_complete(self) -> None:
        """The parser saw the end of a head: the next one starts with a whole budget."""
        self._head_bytes = 0

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler  # type: ignore[attr-defined]
        )

    def connection_lost(self, exc: Exception | None) -> None:
        """Every timer stops: uvicorn's keep-alive one, left running after a reset, kept request and answer alive."""
        self._cancel_timers()
        for timer in (self._linger_timer, self.timeout_keep_alive_task):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes | memoryview) -> None:
        self._received(data, len(data))

    def _received(self, data: bytes | bytearray | memoryview, size: int) -> None:
        """The first ``size`` bytes of ``data`` arrived."""
        if self._refused:
            return
        self._unset_keepalive_if_required()  # type: ignore[attr-defined]
        start = 0
        while start < size:
            if self._behind is not None:
                self._drop_behind(size - start)
                break
            if not self._reading_head():
                start += self._receive_body(memoryview(data)[start:size] if start or size < len(data) else data)
                continue
            room = self.limits.max_head_bytes - self._head_bytes
            if room <= 0:
                self._refuse(head_too_large(self.limits))
                return
            # the head alone where its end is in this read (its body may then bypass the parser); memoryview
            # slices: a read holds the head and up to ~256 KiB of body, bytes slices would copy it
            stop = _head_end(data, start, min(size, start + room))
            self._head_bytes += stop - start
            if not self._feed(data if start == 0 and stop == len(data) else memoryview(data)[start:stop]):
                return
            start = stop
        self._sync_timers()

    def _receive_body(self, data: bytes | bytearray | memoryview) -> int:
        """Bytes of a body (and maybe what follows it): returns how many were taken. Here the parser takes them
        all (a pipelined head after the body is counted from the next read)."""
        self._feed(data)
        return len(data)

    def _drop_behind(self, nbytes: int) -> None:
        """Up to the head budget is read behind the last request (a stray CRLF, a pipelined request), so that the
        close after the answer is no reset (RFC 9112 9.6); then reading pauses, again if uvicorn's receive resumed."""
        self._behind = (self._behind or 0) + nbytes
        if self._behind > self.limits.max_head_bytes:
            self.flow.pause_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._sync_timers()

    # ------------------------------------------------------------------ timers
    def _sync_timers(self) -> None:
        if self._refused or self.transport.is_closing():
            self._cancel_timers()
            return
        if self._head_pending():
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._unread_body():
            if self._unread_timer is None:
                self._unread_timer = self.loop.call_later(self.limits.unread_body_timeout_s, self._unread_timed_out)
        elif self._unread_timer is not None:
            self._unread_timer.cancel()
            self._unread_timer = None
        if self.timeout_keep_alive_task is None and self._idle():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler  # type: ignore[attr-defined]
            )

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._unread_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._unread_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._refused and not self.transport.is_closing():
            self._refuse(head_timeout(self.limits))

    def _unread_timed_out(self) -> None:
        self._unread_timer = None
        if not self._refused and not self.transport.is_closing():
            self._refused = True
            self._count("body_timeout")
            log.debug("%s: closed, the unread request body did not end in time", self.client)
            self.transport.close()

    # ------------------------------------------------------------------ refusals
    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this when its parser refuses the bytes: answer as JSON instead of its text/plain."""
        self._refuse(self._parser_refusal())

    def _parser_refusal(self) -> Refusal:
        return malformed()

    def _count(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

    def _refuse(self, refusal: Refusal) -> None:
        """Answer ``refusal`` where a response can be written, and close the connection."""
        self._refused = True
        self._cancel_timers()
        self._count(refusal.reason)
        log.debug("%s: refused with %d: %s", self.client, refusal.status, refusal.message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not cycle.more_body:  # an earlier request, received whole, is being answered: finish it, close
                cycle.keep_alive = False
                self.flow.pause_reading()
                return
            cycle.disconnected = True  # the refused bytes are the body of the request in progress
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        if self.transport.is_closing():
            return
        self.transport.write(response_bytes(refusal, self.server_state.default_headers))
        self._close_after_answer()

    def _close_after_answer(self) -> None:
        """FIN now, close once the client has closed too or after ``LINGER_S`` (reading and dropping meanwhile)."""
        try:
            self.transport.write_eof()
        except (NotImplementedError, RuntimeError, OSError):  # TLS has no half-close
            self.transport.close()
            return
        self.transport.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


class _StopParsing(Exception):
    """Raised from a parser callback to end parsing; the refusal is already recorded."""


if HttpToolsProtocol is not None:
    from .inline_body import InlineReading

    class HttpToolsGuard(InlineReading, _Guard, HttpToolsProtocol):
        """uvicorn's httptools protocol under the limits: fields and URL counted in llhttp's callbacks. It also
        reads as a buffered protocol (``get_buffer``/``buffer_updated``, through ``transport.BufferedReads``):
        bodies taken inline (``inline_body``) are read from the socket into their buffer."""

        def __init__(
            self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
            _loop: asyncio.AbstractEventLoop | None = None,
        ) -> None:
            super().__init__(config, server_state, app_state, _loop)
            self._init_guard(config)
            self._in_body = False
            self._callback_refusal: Refusal | None = None
            self._init_inline()

        def _reading_head(self) -> bool:
            return not self._in_body

        def _head_pending(self) -> bool:
            return self._head_bytes > 0 and not self._in_body

        def _unread_body(self) -> bool:
            return self._in_body and self.cycle is not None and self.cycle.response_complete

        def _idle(self) -> bool:
            return (not self._in_body and self._head_bytes == 0 and not self.pipeline
                    and (self.cycle is None or self.cycle.response_complete))

        def _feed(self, data: bytes | memoryview) -> bool:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:  # as uvicorn does (run.py turns WebSockets off)
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return False
            except httptools.HttpParserError as exc:
                if self._behind is None:  # else on_message_begin stopped the parser past the last request
                    self._refuse(self._callback_refusal or malformed(str(exc)))
                return False
            return not self._refused and not self.transport.is_closing()

        def _stop(self, refusal: Refusal) -> None:
            self._callback_refusal = refusal
            raise _StopParsing

        def on_message_begin(self) -> None:  # none past the last (llhttp would go on after HTTP/1.0 keep-alive)
            if self._behind is not None:
                raise _StopParsing
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            if len(self.url) + len(url) > self.limits.max_url_bytes:
                self._stop(url_too_long(self.limits))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if len(self.headers) >= self.limits.max_header_fields:
                self._stop(too_many_fields(self.limits))
            if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
                self._stop(NOT_CHUNKED)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_complete()
            self._in_body = True
            previous = self.cycle
            super().on_headers_complete()
            if self.cycle is not previous and not self.parser.should_upgrade():
                self._take_inline(self.cycle, self.headers)

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()
            self._behind = None if self.cycle.keep_alive else 0  # the connection's last request: parse no more


class _BoundedConnection(h11.Connection):
    """h11's server connection that checks each request head against the limits."""

    def __init__(self, limits: HeadLimits, on_head: Callable[[], None]) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self._limits, self._on_head = limits, on_head
        self.refusal: Refusal | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            if self.refusal is None:
                too_large = exc.error_status_hint == 431
                self.refusal = head_too_large(self._limits) if too_large else malformed(str(exc))
            raise
        if isinstance(event, h11.Request):
            self._on_head()
            names = {name for name, _ in event.headers}  # h11 gives them lower-cased
            if len(event.target) > self._limits.max_url_bytes:
                self.refusal = url_too_long(self._limits)
            elif len(event.headers) > self._limits.max_header_fields:
                self.refusal = too_many_fields(self._limits)
            elif b"transfer-encoding" in names and b"content-length" in names:
                self.refusal = LENGTH_AND_CHUNKED
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal.message, error_status_hint=self.refusal.status)
        return event


class H11Guard(_Guard, H11Protocol):
    """uvicorn's h11 protocol under the limits: h11's parsed heads checked as they come out."""

    def __init__(
        self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._init_guard(config)
        self.conn = _BoundedConnection(self.limits, self._head_complete)

    def _reading_head(self) -> bool:
        """Only a connection waiting for a request parses a head: bytes that arrive while a whole request is
        being answered (their state DONE) stay unparsed in h11's buffer until the answer is complete (and
        reading pauses), so they are passed on uncounted; h11 bounds that head once it parses it
        (``max_incomplete_event_size``). Counting them refused the body of a request pipelined there."""
        return self.conn.their_state is h11.IDLE

    def _head_pending(self) -> bool:
        return self._head_bytes > 0 and self.conn.their_state is h11.IDLE

    def _unread_body(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY

    def _idle(self) -> bool:
        return (self.conn.their_state is h11.IDLE and self._head_bytes == 0
                and (self.cycle is None or self.cycle.response_complete))

    def _feed(self, data: bytes | memoryview) -> bool:
        self.conn.receive_data(data)
        self.handle_events()
        return not self._refused and not self.transport.is_closing()

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_timers()

    def _parser_refusal(self) -> Refusal:
        return self.conn.refusal or malformed()


GuardedProtocol: type[asyncio.Protocol] = HttpToolsGuard if HttpToolsProtocol is not None else H11Guard
"""The guarded protocol on uvicorn's preferred parser (httptools where installed, else h11)."""
