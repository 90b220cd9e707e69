"""Reading request bodies under a size limit, counted while the bytes arrive, and under a deadline.

A declared ``Content-Length`` over the limit is refused before reading anything; chunked bodies (no
length) are cut off as soon as the running count passes the limit. Uploads go straight to a staging
file chunk by chunk (raw body, or a multipart form parsed by python-multipart's streaming parser), so a
model of hundreds of MiB never sits in memory and Starlette never spools a copy of it to a temp dir.

Deadline (``timeout_s``: the routes pass ``request_timeout_s``): a body must have arrived ``timeout_s``
(30 s by default) plus one second per MiB after the handler starts reading it, the MiB counted from its
``Content-Length``, or from the route's size limit when it is chunked (``body_deadline_s``). A client
slower than that (a slowloris trickling bytes) gets 408 with ``Connection: close``, its buffers and its
request slot are freed, and ``service_connections_refused_total{reason="body_timeout"}`` counts it. So a
600 KB inference body has about 31 s and a 512 MiB upload 542 s: a client must keep up at least 1 MiB/s
beyond the first 30 s.
The deadline lives here, not in the HTTP protocol, because only the route knows what it reads (an upload
may take minutes, an inference body may not); the protocol (``service.server.http_guard``) bounds the
head, and the body of a request whose handler answered without reading it.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from service.errors import (
    BadRequestError,
    InsufficientStorageError,
    PayloadTooLargeError,
    RequestBodyTimeoutError,
    UnsupportedMediaTypeError,
    storage_error,
)

from .deps import metrics_of

MIB = 1024 * 1024
WRITE_CHUNK = MIB  # bytes gathered before one (threaded) file write
MAX_FORM_FIELD = 64 * 1024  # the multipart ``config`` field
MAX_LABELS_FIELD = 512 * 1024  # the multipart ``labels`` field (within MULTIPART_OVERHEAD)
TEXT_FIELDS = {"config": MAX_FORM_FIELD, "labels": MAX_LABELS_FIELD}
"""Small text fields an upload form may carry besides ``file``, and their limits in bytes."""
MULTIPART_OVERHEAD = MIB  # boundaries, part headers and the config field on top of the file limit
MIN_BODY_RATE = MIB
"""Bytes per second a body must keep up beyond ``request_timeout_s`` (see the module docstring)."""


INLINE_BODY = "service.inline_body"
"""The scope extension under which the HTTP server puts a body it read whole into a buffer of its own
(``service.server.inline_body``): an ``InlineBodyHandle``."""


class InlineBodyHandle(Protocol):
    delivered: bool

    async def view(self) -> memoryview | None:
        """The whole body, read-only, without a copy; None when the client went away first."""
        ...


def inline_body_of(scope: dict[str, Any]) -> InlineBodyHandle | None:
    """The request's body read whole by the server, where it was and nobody has read it yet."""
    inline = scope.get("extensions", {}).get(INLINE_BODY)
    return None if inline is None or inline.delivered else inline


def _too_large(limit: int, what: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"{what} is larger than the limit of {limit // MIB} MiB")


