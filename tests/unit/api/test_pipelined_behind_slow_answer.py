"""Requests pipelined behind a request whose answer is still pending arrive while the parser is not reading a
head (h11 keeps them unparsed until the answer completes): they must not count against the head limit. A real
uvicorn with the guarded protocols; the first answer is held back so the timing is certain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from inprocess import uvicorn_serving

from service.server.http_guard import H11Guard, HttpToolsGuard

HOLD_S = 0.4
BODY = bytes(range(256)) * 800  # 200 KiB: three times the head limit, and no blank line in it


async def counting_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers the size of the request body; /slow answers after HOLD_S."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(HOLD_S)
    payload = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length"))
    return int(lines[0].split()[1]), await asyncio.wait_for(reader.readexactly(length), 10)


@pytest.mark.parametrize("protocol", [H11Guard, HttpToolsGuard], ids=["h11", "httptools"])
def test_requests_pipelined_behind_a_pending_answer_are_served(protocol: type) -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        async with uvicorn_serving(counting_app, protocol) as client:
            reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
            writer.write(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(HOLD_S / 4)  # the first request is whole, its answer pending
            writer.write(b"GET /fast HTTP/1.1\r\nhost: t\r\n\r\n"
                         + b"POST /fast HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)
            await writer.drain()
            answers = [await answer(reader) for _ in range(3)]
            writer.close()
            return answers

    assert asyncio.run(scenario()) == [(200, b"0"), (200, b"0"), (200, str(len(BODY)).encode())]
