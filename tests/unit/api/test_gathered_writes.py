"""GatheredWrites: the writes of one event-loop step reach the socket as one; a real uvicorn answers through it."""

from __future__ import annotations

import asyncio

import uvicorn
from inprocess import uvicorn_serving
from uvicorn.server import ServerState

from service.server.run import uvicorn_config
from service.server.transport import GatheredWrites, GatheredWritesProtocol, ServedProtocol
from service.settings import ServiceSettings


class RecordingTransport:
    """Records what reaches it, call by call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", [data]))

    def writelines(self, lines) -> None:
        self.calls.append(("writelines", list(lines)))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append(("close", []))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", []))
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def gathered() -> tuple[GatheredWrites, RecordingTransport, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    transport = RecordingTransport()
    return GatheredWrites(transport, loop), transport, loop


def run_one_step(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0))


def test_writes_of_one_step_leave_as_one_call():
    proxy, transport, loop = gathered()
    try:
        proxy.write(b"HTTP/1.1 200 OK\r\n\r\n")
        proxy.write(bytearray(b"body"))
        proxy.write(b"")  # nothing to send: not a part
        assert transport.calls == []  # nothing reaches the socket inside the step
        assert proxy.get_write_buffer_size() == 19 + 4 + 7
        run_one_step(loop)
        assert transport.calls == [("writelines", [b"HTTP/1.1 200 OK\r\n\r\n", b"body"])]
        proxy.write(b"next")
        run_one_step(loop)
        assert transport.calls[-1] == ("write", [b"next"])  # a lone write stays a write
    finally:
        loop.close()


def test_a_mutable_buffer_is_copied_when_written():
    proxy, transport, loop = gathered()
    try:
        data = bytearray(b"abc")
        proxy.write(data)
        data[:] = b"xyz"  # the caller reuses its buffer after write() returned
        run_one_step(loop)
        assert transport.calls == [("write", [b"abc"])]
    finally:
        loop.close()


def test_close_sends_what_was_gathered_first_and_abort_drops_it():
    proxy, transport, loop = gathered()
    try:
        proxy.write(b"last words")
        proxy.close()
        assert transport.calls == [("write", [b"last words"]), ("close", [])]
        run_one_step(loop)  # the scheduled flush finds nothing left
        assert len(transport.calls) == 2
    finally:
        loop.close()
    proxy, transport, loop = gathered()
    try:
        proxy.write(b"never sent")
        proxy.abort()
        run_one_step(loop)
        assert transport.calls == [("abort", [])]
    finally:
        loop.close()


def test_other_transport_calls_pass_through():
    proxy, _, loop = gathered()
    try:
        assert proxy.get_extra_info("peername") == ("127.0.0.1", 1)
        assert proxy.is_closing() is False
    finally:
        loop.close()


def test_the_server_always_writes_through_the_gathering_protocol():
    served = uvicorn_config(ServiceSettings(_env_file=None), object()).http
    assert served is ServedProtocol
    loop = asyncio.new_event_loop()
    try:
        inner = served(config=uvicorn.Config(object()), server_state=ServerState(), app_state={}, _loop=loop)
    finally:
        loop.close()
    assert isinstance(getattr(inner, "inner", inner), GatheredWritesProtocol)


def test_a_real_uvicorn_answers_through_it(monkeypatch):
    """Head and body of every response arrive (two apps: a one-shot response and a streamed one)."""
    flushed: list[int] = []
    real_flush = GatheredWrites.flush

    def counting_flush(self):
        flushed.append(len(self._pending))
        real_flush(self)

    monkeypatch.setattr(GatheredWrites, "flush", counting_flush)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for index in range(3):
                await send({"type": "http.response.body", "body": b"%d;" % index, "more_body": True})
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"end"})
            return
        reply = body[::-1] * 1000
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})

    async def main():
        async with uvicorn_serving(app, GatheredWritesProtocol) as client:
            for _ in range(3):  # a kept-alive connection answers one request after another
                r = await client.post("/", content=b"abc")
                assert r.status_code == 200 and r.content == b"cba" * 1000
            streamed = await client.get("/stream")
            assert streamed.content == b"0;1;2;end"

    asyncio.run(main())
    assert 2 in flushed  # a response's head and body went out together