def check_declared_length(request: Request, limit: int, what: str) -> int | None:
    """Refuse early when the client announces a body over the limit; returns the declared length."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.strip().isdigit():
        raise BadRequestError("Content-Length must be a non-negative integer")
    if int(declared) > limit:
        raise _too_large(limit, what)
    return int(declared)


def body_deadline_s(timeout_s: float, declared: int | None, limit: int) -> float:
    """Seconds a body may take: ``timeout_s`` plus its size (declared, else the limit) at ``MIN_BODY_RATE``."""
    return timeout_s + (limit if declared is None else declared) / MIN_BODY_RATE


async def _chunks(
    request: Request, declared: int | None, limit: int, what: str, timeout_s: float | None
) -> AsyncIterator[bytes]:
    """``request.stream()`` under the body deadline (``RequestBodyTimeoutError`` once it has passed; no
    deadline when ``timeout_s`` is None)."""
    stream = request.stream().__aiter__()
    if timeout_s is None:
        async for chunk in stream:
            yield chunk
        return
    deadline_s = body_deadline_s(timeout_s, declared, limit)
    deadline = asyncio.get_running_loop().time() + deadline_s
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await stream.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _body_timeout(request, what, deadline_s) from None
        yield chunk


def _body_timeout(request: Request, what: str, deadline_s: float) -> RequestBodyTimeoutError:
    """The 408 for a body that missed its deadline, counted in the metrics."""
    metrics_of(request).refused_connection("body_timeout")
    return RequestBodyTimeoutError(
        f"the {what} did not arrive within {deadline_s:.0f} s (the request deadline plus 1 s per MiB)"
    )


async def read_body(
    request: Request, limit: int, what: str = "request body", *, timeout_s: float | None = None,
    view_ok: bool = False,
) -> bytes | memoryview:
    """The whole body (decompressed when ``Content-Encoding`` is gzip or deflate), at most ``limit``, under
    the deadline of ``timeout_s``. ``view_ok``: a read-only view of the buffer the server read the body into
    will do (``service.server.inline_body``: no copy), else ``bytes``."""
    encoding = (request.headers.get("content-encoding") or "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise UnsupportedMediaTypeError(f"Content-Encoding {encoding[:32]!r} is not supported")
    declared = check_declared_length(request, limit, what)
    if timeout_s is None:
        body = await _collect(request, limit, what, view_ok)
    else:
        # One deadline over the whole read (not one per chunk: a 600 KB body arrives in ~10 chunks, and
        # each asyncio.timeout costs a timer-heap entry); nothing but the stream awaits inside it.
        deadline_s = body_deadline_s(timeout_s, declared, limit)
        try:
            async with asyncio.timeout(deadline_s):
                body = await _collect(request, limit, what, view_ok)
        except TimeoutError:
            raise _body_timeout(request, what, deadline_s) from None
    return body if encoding == "identity" else _inflate(body, limit, what)


async def _collect(request: Request, limit: int, what: str, view_ok: bool = False) -> bytes | memoryview:
    """Every chunk of the stream joined, refused as soon as the running count passes ``limit``; with
    ``view_ok``, the view of a body the server took inline (its ``Content-Length``, checked against ``limit``
    by ``read_body``)."""
    inline = inline_body_of(request.scope) if view_ok else None
    if inline is not None:
        view = await inline.view()
        if view is None:
            raise ClientDisconnect()
        return view
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        if not chunk:  # Starlette ends every stream with b"": joining it would copy the whole body once more
            continue
        total += len(chunk)
        if total > limit:
            raise _too_large(limit, what)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _inflate(data: bytes | memoryview, limit: int, what: str) -> bytes:
    """Decompress gzip or zlib data, never producing more than ``limit`` bytes (zip bombs)."""
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: accept a gzip or a zlib header
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error:
        raise BadRequestError(f"{what} is not valid compressed data") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise _too_large(limit, f"decompressed {what}")
    if not inflater.eof:
        raise BadRequestError(f"{what}: compressed data is truncated")
    return out


class _FileSink:
    """Buffers chunks and writes them to the staging file in a worker thread (the loop stays free)."""

    def __init__(self, fh: BinaryIO, limit: int) -> None:
        self.fh, self.limit = fh, limit
        self.size = 0
        self.pending: list[bytes] = []
        self.pending_size = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise _too_large(self.limit, "model upload")
        self.pending.append(data)
        self.pending_size += len(data)

    async def flush(self, force: bool = False) -> None:
        if not self.pending or (self.pending_size < WRITE_CHUNK and not force):
            return
        data = b"".join(self.pending)
        self.pending, self.pending_size = [], 0
        try:
            await asyncio.to_thread(self.fh.write, data)
            if force:
                await asyncio.to_thread(self.fh.flush)
        except OSError as exc:
            raise _storage_error(exc) from None


def _storage_error(exc: OSError) -> InsufficientStorageError | OSError:
    return storage_error(exc, "the upload") or exc


def _open_staged(dest: Path) -> BinaryIO:
    try:
        return dest.open("wb")
    except OSError as exc:
        raise _storage_error(exc) from None


async def stream_raw_upload(request: Request, dest: Path, limit: int, *, timeout_s: float | None = None) -> int:
    """Stream an ``application/octet-stream`` body into ``dest`` (under the deadline of ``timeout_s``);
    returns its size."""
    declared = check_declared_length(request, limit, "model upload")
    with _open_staged(dest) as fh:
        sink = _FileSink(fh, limit)
        async for chunk in _chunks(request, declared, limit, "model upload", timeout_s):
            sink.add(chunk)
            await sink.flush()
        await sink.flush(force=True)
    if sink.size == 0:
        raise BadRequestError("the upload body is empty")
    return sink.size


class MultipartFields:
    """Callbacks of python-multipart's streaming parser, header bookkeeping included; a subclass says what
    a part is (``on_headers_finished``, with ``field_name``) and where its data goes (``on_part_data``)."""

    def __init__(self) -> None:
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.disposition = b""
        self.ended = False

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": lambda d, s, e: self.header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self.header_value.extend(d[s:e]),
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_end": self.on_end,
        }

    def field_name(self) -> str:
        """The current part's name from its Content-Disposition ("" when it has none)."""
        _, options = parse_options_header(self.disposition)
        return options.get(b"name", b"").decode("latin-1")

    def on_part_begin(self) -> None:
        self.disposition = b""

    def on_header_end(self) -> None:
        if bytes(self.header_field).strip().lower() == b"content-disposition":
            self.disposition = bytes(self.header_value)
        self.header_field.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        raise NotImplementedError

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        raise NotImplementedError

    def on_end(self) -> None:
        self.ended = True


