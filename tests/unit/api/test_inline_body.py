"""Inference bodies taken whole by the HTTP protocol (``service.server.inline_body``): which bodies qualify, the
flow control of an ``InlineBody`` on a stand-in cycle, and a real uvicorn (uvloop) serving ``ServedProtocol``
whose reads land in the body's buffer and reach the application without a copy."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import struct
import tracemalloc
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import uvicorn
import uvloop
from inprocess import uvicorn_serving
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.server import ServerState

from service.api.bodies import inline_body_of
from service.server.http_guard import MAX_HEAD_BYTES, HttpToolsGuard
from service.server.inline_body import INLINE_BODY_MAX, INLINE_PATHS, READ_SIZE, InlineBody, inline_length
from service.server.transport import BufferedReads, ServedProtocol


@pytest.mark.parametrize(("headers", "length"), [
    ([(b"content-length", b"600000")], 600_000),
    ([(b"host", b"t"), (b"content-length", b" 12 ")], 12),
    ([(b"content-length", b"0")], None),
    ([(b"content-length", str(INLINE_BODY_MAX + 1).encode())], None),
    ([(b"content-length", b"10"), (b"transfer-encoding", b"chunked")], None),
    ([(b"transfer-encoding", b"chunked")], None),
    ([(b"content-length", b"-1")], None),
    ([], None),
])
def test_which_bodies_are_taken_whole(headers: list[tuple[bytes, bytes]], length: int | None) -> None:
    assert inline_length(headers) == length


@pytest.mark.parametrize(("path", "taken"), [
    ("/v2/models/m/infer", True), ("/v2/models/m/versions/2/infer", True), ("/predict", True),
    ("/v1/models/m", False), ("/v2/models/m/infer/x", False), ("/v2/repository/models/m/load", False),
])
def test_only_inference_routes_take_bodies_whole(path: str, taken: bool) -> None:
    assert (INLINE_PATHS.fullmatch(path) is not None) == taken


class _Flow:
    def __init__(self) -> None:
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class _Cycle(SimpleNamespace):
    """A stand-in for uvicorn's cycle, which a body references weakly."""

    __slots__ = ("__weakref__",)


def _cycle() -> Any:
    return _Cycle(scope={"path": "/predict"}, flow=_Flow(), response_complete=False, disconnected=False,
                  waiting_for_100_continue=False, message_event=asyncio.Event(), receive=None)


def test_reading_pauses_until_the_application_asks_then_the_body_arrives_whole() -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 * HIGH_WATER_LIMIT, np.uint8).tobytes()
    cycle = _cycle()
    body = InlineBody(cycle, len(data))
    assert cycle.receive == body.receive and inline_body_of(cycle.scope) is body
    assert body.add(data[:HIGH_WATER_LIMIT]) == HIGH_WATER_LIMIT and not cycle.flow.paused
    window = body.window()
    window[:HIGH_WATER_LIMIT] = data[HIGH_WATER_LIMIT:2 * HIGH_WATER_LIMIT]  # a read straight into the buffer
    body.received(HIGH_WATER_LIMIT)
    assert cycle.flow.paused, "more than HIGH_WATER_LIMIT kept before the application asked"

    async def application() -> memoryview | None:
        waiting = asyncio.ensure_future(body.view())
        await asyncio.sleep(0)
        assert not cycle.flow.paused, "asking for the body resumes reading"
        assert body.add(data[2 * HIGH_WATER_LIMIT:] + b"next request") == HIGH_WATER_LIMIT
        cycle.message_event.set()  # the protocol's message-complete
        return await waiting

    view = asyncio.run(application())
    assert view is not None and view.readonly and bytes(view) == data
    assert inline_body_of(cycle.scope) is None, "a body is taken once"


def test_a_body_answered_unread_is_dropped_without_pausing() -> None:
    cycle = _cycle()
    body = InlineBody(cycle, 4 * HIGH_WATER_LIMIT)
    cycle.response_complete = True
    assert body.window() is None
    assert body.add(bytes(4 * HIGH_WATER_LIMIT)) == 4 * HIGH_WATER_LIMIT
    assert body.complete and not cycle.flow.paused


def test_a_client_gone_before_its_body_ends_is_a_disconnect() -> None:
    cycle = _cycle()
    body = InlineBody(cycle, 10)

    async def application() -> tuple[dict[str, Any], memoryview | None]:
        waiting = asyncio.ensure_future(body.receive())
        await asyncio.sleep(0)
        cycle.disconnected = True
        cycle.message_event.set()
        return await waiting, await body.view()

    message, view = asyncio.run(application())
    assert message == {"type": "http.disconnect"} and view is None


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_real_uvicorn_reads_an_inference_body_into_its_buffer(run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """ServedProtocol on either event loop: a 2 MB /predict body reaches the application as a view of the
    buffer the socket was read into (only the part in the head's read is copied there), equal; another path
    gets ASGI's bytes, as before."""
    seen: list[tuple[str, bool, int]] = []
    copied: list[int] = []
    real_add = InlineBody.add

    def counted_add(self: InlineBody, data: bytes | memoryview) -> int:
        copied.append(len(data))
        return real_add(self, data)

    monkeypatch.setattr(InlineBody, "add", counted_add)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        inline = inline_body_of(scope)
        if inline is not None:
            view = await inline.view()
            assert view is not None
            body = bytes(view)
        else:
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        seen.append((scope["path"], inline is not None, len(body)))
        reply = np.frombuffer(body, np.uint8).sum(dtype=np.uint64).tobytes()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})

    data = np.random.default_rng(1).integers(0, 256, 2_000_000, np.uint8)

    async def main() -> None:
        async with uvicorn_serving(app, ServedProtocol) as client:
            for path in ("/predict", "/v1/models/m", "/predict"):
                r = await client.post(path, content=data.tobytes())
                assert r.status_code == 200
                assert np.frombuffer(r.content, np.uint64)[0] == data.sum(dtype=np.uint64)

    run(main())
    assert seen == [("/predict", True, 2_000_000), ("/v1/models/m", False, 2_000_000), ("/predict", True, 2_000_000)]
    assert sum(copied) <= 2 * 256 * 1024, f"{sum(copied)} bytes copied into the buffers, not read into them"


def test_a_connection_holds_no_read_buffer_of_its_own() -> None:
    """Reads other than an inline body's land in one scratch buffer of the event loop's thread, shared by every
    connection: an idle connection costs kilobytes (a 256 KiB buffer each grew the server by 257 MiB for 1,000
    connections trickling a head)."""
    loop = asyncio.new_event_loop()
    config = uvicorn.Config(object())
    try:
        def connection() -> Any:
            return ServedProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)

        first = connection()
        scratch = first.get_buffer(-1).obj  # this thread's scratch buffer exists from here on
        tracemalloc.start()
        try:
            others = [connection() for _ in range(100)]
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert all(other.get_buffer(-1).obj is scratch for other in others)
    finally:
        loop.close()
    assert held / len(others) < 16 * 1024, f"{held / len(others) / 1024:.0f} KiB a connection"


def test_interleaved_connections_share_the_scratch_buffer_safely() -> None:
    """12 connections send heads and bodies (inline and through the parser) in small pieces, taking turns: each
    answer is its own request's path and body checksum."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        inline = inline_body_of(scope)
        if inline is not None:
            view = await inline.view()
            body = bytes(view) if view is not None else b""
        else:
            body, more = b"", True
            while more:
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
        reply = b"%s %d" % (scope["path"].encode(), sum(body))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})

    rng = np.random.default_rng(2)
    paths = ["/predict" if index % 2 else f"/v1/models/m{index}" for index in range(12)]
    bodies = [rng.integers(0, 256, 3000 + 997 * index, np.uint8).tobytes() for index in range(12)]

    async def main() -> list[bytes]:
        async with uvicorn_serving(app, ServedProtocol) as client:
            streams = [await asyncio.open_connection("127.0.0.1", client.base_url.port) for _ in paths]
            requests = [b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body
                        for path, body in zip(paths, bodies, strict=True)]
            for start in range(0, max(map(len, requests)), 701):
                for (_, writer), data in zip(streams, requests, strict=True):
                    writer.write(data[start:start + 701])
                await asyncio.sleep(0.001)
            answers = []
            for reader, writer in streams:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                answers.append(await asyncio.wait_for(reader.readexactly(length), 10))
                writer.close()
            return answers

    expected = [b"%s %d" % (path.encode(), sum(body)) for path, body in zip(paths, bodies, strict=True)]
    assert uvloop.run(main()) == expected


BEHIND = b"GET /behind HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.mark.parametrize("first_line", [
    b"POST %s HTTP/1.0\r\n", b"POST %s HTTP/1.1\r\nConnection: close\r\n",
    b"POST %s HTTP/1.0\r\nConnection: keep-alive\r\n",
], ids=["http-1.0", "connection-close", "http-1.0-keep-alive"])
@pytest.mark.parametrize("path", ["/predict", "/v1/models/m"], ids=["inline", "parser"])
@pytest.mark.parametrize("apart", [False, True], ids=["with-the-head", "after-the-head"])
def test_nothing_behind_the_last_request_of_a_connection_is_parsed(
    first_line: bytes, path: str, apart: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that will not be kept alive is the connection's last: a request sent behind it is never parsed
    (never reaches the parser's URL callback, let alone the application), whether its body is taken inline or by
    the parser, and whether it arrived in the head's read or after it; one answer, then the server closes."""
    parsed: list[bytes] = []
    real_on_url = HttpToolsGuard.on_url

    def on_url(self: HttpToolsGuard, url: bytes) -> None:
        parsed.append(url)
        real_on_url(self, url)

    monkeypatch.setattr(HttpToolsGuard, "on_url", on_url)
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        inline = inline_body_of(scope)
        if inline is not None:
            assert await inline.view() is not None
        else:
            while (await receive()).get("more_body"):
                pass
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    body = bytes(range(256)) * 4
    head = first_line % path.encode() + b"Host: t\r\nContent-Length: %d\r\n\r\n" % len(body)

    async def main() -> bytes:
        async with uvicorn_serving(app, ServedProtocol) as client:
            reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
            if apart:
                writer.write(head)
                await asyncio.sleep(0.05)
                writer.write(body + BEHIND)
            else:
                writer.write(head + body + BEHIND)
            answer = await asyncio.wait_for(reader.read(), 10)  # until the server closes
            writer.close()
            return answer

    answer = uvloop.run(main())
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.endswith(b"ok"), answer
    assert seen == [path]
    assert parsed == [path.encode()], parsed