class _FormState(MultipartFields):
    """The upload form: routes part data to the file or the config field."""

    def __init__(self, sink: _FileSink) -> None:
        super().__init__()
        self.sink = sink
        self.current: str | None = None
        self.seen: set[str] = set()
        self.texts: dict[str, bytearray] = {}

    def on_part_begin(self) -> None:
        super().on_part_begin()
        self.current = None

    def on_headers_finished(self) -> None:
        name = self.field_name()
        if name != "file" and name not in TEXT_FIELDS:
            raise BadRequestError(
                f"unexpected form field {name[:64]!r}; send 'file' and optionally 'config' and 'labels'"
            )
        if name in self.seen:
            raise BadRequestError(f"form field {name!r} given twice")
        self.seen.add(name)
        self.current = name

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.current == "file":
            self.sink.add(data[start:end])
        elif self.current is not None:
            text = self.texts.setdefault(self.current, bytearray())
            text.extend(data[start:end])
            if len(text) > TEXT_FIELDS[self.current]:
                raise PayloadTooLargeError(
                    f"form field {self.current!r} is larger than {TEXT_FIELDS[self.current]} bytes"
                )


async def stream_multipart_upload(
    request: Request, dest: Path, limit: int, *, timeout_s: float | None = None
) -> str | None:
    """Stream the ``file`` field of a multipart form into ``dest``; returns the ``config`` field."""
    return (await stream_multipart_form(request, dest, limit, timeout_s=timeout_s)).get("config")


async def stream_multipart_form(
    request: Request, dest: Path, limit: int, *, timeout_s: float | None = None
) -> dict[str, str]:
    """Stream the ``file`` field of a multipart form into ``dest`` (under the deadline of ``timeout_s``);
    returns the text fields given (``TEXT_FIELDS``: ``config``, ``labels``), decoded as UTF-8 (400 for labels
    that are not; the config's JSON parser names what is wrong with it)."""
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequestError("multipart body without a boundary")
    body_limit = limit + MULTIPART_OVERHEAD
    declared = check_declared_length(request, body_limit, "model upload")
    with _open_staged(dest) as fh:
        state = _FormState(_FileSink(fh, limit))
        try:
            parser = MultipartParser(boundary, state.callbacks(), max_size=body_limit)  # type: ignore[arg-type]
        except Exception:
            raise BadRequestError("invalid multipart boundary") from None
        received = 0
        async for chunk in _chunks(request, declared, body_limit, "model upload", timeout_s):
            received += len(chunk)
            if received > body_limit:
                raise _too_large(limit, "model upload")
            _feed(parser, chunk)
            await state.sink.flush()
        await state.sink.flush(force=True)
    if not state.ended:
        raise BadRequestError("the multipart body is truncated (no closing boundary)")
    if "file" not in state.seen or state.sink.size == 0:
        raise BadRequestError("the multipart form has no (or an empty) 'file' field")
    return {name: _utf8(state.texts.get(name, b""), name) for name in TEXT_FIELDS if name in state.seen}


def _utf8(data: bytes | bytearray, name: str) -> str:
    if name == "config":
        return bytes(data).decode("utf-8", errors="replace")
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"form field {name!r} is not UTF-8 text (byte {exc.start})") from None


def _feed(parser: MultipartParser, chunk: bytes) -> None:
    try:
        parser.write(chunk)
    except (BadRequestError, PayloadTooLargeError):
        raise
    except Exception:  # python-multipart's MultipartParseError and friends
        raise BadRequestError("malformed multipart body") from None