def test_a_flood_behind_the_last_request_is_not_read_on() -> None:
    """Behind a ``Connection: close`` request a client sends 8 MiB: the server reads on no more than the head
    budget (and the read that crossed it) before it pauses, and still answers the request."""
    read: list[int] = []
    real_buffer_updated = BufferedReads.buffer_updated

    def buffer_updated(self: BufferedReads, nbytes: int) -> None:
        read.append(nbytes)
        real_buffer_updated(self, nbytes)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        inline = inline_body_of(scope)
        assert inline is not None and await inline.view() is not None
        await asyncio.sleep(0.3)  # the flood arrives meanwhile
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    body = bytes(1000)
    request = b"POST /predict HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 1000\r\n\r\n" + body

    async def main() -> bytes:
        async with uvicorn_serving(app, ServedProtocol) as client:
            reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
            writer.write(request + b"x" * (8 << 20))
            answer = b""
            with contextlib.suppress(ConnectionResetError):  # closed on the unread flood: a reset after the answer
                while chunk := await asyncio.wait_for(reader.read(65536), 10):
                    answer += chunk
            writer.transport.abort()
            return answer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BufferedReads, "buffer_updated", buffer_updated)
        answer = uvloop.run(main())
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok"), answer
    assert sum(read) <= len(request) + MAX_HEAD_BYTES + READ_SIZE, sum(read)


@pytest.mark.parametrize("reset", [True, False], ids=["reset-mid-answer", "closed-after-the-answer"])
def test_a_connection_gone_frees_its_request_and_answer_at_once(reset: bool) -> None:
    """Nothing keeps a connection's protocol, request body or unsent answer once it is gone, without waiting for
    Python's cyclic collector (off here) or a timer: a client resets while reading an 8 MiB answer, or reads it
    whole and closes. (uvicorn's keep-alive timer outlived a reset by its 5 s, and a body referencing its cycle
    made both cyclic garbage: three rounds of such clients grew a server by hundreds of MiB.)"""
    gone: list[weakref.ref[Any]] = []
    real_connection_made = BufferedReads.connection_made

    def connection_made(self: BufferedReads, transport: Any) -> None:
        gone.append(weakref.ref(self.inner))
        real_connection_made(self, transport)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        inline = inline_body_of(scope)
        assert inline is not None and await inline.view() is not None
        gone.append(weakref.ref(inline.buffer.obj))  # the request body's memory
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % (8 << 20))]})
        await send({"type": "http.response.body", "body": bytes(8 << 20)})

    async def main() -> tuple[int, list[str]]:
        async with uvicorn_serving(app, ServedProtocol) as client:
            sock = socket.create_connection(("127.0.0.1", client.base_url.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n"
                                    + bytes(100_000))
            received = 0
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 10):
                received += len(chunk)
                if reset and received > 100_000:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                if received >= 8 << 20:
                    break
            sock.close()
            deadline = loop.time() + 2
            while any(ref() is not None for ref in gone) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            return received, [type(ref()).__name__ for ref in gone if ref() is not None]  # the server still runs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BufferedReads, "connection_made", connection_made)
        gc.disable()
        try:
            received, alive = uvloop.run(main())
        finally:
            gc.enable()
    assert received < 8 << 20 if reset else received >= 8 << 20
    assert len(gone) == 2 and alive == [], alive
